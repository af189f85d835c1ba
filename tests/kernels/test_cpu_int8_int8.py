"""The integer prefill kernel (kernels/cpu_int8_int8.c): its formula, its bits across builds, row counts and
thread counts, and what int8 activations cost against the float product."""

from __future__ import annotations

import pytest
import torch

from kvchat.kernels import cpu_build, cpu_int8_int8
from kvchat.model.quant import quantize_int8_groups

pytestmark = pytest.mark.skipif(not cpu_int8_int8.available(), reason="the compiled CPU kernels do not build here")
BUILDS = [v for v in cpu_build.VARIANTS if cpu_build.supported(v)]


def _layer(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[:, 5] += 0.3  # an outlier input column, as trained models have
    return w, *quantize_int8_groups(w)


def _rows(m: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 7] *= 40  # an outlier activation channel
    x[0, 32:64] = 0  # a group of zeros: scale 0, no NaN
    return x


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (7, 48, 96), (41, 64, 256)])
def test_matches_the_formula(m, n, k):
    _, q, scale, offset = _layer(n, k)
    x = _rows(m, k)
    y = cpu_int8_int8.int8_int8_matmul(x, q, scale, offset)
    ref = cpu_int8_int8.reference(x, q, scale, offset)
    assert y.isfinite().all()
    # float32 rounding of the epilogue: a few ulps of the largest term
    bound = 1e-5 * (x.abs().view(m, -1, 32).amax(2) @ scale.abs().t() * 32 * 128 + x.abs() @ offset.abs().repeat_interleave(32, 1).t())
    assert ((y - ref).abs() <= bound).all()


@pytest.mark.skipif(len(BUILDS) < 2, reason="one build runs on this CPU: nothing to compare it with")
def test_every_build_computes_the_same_bits():
    _, q, scale, offset = _layer(64, 512)
    x = _rows(37, 512)
    ys = {v: cpu_int8_int8.int8_int8_matmul(x, q, scale, offset, variant=v) for v in BUILDS}
    for v, y in ys.items():
        assert torch.equal(y, ys["avx2"]), v


def test_a_rows_bits_depend_on_neither_row_count_nor_threads():
    _, q, scale, offset = _layer(96, 256)
    x = _rows(45, 256)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = cpu_int8_int8.int8_int8_matmul(x, q, scale, offset)
        torch.set_num_threads(1)
        alone = [cpu_int8_int8.int8_int8_matmul(x[i:i + 1], q, scale, offset) for i in (0, 9, 44)]
        parts = torch.cat([cpu_int8_int8.int8_int8_matmul(x[a:b], q, scale, offset) for a, b in ((0, 3), (3, 20), (20, 45))])
    finally:
        torch.set_num_threads(old)
    for i, y in zip((0, 9, 44), alone):
        assert torch.equal(y[0], full[i])
    assert torch.equal(parts, full)


def test_a_group_too_small_to_scale_counts_as_zeros():
    """A group whose largest value is below 127 x FLT_MIN (127 / max would overflow to inf) gives the bits of
    an all-zero group, and the formula agrees."""
    _, q, scale, offset = _layer(16, 96)
    x = _rows(3, 96)
    tiny, zeros = x.clone(), x.clone()
    tiny[1] = torch.linspace(-1e-37, 1e-37, 96)  # a whole row, so no larger term hides its groups' part
    zeros[1] = 0
    y = cpu_int8_int8.int8_int8_matmul(tiny, q, scale, offset)
    assert y.isfinite().all()
    # the offsets' term still sees the groups' float sums (about 1e-37 here): compare without it
    no_offset = torch.zeros_like(offset)
    assert torch.equal(cpu_int8_int8.int8_int8_matmul(tiny, q, scale, no_offset),
                       cpu_int8_int8.int8_int8_matmul(zeros, q, scale, no_offset))
    assert torch.allclose(y, cpu_int8_int8.reference(tiny, q, scale, offset), rtol=1e-5, atol=1e-5)


def test_weights_at_the_int8_extremes_are_exact():
    """q = -128 (every asymmetric group's minimum) times negative activations: the sign trick must not wrap."""
    n, k = 16, 64
    q = torch.full((n, k), -128, dtype=torch.int8)
    q[1::2] = 127
    scale, offset = torch.ones(n, 2), torch.zeros(n, 2)
    x = torch.full((2, k), -1.0)
    x[1] = 1.0
    y = cpu_int8_int8.int8_int8_matmul(x, q, scale, offset)
    d = 1.0 / 127  # each group: max|x| = 1, so a = -127 or 127 and d = 1/127
    want = torch.tensor([[128.0 * 127 * 64 * d, -127.0 * 127 * 64 * d] * 8, [-128.0 * 127 * 64 * d, 127.0 * 127 * 64 * d] * 8])
    torch.testing.assert_close(y, want, rtol=1e-6, atol=0)


def test_int8_activations_stay_close_to_the_float_product():
    w, q, scale, offset = _layer(128, 2048)
    x = torch.randn(16, 2048, generator=torch.Generator().manual_seed(2))
    wq = (q.float().view(128, -1, 32) * scale[..., None] + offset[..., None]).view(128, 2048)
    exact = x @ wq.t()
    y = cpu_int8_int8.int8_int8_matmul(x, q, scale, offset)
    # each activation rounded to a step of max|x| / 127 (~2.5 sigma / 127 for 32 normal values): an error of
    # step / sqrt(12) ~ 0.006 sigma, so ~0.6% of the product's norm
    assert (y - exact).norm() / exact.norm() < 0.01


def test_refuses_what_it_cannot_take():
    _, q, scale, offset = _layer(24, 64)  # 24 channels: not a multiple of 16
    assert not cpu_int8_int8.takes(24, 64)
    with pytest.raises(ValueError, match="not a layout"):
        cpu_int8_int8.int8_int8_matmul(torch.randn(3, 64), q, scale, offset)
