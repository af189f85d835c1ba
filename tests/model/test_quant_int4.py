"""int4 weight-only linear layers (kvchat.model.quant, --weights int4): the quantizer's error bound, the layer on
int8 activations at every row count (its two kernels) and close to its dequantized weight, the tensors stored once beside the
model, the compiled decode layers, and the format in the cache fingerprint."""

from __future__ import annotations

import pytest
import torch
import transformers
from turn_helpers import prefill

from kvchat.engine.block_manager import SeqBlocks
from kvchat.engine.cache_identity import CacheIdentity, fingerprint_variants, resolve_weight_format, weight_scheme
from kvchat.engine.runner import Engine
from kvchat.kernels import cpu_int4
from kvchat.model import quant
from kvchat.model.config import ModelConfig
from kvchat.model.int4_scheme import INT4_SCHEME, int4_compute_scheme

needs_kernel = pytest.mark.skipif(not cpu_int4.available(), reason="the compiled CPU int4 kernel does not build here")


def _dequant(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    q = cpu_int4.unpack(packed).double()
    out, k = q.shape
    return (q.view(out, -1, 32) * scale.double()[..., None] + minimum.double()[..., None]).view(out, k)


def test_int4_groups_are_within_half_a_step_and_span_the_grid():
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0)) * 0.05 + 0.01
    w[3, 17] = 2.0  # an outlier widens only its own group's step
    w[5, 32:64] = 0.25  # a constant group: exact (q 0, its minimum)
    packed, scale, minimum = quant.quantize_int4_groups(w)
    assert packed.shape == (48, 128) and packed.dtype == torch.uint8
    assert scale.shape == minimum.shape == (48, 8) and scale.dtype == minimum.dtype == torch.float16
    back = _dequant(packed, scale, minimum)
    step = scale.double().repeat_interleave(32, dim=1)
    # half a step, plus what the fp16 rounding of the minimum (2**-11 of it) and of the scale (2**-11 of the 15
    # steps above the minimum, at the group's top) can add
    slack = (minimum.double().abs().repeat_interleave(32, dim=1) + 15 * step) * 2**-11
    assert ((back - w.double()).abs() <= step / 2 + slack).all()
    q = cpu_int4.unpack(packed)
    assert int(q.min()) == 0 and int(q.max()) == 15
    assert torch.equal(back[5, 32:64].float(), w[5, 32:64])
    assert float(step[3, 0]) > 5 * float(step[3, 40])
    with pytest.raises(ValueError, match="groups of 32"):
        quant.quantize_int4_groups(torch.randn(4, 48))
    with pytest.raises(ValueError, match="fp16"):
        quant.quantize_int4_groups(torch.full((1, 32), 1e6))


def test_q4_1_blocks_come_back_exactly():
    """A weight that is already Q4_1 blocks (fp16 scale and minimum, every group using levels 0 and 15), as the
    imported default model's are, is quantized without loss."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (16, 128), dtype=torch.uint8, generator=gen)
    q[:, ::32], q[:, 1::32] = 0, 15
    scale, minimum = (torch.rand(16, 4, generator=gen) * 0.01).half(), (torch.randn(16, 4, generator=gen) * 0.1).half()
    w = _dequant(cpu_int4.pack(q), scale, minimum).float()
    packed, s, m = quant.quantize_int4_groups(w)
    assert torch.equal(_dequant(packed, s, m).float(), w)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 15, quant.GROUPS_KERNEL_MAX_ROWS + 1, 512])
def test_int4_linear_runs_int8_activations_at_every_row_count(rows):
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 192, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(192, rows, generator=gen).t()  # strided, as attention's output reaches o_proj
    packed, scale, minimum = quant.quantize_int4_groups(w)
    layer = quant.Int4GroupLinear(packed, scale, minimum, b)
    assert layer.weight_bytes == 96 * 192 // 2 + 2 * 2 * 96 * 6  # 0.625 bytes per weight
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    # its kernel's bits, the bias added after: the group kernel for few rows, the channel-lanes kernel for more;
    # the same formula (the reference) either way
    lanes = rows > quant.GROUPS_KERNEL_MAX_ROWS
    assert torch.equal(got, cpu_int4.int4_matmul(x, packed, scale, minimum, lanes=lanes) + b)
    torch.testing.assert_close(got - b, cpu_int4.reference(x, packed, scale, minimum), rtol=1e-4, atol=1e-4)
    want = x.double() @ _dequant(packed, scale, minimum).t()
    # int8 activations cost ~0.6% of the product's norm (tests/kernels/test_cpu_int4.py says why)
    assert (got.double() - b.double() - want).norm() / want.norm() < 0.01


def _tiny() -> tuple[ModelConfig, dict]:
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    return ModelConfig.from_hf(hf_cfg.to_dict()), dict(hf.state_dict())


@needs_kernel
def test_int4_engine_quantizes_once_then_reads_the_file_and_runs_the_compiled_layers(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_MODELS", str(tmp_path))
    cfg, weights = _tiny()
    first = Engine(cfg, weights, "tiny", kv_dtype="bf16", pool_bytes=2**20, device="cpu", weight_format="int4")
    path = quant.quantized_path("tiny", INT4_SCHEME)
    assert path.is_file() and path.parent.parent == tmp_path
    layers = [m for m in first.model.modules() if isinstance(m, quant.QUANTIZED_LAYERS)]
    assert len(layers) == 2 * 4 + 1 and all(type(m) is quant.Int4GroupLinear for m in layers if m is not first.model.lm_head)
    assert type(first.model.lm_head) is quant.Int8GroupLinear  # the head stays int8 (quant.layer_kind says why)
    assert first.compiled_decode is not None and first.plan.line().startswith("cpu, int4 weights, float32")
    assert first.identity == CacheIdentity("tiny", "bf16", 16, "int4", compiled_layers=True)
    stamp = path.stat().st_mtime_ns
    again = Engine(cfg, weights, "tiny", kv_dtype="bf16", pool_bytes=2**20, device="cpu", weight_format="int4")
    assert path.stat().st_mtime_ns == stamp  # read, not quantized again
    ids = list(range(1, 40))
    assert torch.equal(prefill(again, SeqBlocks(), ids).logits, prefill(first, SeqBlocks(), ids).logits)
    # the int8 file is another file: an int8 engine neither reads nor replaces the int4 one
    Engine(cfg, weights, "tiny", kv_dtype="bf16", pool_bytes=2**20, device="cpu", weight_format="int8")
    assert path.stat().st_mtime_ns == stamp and len(list(path.parent.iterdir())) == 2
    # int4 close to fp32 on this random model (the logits of 39 tokens), and not int8's numbers
    fp32 = Engine(cfg, weights, "tiny", kv_dtype="bf16", pool_bytes=2**20, device="cpu", weight_format="fp32")
    ref = prefill(fp32, SeqBlocks(), ids).logits
    err = (prefill(first, SeqBlocks(), ids).logits - ref).abs().max() / ref.abs().max()
    assert 0 < err < 0.3
    # the compiled decode layers of an int4 engine take a chunk and give the torch layers' numbers to fp32 rounding
    seq = SeqBlocks()
    with torch.inference_mode():
        prefill(first, seq, ids[:20])
        chunk = first._forward(seq, ids[:30], 20, 30)
    torch_layers = Engine(cfg, weights, "tiny", kv_dtype="bf16", pool_bytes=2**20, device="cpu", weight_format="int4")
    torch_layers.compiled_decode = None
    seq2 = SeqBlocks()
    with torch.inference_mode():
        prefill(torch_layers, seq2, ids[:20])
        plain = torch_layers._forward(seq2, ids[:30], 20, 30)
    torch.testing.assert_close(chunk, plain, rtol=1e-3, atol=1e-3)  # bf16 pool reads: same K/V bits both ways


def test_int4_is_its_own_cache_identity():
    assert resolve_weight_format("int4", "cpu", num_params=0) == "int4"
    with pytest.raises(ValueError, match="int4 weights run on the CPU only"):
        resolve_weight_format("int4", "cuda", num_params=0)
    assert weight_scheme("int4") == int4_compute_scheme() == "int4-affine-g32-f16-head8-v1-a8g32x32-lanesv1"
    assert (weight_scheme("int4", compiled_layers=True)
            == "int4-affine-g32-f16-head8-v1-a8g32x32-lanesv1-layer32v2-lanes5")
    int4 = {CacheIdentity("m", "bf16", 16, "int4", compiled_layers=c).fingerprint for c in (False, True)}
    int8 = {CacheIdentity("m", "bf16", 16, "int8", int8_kernel=k, compiled_layers=c).fingerprint
            for k, c in (("avx2", False), ("avx2", True), ("int8mm", False))}
    assert len(int4) == 2 and not int4 & int8  # an int4 cache is never restored into an int8 engine, nor the reverse
    assert int4 == fingerprint_variants("m", "bf16", 16, ("int4",))  # and a store's variants name both
    assert int4 | int8 <= fingerprint_variants("m", "bf16", 16)
