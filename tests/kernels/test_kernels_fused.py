"""The fused decode kernels (kvchat/kernels/triton_fused.py) against the torch operators they replace.

Without a GPU they run under the Triton interpreter (TRITON_INTERPRET=1 set before Triton is first
imported, as tests/kernels/test_kernels_triton.py explains), in fp32 and fp16 (the interpreter computes
bf16 wrongly); bf16 joins on a GPU. The tolerance is the module doc's: one unit in the last place of the
compute dtype in fp16/bf16, four in fp32 (the rounding steps are the operators'; the sum order,
``rsqrt``/``exp`` and FMA contraction may differ inside one). The fp8 cache bytes of V and every scale of V are the write kernel's
exactly; K's go through RoPE first, so they agree within one fp8 step.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

from kvchat.kernels import reference, triton_fused  # noqa: E402
from kvchat.kernels.layout import KVLayer  # noqa: E402
from kvchat.model.transformer import RMSNorm, apply_rope  # noqa: E402

if DEVICE.type == "cpu" and not triton_fused.INTERPRETED:
    pytest.skip("Triton was imported earlier in this process without TRITON_INTERPRET=1", allow_module_level=True)

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
FP8 = torch.float8_e4m3fn


def assert_ulp(out: torch.Tensor, ref: torch.Tensor, size: torch.Tensor | None = None) -> None:
    """``out`` within triton_fused's documented tolerance of ``ref``: 4 units in the last place in fp32, where
    nothing rounds away ``rsqrt``'s or the sum order's last bits; one in fp16/bf16. Units of each element's
    ``size`` (default: ``ref``'s magnitude; for a sum, its terms' magnitudes, as an FMA rounds once)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    ulps = 4 if ref.dtype == torch.float32 else 1
    err = (out.float() - ref.float()).abs()
    size = ref.float().abs() if size is None else size
    bound = size * ulps * torch.finfo(ref.dtype).eps + torch.finfo(ref.dtype).tiny
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g}, {int((err > bound).sum())} beyond {ulps} ulp"


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_is_the_residual_add_and_the_norm(dtype, with_delta):
    hidden = 96  # not a power of two: the masked tail
    norm = RMSNorm(hidden, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(hidden, dtype=dtype, seed=3))
    x, delta = _randn(5, hidden, dtype=dtype, seed=1), _randn(5, hidden, dtype=dtype, seed=2) * 4
    delta = delta if with_delta else None
    with torch.inference_mode():
        out, total = triton_fused.add_rms_norm(x, delta, norm.weight, norm.eps)
        ref_out, ref_total = norm.add_forward(x, delta)
    assert torch.equal(total, ref_total)  # one add, rounded once: the same bits
    assert_ulp(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_swiglus_product(dtype):
    inter = 80
    gate_up = _randn(3, 2 * inter, dtype=dtype, seed=4) * 3
    gate, up = gate_up.split(inter, dim=-1)
    assert_ulp(triton_fused.silu_mul(gate_up), F.silu(gate) * up)


def _rope_tables(positions: torch.Tensor, head_dim: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * inv
    cos = torch.cat((angles, angles), -1).cos().unsqueeze(1)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).unsqueeze(1)
    return cos.to(dtype).to(DEVICE), sin.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pool_dtype", [FP8, torch.float16])
@pytest.mark.parametrize("shift", [True, False])
def test_rope_write_is_rope_then_shift_then_the_cache_write(dtype, pool_dtype, shift):
    """Q rotated as apply_rope; K rotated, shifted and stored as triton_write stores it; V stored as is;
    slot -1 (a padded row) stores nothing but its Q."""
    tokens, heads, kv_heads, head_dim, block = 3, 4, 2, 16, 16
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=5) * 2
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    cos, sin = _rope_tables(torch.tensor([5, 17, 4000]), head_dim, dtype)
    k_shift = _randn(kv_heads, head_dim, dtype=dtype, seed=6) if shift else None
    slots = torch.tensor([3, -1, 40], device=DEVICE)
    shape = (4, block, kv_heads, head_dim)
    pools = []
    for _ in range(2):
        k_cache = torch.zeros(shape, dtype=pool_dtype, device=DEVICE)
        scales = [torch.full(shape[:3], -1.0, device=DEVICE) for _ in range(2)] if pool_dtype == FP8 else [None, None]
        pools.append(KVLayer(k_cache, k_cache.clone(), *scales))
    q = triton_fused.rope_write_kv(qk, v, cos, sin, k_shift, pools[0], slots)
    rotated = apply_rope(qk, cos, sin)
    k = rotated[:, heads:] if k_shift is None else rotated[:, heads:] - k_shift
    reference.write_kv(k, v, pools[1], slots)
    swapped = torch.cat((qk[..., head_dim // 2 :], qk[..., : head_dim // 2]), dim=-1)
    terms = (qk.float() * cos.float()).abs() + (swapped.float() * sin.float()).abs()  # the sum's terms
    assert_ulp(q, rotated[:, :heads], terms[:, :heads])
    (kc, vc, ks, vs), (rkc, rvc, rks, rvs) = ((p.k_cache, p.v_cache, p.k_scale, p.v_scale) for p in pools)
    assert torch.equal(vc.view(torch.uint8), rvc.view(torch.uint8))
    if pool_dtype == FP8:
        assert torch.equal(vs, rvs)
        got, want = reference.dequantize_fp8(kc, ks), reference.dequantize_fp8(rkc, rks)
        # K within the tolerance above -> within one e4m3 step (2**-3 relative) or its scale's subnormal step
        assert bool(((got - want).abs() <= want.abs() * 2**-3 + rks[..., None].abs() * 2**-9).all())
        assert (ks == -1).sum() == (rks == -1).sum() == ks.numel() - 2 * kv_heads  # two slots written
    else:
        size = float(terms.max()) + (float(k_shift.abs().max()) if shift else 0.0)  # K's terms at most
        assert_ulp(kc, rkc, torch.full(rkc.shape, size, device=DEVICE))
        assert int((kc != 0).any(-1).any(-1).flatten().sum()) == 2  # slot -1 wrote nothing


@pytest.mark.parametrize("pool_dtype", [FP8, torch.float16])
def test_warm_up_launches_each_kernel_and_writes_nothing_to_the_pool(pool_dtype):
    from kvchat.bench.launch_count import LaunchCounter

    shape = (2, 16, 2, 16)
    k_cache = torch.zeros(shape, dtype=pool_dtype, device=DEVICE)
    scales = [torch.zeros(shape[:3], device=DEVICE) for _ in range(2)] if pool_dtype == FP8 else [None, None]
    layer = KVLayer(k_cache, k_cache.clone(), *scales)
    with LaunchCounter() as counter:
        triton_fused.warm_up(64, 96, 4, torch.float16, layer, _randn(2, 16, dtype=torch.float16, seed=7))
    assert counter.outside_ops["_add_rms_norm_kernel"] == 2 and counter.outside_ops["_silu_mul_kernel"] == 1
    assert counter.outside_ops["_rope_write_kernel"] == 1
    assert all(not t.view(torch.uint8).any() for t in (layer.k_cache, layer.v_cache, *scales) if t is not None)
