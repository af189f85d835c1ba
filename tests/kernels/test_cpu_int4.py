"""The compiled CPU int4 matmul (kvchat.kernels.cpu_int4), its group kernel and its channel-lanes kernel: the
nibble layout, the formula (int8 activations on integer dot products), the bits whatever the row count, threads or
build, what the int8 activations cost against the float product, and the layouts each refuses."""

from __future__ import annotations

import threading

import pytest
import torch

from kvchat.kernels import cpu_build, cpu_int4
from kvchat.kernels.cpu_int8_int8 import quantize_activations
from kvchat.model.int4_scheme import INT4_LANE_MIN_TOKENS
from kvchat.model.quant import quantize_int4_groups

needs_kernel = pytest.mark.skipif(not cpu_int4.available(), reason="the compiled CPU int4 kernel does not build here")
BUILDS = [v for v in cpu_build.VARIANTS if cpu_build.supported(v)]


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q uint8 [n, k] in 0..15, packed, scale fp16, minimum fp16)``, random."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
    minimum = (torch.randn(n, k // 32, generator=gen) * 0.1).half()
    return q, cpu_int4.pack(q), scale, minimum


def test_pack_puts_a_groups_halves_in_the_low_and_high_nibbles():
    q = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64).flip(1).contiguous()
    packed = cpu_int4.pack(q)
    assert packed.shape == (1, 32) and packed.dtype == torch.uint8
    for g in range(2):
        for j in range(16):
            byte = int(packed[0, 16 * g + j])
            assert byte & 0x0F == int(q[0, 32 * g + j]) and byte >> 4 == int(q[0, 32 * g + 16 + j])
    rand = torch.randint(0, 16, (7, 96), dtype=torch.uint8)
    assert torch.equal(cpu_int4.unpack(cpu_int4.pack(rand)), rand)
    with pytest.raises(ValueError, match="groups of 32"):
        cpu_int4.pack(torch.zeros(2, 48, dtype=torch.uint8))


def _rows(m: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 7] *= 40  # an outlier activation channel, as trained models have
    x[0, 32:64] = 0  # a group of zeros: scale 0, no NaN
    return x


@needs_kernel
@pytest.mark.parametrize("n,k,lanes", [(40, 576, False), (24, 1536, False), (13, 64, False), (48, 576, True),
                                       (40, 576, True), (24, 1536, True), (13, 64, True)])
def test_each_row_is_the_formula_whatever_the_other_rows(n, k, lanes):
    _, packed, scale, minimum = _weights(n, k)
    x = _rows(15, k)  # rows in an eight and a seven (fours and a three), alone, in a pair, or among an odd count
    y = cpu_int4.int4_matmul(x, packed, scale, minimum, lanes=lanes)
    ref = cpu_int4.reference(x, packed, scale, minimum)
    a, d = quantize_activations(x)
    # fp32 rounding only (the integer dot products are exact): each product and partial sum rounds by 2**-24
    # relative over chains of at most k / 32 + 8 steps; 2**-16 of the sum of the absolute terms bounds that
    mass = (torch.einsum("mg,ng->mn", d.double() * 32 * 127, 15 * scale.double())
            + torch.einsum("mg,ng->mn", d.double() * a.abs().double().view(15, -1, 32).sum(2), minimum.double().abs()))
    assert y.isfinite().all() and ((y.double() - ref.double()).abs() <= 2**-16 * mass).all()
    for i in range(15):  # a row alone (decode) gives the bits it gets among others
        assert torch.equal(cpu_int4.int4_matmul(x[i : i + 1].clone(), packed, scale, minimum, lanes=lanes)[0], y[i])
    for start, stop in ((2, 5), (3, 7), (0, 4), (1, 13), (0, 9)):
        assert torch.equal(cpu_int4.int4_matmul(x[start:stop].clone(), packed, scale, minimum, lanes=lanes),
                           y[start:stop])
    if lanes:  # the same formula in another float order: other bits, the same product
        assert not torch.equal(y, cpu_int4.int4_matmul(x, packed, scale, minimum))


@pytest.mark.skipif(len(BUILDS) < 2, reason="one build runs on this CPU: nothing to compare it with")
@needs_kernel
@pytest.mark.parametrize("lanes", [False, True])
def test_every_build_computes_the_same_bits(lanes):
    _, packed, scale, minimum = _weights(40, 1024)  # two blocks of 16 channels and a tail of 8
    x = _rows(19, 1024)
    ys = {v: cpu_int4.int4_matmul(x, packed, scale, minimum, variant=v, lanes=lanes) for v in BUILDS}
    assert len({cpu_int4._library(v)._name for v in BUILDS}) == len(BUILDS)  # each its own library
    for v, y in ys.items():
        assert torch.equal(y, ys["avx2"]), v


@needs_kernel
def test_weights_and_activations_at_their_extremes_are_exact():
    """q = 15 against a = -127 and 127 (the largest products, pairs of 2 x 15 x 127 in vpmaddubsw's int16) and
    q = 0, with unit scales and no minimum: y is 32 x 15 x 127 x d per group, exactly."""
    n, k = 16, 64
    q = torch.full((n, k), 15, dtype=torch.uint8)
    q[1::2] = 0
    scale, minimum = torch.ones(n, 2).half(), torch.zeros(n, 2).half()
    x = torch.full((2, k), -1.0)
    x[1] = 1.0
    y = cpu_int4.int4_matmul(x, cpu_int4.pack(q), scale, minimum)
    d = 1.0 / 127  # each group: max|x| = 1, so a = -127 or 127 and d = 1/127
    want = torch.tensor([[-15.0 * 127 * 64 * d, 0.0] * 8, [15.0 * 127 * 64 * d, 0.0] * 8])
    torch.testing.assert_close(y, want, rtol=1e-6, atol=0)


@needs_kernel
def test_a_group_too_small_to_scale_counts_as_zeros():
    """A row whose largest value is below 127 x FLT_MIN (127 / max would overflow to inf) gives zeros, not NaN."""
    _, packed, scale, minimum = _weights(16, 96)
    x = _rows(3, 96)
    tiny, zeros = x.clone(), x.clone()
    tiny[1] = torch.linspace(-1e-37, 1e-37, 96)
    zeros[1] = 0
    y = cpu_int4.int4_matmul(tiny, packed, scale, minimum)
    assert torch.equal(y, cpu_int4.int4_matmul(zeros, packed, scale, minimum)) and not y[1].any()


@needs_kernel
def test_int8_activations_stay_close_to_the_float_product():
    """Against x times the dequantized weight in float64, on an int4-quantized trained-like weight: each
    activation rounds to a step of max|x| / 127 (~2.5 sigma / 127 for 32 normal values), an error of
    step / sqrt(12) ~ 0.006 sigma, so ~0.6% of the product's norm."""
    w = torch.randn(128, 2048, generator=torch.Generator().manual_seed(3)) * 0.02
    w[:, 5] += 0.3  # an outlier input column
    packed, scale, minimum = quantize_int4_groups(w)
    x = torch.randn(16, 2048, generator=torch.Generator().manual_seed(2))
    wq = (cpu_int4.unpack(packed).double().view(128, -1, 32) * scale.double()[..., None]
          + minimum.double()[..., None]).view(128, 2048)
    exact = x.double() @ wq.t()
    y = cpu_int4.int4_matmul(x, packed, scale, minimum).double()
    assert (y - exact).norm() / exact.norm() < 0.01


@needs_kernel
@pytest.mark.parametrize("lanes", [False, True])
def test_threads_and_calling_thread_do_not_change_the_bits(lanes):
    _, packed, scale, minimum = _weights(1000, 576)
    # 120 rows are 2,160 groups of 32: from 2,048 the team quantizes the activations; 8 rows' 144 the calling thread
    for x in (torch.randn(120, 576), torch.randn(8, 576)):
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = cpu_int4.int4_matmul(x, packed, scale, minimum, lanes=lanes)
            torch.set_num_threads(2)
            two = cpu_int4.int4_matmul(x, packed, scale, minimum, lanes=lanes)
        finally:
            torch.set_num_threads(before)
        out = {}
        worker = threading.Thread(target=lambda x=x: out.setdefault("y", cpu_int4.int4_matmul(x, packed, scale, minimum,
                                                                                              lanes=lanes)))
        worker.start()
        worker.join()
        assert torch.equal(one, two) and torch.equal(one, out["y"])
        assert torch.equal(one[:4], cpu_int4.int4_matmul(x[:4], packed, scale, minimum, lanes=lanes))


@needs_kernel
def test_layouts_it_does_not_take_are_refused():
    _, packed, scale, minimum = _weights(8, 96)
    x = torch.randn(1, 96)
    cpu_int4.int4_matmul(x, packed, scale, minimum)
    bad = [
        (x.double(), packed, scale, minimum),
        (torch.randn(1, 64), packed, scale, minimum),  # inputs of another width
        (x, packed, scale.float(), minimum),  # fp32 scales: not the stored fp16
        (x, packed, scale, minimum[:, :2]),
        (x, packed.view(torch.int8), scale, minimum),
        (x, packed.t().contiguous().t(), scale, minimum),  # not contiguous
        (torch.randn(1, 48), packed[:, :24], scale[:, :1], minimum[:, :1]),  # 48 inputs: not groups of 32
    ]
    for args in bad:
        with pytest.raises(ValueError, match="not a layout"):
            cpu_int4.int4_matmul(*args)
    for args in bad:
        with pytest.raises(ValueError, match="not a layout"):
            cpu_int4.int4_matmul(*args, lanes=True)
    # the compiled decoder layers' threshold (cpu_kernels.h) is the one the cache fingerprint names
    assert cpu_int4._library().kvchat_int4_lane_min_tokens() == INT4_LANE_MIN_TOKENS
    wide = cpu_int4.max_inputs() + 32  # past the per-channel scales the kernel keeps on its stack
    assert not cpu_int4.takes(torch.zeros(1, wide // 2, dtype=torch.uint8), torch.zeros(1, wide // 32, dtype=torch.float16),
                              torch.zeros(1, wide // 32, dtype=torch.float16))
