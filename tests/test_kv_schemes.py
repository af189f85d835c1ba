"""The alternative FP8 schemes used by ``kvchat bench fidelity`` (no model needed)."""

from __future__ import annotations

import pytest
import torch
from kvchat.kernels import reference

from kvchat import kernels
from kvchat.bench.kv_schemes import (
    KVScheme,
    SchemeOverride,
    fixed_scale_scheme,
    k_centred_scheme,
)
from kvchat.block_manager import SeqBlocks
from kvchat.kv_cache import KVCacheSpec, KVPool

LAYERS, KV_HEADS, HEAD_DIM, HEADS = 2, 3, 64, 9
T = 40  # crosses block boundaries; the block table is deliberately out of order


def _setup(scheme: KVScheme):
    pool = KVPool(KVCacheSpec(LAYERS, KV_HEADS, HEAD_DIM, "fp8"), 8)
    seq = SeqBlocks(block_table=[5, 2, 7])
    slots = torch.tensor([seq.block_table[p // 16] * 16 + p % 16 for p in range(T)])
    block_table = torch.tensor([seq.block_table], dtype=torch.int32)
    return pool, SchemeOverride(pool, scheme, seq), slots, block_table, torch.tensor([T], dtype=torch.int32)


def test_sink_attention_matches_reference_when_sink_is_the_stored_value():
    torch.manual_seed(0)
    pool, ov, slots, bt, sl = _setup(KVScheme("sink", exact_sink=True))
    k, v, q = torch.randn(T, KV_HEADS, HEAD_DIM), torch.randn(T, KV_HEADS, HEAD_DIM), torch.randn(T, HEADS, HEAD_DIM)
    kc, vc, ks, vs = pool.layer(1)
    ov.write_kv(k, v, kc, vc, ks, vs, slots)
    assert torch.equal(ov.sink[1][0], k[0]) and torch.equal(ov.sink[1][1], v[0])
    cu = torch.tensor([0, T], dtype=torch.int32)
    args = (kc, vc, ks, vs, bt, sl)
    exact = ov.extend_attention(q, *args, cu, 0.125)
    ov.sink[1] = (reference.gather_kv(kc, ks, bt[0], 1)[0], reference.gather_kv(vc, vs, bt[0], 1)[0])
    assert torch.equal(ov.extend_attention(q, *args, cu, 0.125), reference.extend_attention(q, *args, cu, 0.125))
    assert torch.equal(ov.decode_attention(q[-1:], *args, 0.125), reference.decode_attention(q[-1:], *args, 0.125))
    assert not torch.equal(exact, reference.extend_attention(q, *args, cu, 0.125))  # the exact sink did change something


def test_fixed_scale_clamps_outliers_instead_of_nan():
    pool, ov, slots, _, _ = _setup(fixed_scale_scheme(1.0))
    k = torch.full((T, KV_HEADS, HEAD_DIM), 1e4)
    k[1] = 0.3
    kc, vc, ks, vs = pool.layer(0)
    ov.write_kv(k, -k, kc, vc, ks, vs, slots)
    got = reference.gather_kv(kc, ks, torch.tensor([5, 2, 7]), T)
    assert not got.isnan().any()
    assert got[0].eq(448.0).all() and got[1].sub(0.3).abs().max() < 0.3 / 8  # e4m3: 3 mantissa bits
    assert ks[5, :2].eq(1.0).all()


def test_k_shift_is_subtracted_per_layer_and_dispatch_is_restored():
    torch.manual_seed(1)
    shift = torch.randn(LAYERS, KV_HEADS, HEAD_DIM) * 10
    pool, ov, slots, _, _ = _setup(k_centred_scheme(shift))
    k = shift[1] + torch.randn(T, KV_HEADS, HEAD_DIM) * 0.1
    original = kernels.write_kv
    with pytest.raises(RuntimeError), ov.active():
        assert kernels.write_kv == ov.write_kv
        kernels.write_kv(k, k, *pool.layer(1), slots)
        raise RuntimeError("leave the block early")
    assert kernels.write_kv is original
    stored = reference.gather_kv(pool.k[1], pool.k_scale[1], torch.tensor([5, 2, 7]), T)
    target = k - shift[1]
    assert stored.abs().max() < 1.0  # centred (uncentred K is ~10 in size)
    # e4m3 rounds to 3 mantissa bits: relative error <= 2**-4 (plus subnormal steps of the row scale)
    assert ((stored - target).abs() <= target.abs() * 2**-4 + 1e-3).all()
