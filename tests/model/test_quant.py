"""int8 weight-only linear layers (kvchat.model.quant): the scheme's error bound, both kernels, the stored
tensors reused, and the weight format in the cache fingerprint."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from kvchat.engine.cache_identity import cache_fingerprint, engine_identity, resolve_weight_format
from kvchat.engine.block_manager import SeqBlocks
from kvchat.engine.runner import Engine
from kvchat.kernels import cpu_int8
from kvchat.model import quant
from kvchat.model.config import ModelConfig
from kvchat.model.transformer import Linear


def _dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    groups, out, group = q.shape
    return (q.float() * scale[..., None]).transpose(0, 1).reshape(out, groups * group)


@pytest.mark.parametrize("group", [None, 64])
def test_quantize_error_is_at_most_half_a_step(group):
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    w[3, 17] = 2.0  # an outlier widens only its own row's (group's) step
    q, scale = quant.quantize_int8(w, group)
    assert q.dtype == torch.int8 and q.shape == (256 // (group or 256), 48, group or 256)
    step = scale.t().repeat_interleave(group or 256, dim=1)
    assert ((_dequant(q, scale) - w).abs() <= step / 2 * (1 + 1e-6)).all()
    assert int(q.abs().max()) == 127


COMPILED = pytest.param("avx2", marks=pytest.mark.skipif(not cpu_int8.available(),
                                                         reason="the compiled CPU int8 kernel does not build here"))


@pytest.mark.parametrize("kernel", ["int8mm", COMPILED])
@pytest.mark.parametrize("rows", [1, 15, quant.INT8MM_MAX_ROWS + 1])
@pytest.mark.parametrize("group", [None, 64])
def test_int8_linear_matches_its_dequantized_weight(rows, group, kernel):
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 192, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(192, rows, generator=gen).t()  # strided, as attention's output reaches o_proj
    q, scale = quant.quantize_int8(w, group)
    want = F.linear(x, _dequant(q, scale), b)
    layer = quant.Int8Linear(q, scale, b, kernel)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    assert layer.compiled == (kernel == "avx2")
    if rows > quant.INT8MM_MAX_ROWS:  # fp32 GEMM over the dequantized weight: fp32 rounding only
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    elif kernel == "avx2" and rows <= quant.CPU_KERNEL_MAX_ROWS:  # fp32 activations as they are
        exact = F.linear(x.double(), _dequant(q, scale).double(), b.double())
        mass = F.linear(x.abs().double(), _dequant(q, scale).abs().double(), b.abs().double())
        # fp32 sums of <= 192 / 32 products per lane, then 5 reductions and the scale, bias and group sums:
        # well under 2**-18 of the sum of magnitudes (a bf16 input would be off by ~2**-9)
        assert ((got.double() - exact).abs() <= 2**-18 * mass).all()
    else:  # the exact product of the bf16-rounded activations, up to the bf16 rounding of each kernel result
        # (2**-9 relative: half a unit in the last of 8 mantissa bits; 2**-8 allowed for the fp32 sums)
        xb = x.bfloat16().float()
        partials = [F.linear(xb[:, g * q.shape[2]:(g + 1) * q.shape[2]], q[g].float() * scale[g][:, None])
                    for g in range(q.shape[0])]  # each group's result is rounded to bf16 on its own
        err = (got - (sum(partials) + b)).abs()
        assert (err <= 2**-8 * sum(p.abs() for p in partials) + 1e-4).all()
        assert not torch.equal(got, want)  # the cast to bf16 happened


def _tiny() -> tuple[ModelConfig, dict]:
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    return ModelConfig.from_hf(hf_cfg.to_dict()), dict(hf.state_dict())


def test_quantized_once_then_read_from_beside_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_MODELS", str(tmp_path))
    cfg, weights = _tiny()
    first = Engine(cfg, weights, "tiny", kv_dtype="bf16", pool_bytes=2**20, device="cpu", weight_format="int8")
    path = quant.int8_path("tiny")
    assert path.is_file() and path.parent.parent == tmp_path
    linears = [m for m in first.model.modules() if isinstance(m, quant.Int8Linear)]
    assert len(linears) == 2 * 4 + 1 and not any(isinstance(m, Linear) for m in first.model.modules())
    down = first.model.layers[0].mlp.down_proj
    assert down.groups == 512 // quant.GROUP_SIZES["down_proj"]
    stamp = path.stat().st_mtime_ns
    assert quant.quantize_linears(Engine(cfg, weights, "tiny", kv_dtype="bf16", pool_bytes=2**20, device="cpu",
                                         dense_kv=False).model, path)  # read, not quantized again
    assert path.stat().st_mtime_ns == stamp
    reread = Engine(cfg, weights, "tiny", kv_dtype="bf16", pool_bytes=2**20, device="cpu", weight_format="int8")
    ids = list(range(1, 20))
    assert torch.equal(reread.prefill(SeqBlocks(), ids).logits, first.prefill(SeqBlocks(), ids).logits)
    # a file of another scheme (or for other layers) is not used: quantized again and replaced
    from safetensors.torch import save_file

    save_file({"x.q": torch.zeros(1, dtype=torch.int8)}, str(path), metadata={"scheme": "other"})
    model = Engine(cfg, weights, "tiny", kv_dtype="bf16", pool_bytes=2**20, device="cpu").model
    assert not quant.quantize_linears(model, path)
    assert torch.equal(model.layers[0].mlp.down_proj.q, down.q)
    assert quant.load_int8(path, {"x": (1, 1, 1)}) is None and path.stat().st_mtime_ns != stamp


def test_weight_format_is_in_the_cache_fingerprint_and_fp32_is_unchanged():
    old = cache_fingerprint("m", "fp8", "pth1+kc+sink", 16, "d")  # what every engine had before weight formats
    assert engine_identity("m", "fp8", "d", True, 16, "fp32")[1] == old
    others = {engine_identity("m", "fp8", "d", True, 16, w)[1] for w in ("bf16", "int8")}
    assert len(others) == 2 and old not in others
    assert engine_identity("m", "bf16", None, False, 16, "int8")[1] != engine_identity("m", "bf16", None, False, 16)[1]
    assert resolve_weight_format("auto", "cpu") == "int8" and resolve_weight_format("auto", "cuda") == "bf16"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_weight_format("int8", "cuda")
