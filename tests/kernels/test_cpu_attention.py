"""The compiled CPU decode attention (kvchat.kernels.cpu_attention) against the reference, and where it runs."""

from __future__ import annotations

import pytest
import torch

from kvchat import kernels
from kvchat.kernels import cpu_attention
from kvchat.kernels import reference as ref

needs_kernel = pytest.mark.skipif(cpu_attention._library() is None,
                                  reason="the compiled CPU decode attention does not build here")


def _kv(hkv: int, length: int, d: int, spare: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(hkv, length + spare, d, generator=gen) * 2  # spare tokens: views with a longer stride, as the dense copy
    v = torch.randn(hkv, length + spare, d, generator=gen)
    return k[:, :length], v[:, :length]


@needs_kernel
@pytest.mark.parametrize("heads,hkv,d", [(9, 3, 64), (4, 4, 32), (16, 2, 128)])
@pytest.mark.parametrize("length", [1, 255, 256, 257, 1000])
def test_matches_the_reference_to_fp32_rounding(heads, hkv, d, length):
    k, v = _kv(hkv, length, d)
    q = torch.randn(1, heads, d, generator=torch.Generator().manual_seed(1))
    got = cpu_attention.decode_attention(q, k, v, d**-0.5)
    want = ref.dense_attention(q, k, v, length - 1, d**-0.5)
    group = heads // hkv
    probs = torch.softmax(q.double().view(hkv, group, d) @ k.double().transpose(1, 2) * d**-0.5, dim=-1)
    exact = (probs @ v.double()).view(1, heads, d)
    assert got.shape == want.shape and got.dtype == torch.float32
    # as close to the float64 result as the reference is (a few fp32 ulps of the largest value; d <= 128 terms)
    bound = 4 * (want.double() - exact).abs().max().item() + 2e-6 * v.abs().max().item()
    assert (got.double() - exact).abs().max().item() <= bound


@needs_kernel
def test_bits_do_not_depend_on_the_thread_count():
    k, v = _kv(3, 3000, 64)
    q = torch.randn(1, 9, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.decode_attention(q, k, v, 0.125)
        torch.set_num_threads(2)
        two = cpu_attention.decode_attention(q, k, v, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_dispatch_takes_it_only_for_a_provisional_decode_token():
    k, v = _kv(3, 50, 64)
    q = torch.randn(1, 9, 64)
    reference = ref.dense_attention(q, k, v, 49, 0.125)
    assert torch.equal(kernels.dense_attention(q, k, v, 49, 0.125), reference)  # a prefill chunk's token: stored K/V
    provisional = kernels.dense_attention(q, k, v, 49, 0.125, provisional=True)
    if cpu_attention._library() is not None:
        assert not torch.equal(provisional, reference)  # another summation order: the kernel ran
    torch.testing.assert_close(provisional, reference, rtol=1e-5, atol=1e-6)
    q2 = torch.randn(2, 9, 64)  # two query tokens: the reference, even when provisional
    k2, v2 = _kv(3, 51, 64)
    assert torch.equal(kernels.dense_attention(q2, k2, v2, 49, 0.125, True), ref.dense_attention(q2, k2, v2, 49, 0.125))


def test_what_it_does_not_take_is_refused():
    k, v = _kv(3, 20, 64)
    assert not cpu_attention.takes(torch.randn(2, 9, 64), k, v)  # two tokens
    assert not cpu_attention.takes(torch.randn(1, 9, 64), k.double(), v.double())
    assert not cpu_attention.takes(torch.randn(1, 9, 64), k.transpose(1, 2).contiguous().transpose(1, 2), v)
    assert not cpu_attention.takes(torch.randn(1, 8, 64), k, v)  # 8 query heads over 3 KV heads
    assert not cpu_attention.takes(torch.randn(1, 9, 64), k[:, :0], v[:, :0])  # no token
    assert not cpu_attention.takes(torch.randn(1, 9, 4), k[..., :4], v[..., :4])  # head_dim under 8
    with pytest.raises(ValueError, match="not what the kernel takes"):
        cpu_attention.decode_attention(torch.randn(2, 9, 64), k, v, 0.125)
