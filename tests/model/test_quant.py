"""int8 weight-only linear layers (kvchat.model.quant): the scheme's error bound, both kernels, the stored
tensors reused, and the weight format in the cache fingerprint."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from turn_helpers import prefill

from kvchat.engine.block_manager import SeqBlocks
from kvchat.engine.cache_identity import CacheIdentity, cache_fingerprint, resolve_weight_format
from kvchat.engine.runner import Engine
from kvchat.kernels import cpu_int8
from kvchat.model import quant
from kvchat.model.config import ModelConfig
from kvchat.model.int8_scheme import stored_scheme
from kvchat.model.quantized_load import QuantizingLoad, open_stored
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


@pytest.mark.parametrize("rows", [1, 15, quant.INT8MM_MAX_ROWS + 1])
@pytest.mark.parametrize("group", [None, 64])
def test_int8_linear_matches_its_dequantized_weight(rows, group):
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 192, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(192, rows, generator=gen).t()  # strided, as attention's output reaches o_proj
    q, scale = quant.quantize_int8(w, group)
    want = F.linear(x, _dequant(q, scale), b)
    got = quant.Int8Linear(q, scale, b)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    if rows > quant.INT8MM_MAX_ROWS:  # fp32 GEMM over the dequantized weight: fp32 rounding only
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:  # the exact product of the bf16-rounded activations, up to the bf16 rounding of each kernel result
        # (2**-9 relative: half a unit in the last of 8 mantissa bits; 2**-8 allowed for the fp32 sums)
        xb = x.bfloat16().float()
        partials = [F.linear(xb[:, g * q.shape[2]:(g + 1) * q.shape[2]], q[g].float() * scale[g][:, None])
                    for g in range(q.shape[0])]  # each group's result is rounded to bf16 on its own
        err = (got - (sum(partials) + b)).abs()
        assert (err <= 2**-8 * sum(p.abs() for p in partials) + 1e-4).all()
        assert not torch.equal(got, want)  # the cast to bf16 happened


def _group_dequant(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    out, k = q.shape
    return (q.double().view(out, scale.shape[1], -1) * scale.double()[..., None] + offset.double()[..., None]).view(out, k)


def test_affine_groups_keep_each_groups_extremes_and_half_a_step():
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0)) * 0.05 + 0.01
    w[3, 17] = 2.0  # an outlier widens only its own group's step
    w[5, 32:64] = 0.25  # a constant group: exact
    q, scale, offset = quant.quantize_int8_groups(w)
    assert q.shape == (48, 256) and scale.shape == offset.shape == (48, 8) and q.dtype == torch.int8
    back = _group_dequant(q, scale, offset)
    step = scale.double().repeat_interleave(32, dim=1)
    assert ((back - w.double()).abs() <= step / 2 * (1 + 1e-5)).all()
    assert int(q.min()) == -128 and int(q.max()) == 127  # every group spans the grid
    assert torch.equal(back[5, 32:64].float(), w[5, 32:64])
    assert float(step[3, 0]) > 5 * float(step[3, 40])  # the outlier widens its own group only (~8x here)
    with pytest.raises(ValueError, match="groups of 32"):
        quant.quantize_int8_groups(torch.randn(4, 48))


@pytest.mark.skipif(not cpu_int8.available(), reason="the compiled CPU int8 kernel does not build here")
@pytest.mark.parametrize("rows", [1, 15, quant.GROUPS_KERNEL_MAX_ROWS + 1])
def test_group_linear_is_its_dequantized_weight_in_fp32(rows):
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 192, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(192, rows, generator=gen).t()
    q, scale, offset = quant.quantize_int8_groups(w)
    got = quant.Int8GroupLinear(q, scale, offset, b)(x)
    wd = _group_dequant(q, scale, offset)
    exact = F.linear(x.double(), wd, b.double())
    # magnitudes of what the kernel sums: |x| times |scale * q| and |offset| apart (they may cancel in w)
    parts = (q.double().abs().view(96, -1, 32) * scale.double()[..., None] + offset.double().abs()[..., None])
    mass = F.linear(x.abs().double(), parts.view(96, 192), b.abs().double())
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    # fp32 rounding only (the kernel's per-group chains and the offsets' terms, or the fp32 GEMM of the
    # dequantized weight): far under 2**-16 of those magnitudes; a bf16 activation would be ~2**-9 off
    assert ((got.double() - exact).abs() <= 2**-16 * mass).all()


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
    kernel = cpu_int8.small_rows_kernel()
    path = quant.quantized_path("tiny", stored_scheme(kernel))
    assert path.is_file() and path.parent.parent == tmp_path
    linears = [m for m in first.model.modules() if isinstance(m, quant.QUANTIZED_LAYERS)]
    assert len(linears) == 2 * 4 + 1 and not any(isinstance(m, Linear) for m in first.model.modules())
    down = first.model.layers[0].mlp.down_proj
    if cpu_int8.available():  # the groups scheme: 512 inputs in groups of 32
        assert isinstance(down, quant.Int8GroupLinear) and down.groups == 512 // cpu_int8.GROUP
    else:
        assert isinstance(down, quant.Int8Linear) and down.groups == 512 // quant.GROUP_SIZES["down_proj"]
    stamp = path.stat().st_mtime_ns
    assert QuantizingLoad(cfg, weights, torch.device("cpu"), 8, kernel, path).from_stored  # read, not quantized again
    reread = Engine(cfg, weights, "tiny", kv_dtype="bf16", pool_bytes=2**20, device="cpu", weight_format="int8")
    assert path.stat().st_mtime_ns == stamp
    ids = list(range(1, 20))
    assert torch.equal(prefill(reread, SeqBlocks(), ids).logits, prefill(first, SeqBlocks(), ids).logits)
    # a file of another scheme (or for other layers) is not used: quantized again and replaced
    from safetensors.torch import save_file

    save_file({"x.q": torch.zeros(1, dtype=torch.int8)}, str(path), metadata={"scheme": "other"})
    assert open_stored(path, "other", {"x.q": ((1,), torch.int8)}) is not None
    load = QuantizingLoad(cfg, weights, torch.device("cpu"), 8, kernel, path)
    model = load.finish()
    assert not load.from_stored and torch.equal(model.layers[0].mlp.down_proj.q, down.q)
    assert open_stored(path, "other", {"x.q": ((1,), torch.int8)}) is None and path.stat().st_mtime_ns != stamp
    # the engine's layers and its fingerprint name the same kernel (chosen once, Engine.int8_kernel)
    assert first.int8_kernel == kernel
    layers = first.compiled_decode is not None  # short chunks on the compiled decoder layers: named too
    assert layers == (kernel == "avx2")
    assert first.identity == CacheIdentity("tiny", "bf16", 16, "int8", int8_kernel=kernel, compiled_layers=layers)
    assert first.cache_fingerprint == first.identity.fingerprint
    assert first.cache_fingerprint != CacheIdentity("tiny", "bf16", 16, "int8",
                                                    int8_kernel="int8mm" if kernel == "avx2" else "avx2").fingerprint
    if kernel == "avx2":  # the per-channel scheme has a file of its own: the groups file is left alone
        stamp = path.stat().st_mtime_ns
        per_channel = quant.quantized_path("tiny", stored_scheme("int8mm"))
        load = QuantizingLoad(cfg, weights, torch.device("cpu"), 8, "int8mm", per_channel)
        model = load.finish()
        assert not load.from_stored and per_channel.is_file()
        assert isinstance(model.layers[0].mlp.down_proj, quant.Int8Linear) and path.stat().st_mtime_ns == stamp
    else:  # the groups scheme is refused where its kernel is not built
        with pytest.raises(ValueError, match="compiled CPU int8 kernel"):
            QuantizingLoad(cfg, weights, torch.device("cpu"), 8, "avx2")


def test_weight_format_is_in_the_cache_fingerprint_and_fp32_is_unchanged():
    old = cache_fingerprint("m", "fp8", "pth1+kc+sink", 16, "d")  # what every engine had before weight formats
    fp8 = CacheIdentity("m", "fp8", 16, calibration_digest="d", exact_sink=True)
    assert fp8.fingerprint == old and fp8.scale_scheme == "pth1+kc+sink"
    others = {CacheIdentity("m", "fp8", 16, w, calibration_digest="d", exact_sink=True).fingerprint
              for w in ("bf16", "int8")}
    assert len(others) == 2 and old not in others
    assert CacheIdentity("m", "bf16", 16, "int8").fingerprint != CacheIdentity("m", "bf16", 16).fingerprint
    assert resolve_weight_format("auto", "cpu", num_params=0) == "int8" and resolve_weight_format("auto", "cuda", num_params=0) == "bf16"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_weight_format("int8", "cuda", num_params=0)
