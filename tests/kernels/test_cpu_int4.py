"""The compiled CPU int4 matmul (kvchat.kernels.cpu_int4): its nibble layout, its numbers against the dequantized
weight, its bits whatever the row count or threads, and the layouts it refuses."""

from __future__ import annotations

import threading

import pytest
import torch

from kvchat.kernels import cpu_int4

needs_kernel = pytest.mark.skipif(not cpu_int4.available(), reason="the compiled CPU int4 kernel does not build here")


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


@needs_kernel
@pytest.mark.parametrize("n,k", [(40, 576), (24, 1536), (13, 64)])
def test_each_row_is_an_fp32_dot_product_whatever_the_other_rows(n, k):
    q, packed, scale, minimum = _weights(n, k)
    x = torch.randn(15, k, generator=torch.Generator().manual_seed(1))  # rows in an eight, a four, a pair, alone
    y = cpu_int4.int4_matmul(x, packed, scale, minimum)
    s, m = scale.double()[..., None], minimum.double()[..., None]
    w = (q.double().view(n, -1, 32) * s + m).view(n, k)  # the fp16 scales and minima exactly, as the kernel widens them
    parts = (q.double().view(n, -1, 32) * s + m.abs()).view(n, k)
    exact, mass = x.double() @ w.t(), x.abs().double() @ parts.t()
    # fp32 rounding only: each product and partial sum rounds by 2**-24 relative, over chains of at most
    # 4 + k / 32 + 3 steps (a group's 4 FMAs, one scaled FMA per group, the 8-lane reduction); 2**-16 of the
    # sum of absolute terms bounds that with room for k = 1536 (48 groups)
    assert ((y.double() - exact).abs() <= 2**-16 * mass).all()
    for i in range(15):  # a row alone (decode), in a pair, a four or an eight, or among an odd count: the same bits
        assert torch.equal(cpu_int4.int4_matmul(x[i : i + 1].clone(), packed, scale, minimum)[0], y[i])
    for start, stop in ((2, 5), (3, 7), (0, 4), (1, 13)):
        assert torch.equal(cpu_int4.int4_matmul(x[start:stop].clone(), packed, scale, minimum), y[start:stop])


@needs_kernel
def test_threads_and_calling_thread_do_not_change_the_bits():
    _, packed, scale, minimum = _weights(1000, 576)
    x = torch.randn(3, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_int4.int4_matmul(x, packed, scale, minimum)
        torch.set_num_threads(2)
        two = cpu_int4.int4_matmul(x, packed, scale, minimum)
    finally:
        torch.set_num_threads(before)
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("y", cpu_int4.int4_matmul(x, packed, scale, minimum)))
    worker.start()
    worker.join()
    assert torch.equal(one, two) and torch.equal(one, out["y"])


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
    wide = cpu_int4.max_inputs() + 32  # past the per-channel scales the kernel keeps on its stack
    assert not cpu_int4.takes(torch.zeros(1, wide // 2, dtype=torch.uint8), torch.zeros(1, wide // 32, dtype=torch.float16),
                              torch.zeros(1, wide // 32, dtype=torch.float16))
