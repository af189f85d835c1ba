"""The compiled CPU decode attention and cache write (kvchat.kernels.cpu_attention) against the reference,
and where they run."""

from __future__ import annotations

import pytest
import torch

from kvchat.kernels import cpu_attention, dispatch
from kvchat.kernels import reference as ref
from kvchat.kernels.layout import KVLayer

needs_kernel = pytest.mark.skipif(cpu_attention._library() is None,
                                  reason="the compiled CPU decode attention does not build here")
POOL_DTYPES = {"fp8": ref.FP8_DTYPE, "bf16": torch.bfloat16, "fp16": torch.float16}


def _pool(kv_dtype: str, num_blocks: int, hkv: int, d: int, seed: int = 0, block_size: int = 16):
    """A layer's pools filled through the reference write."""
    gen = torch.Generator().manual_seed(seed)
    dtype = POOL_DTYPES[kv_dtype]
    shape = (num_blocks, block_size, hkv, d)
    scales = (torch.zeros(shape[:3]), torch.zeros(shape[:3])) if kv_dtype == "fp8" else (None, None)
    pool = KVLayer(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), *scales)
    slots = torch.arange(num_blocks * block_size)
    k = torch.randn(len(slots), hkv, d, generator=gen) * 2
    v = torch.randn(len(slots), hkv, d, generator=gen)
    ref.write_kv(k, v, pool, slots)
    return pool


def _tensors(pool: KVLayer) -> tuple:
    return pool.k_cache, pool.v_cache, pool.k_scale, pool.v_scale


def _tables(lengths: list[int], num_blocks: int, seed: int = 0, block_size: int = 16):
    """Shuffled, disjoint block tables (int32, one row per length, zero-padded) and the int32 lengths."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(-(-n // block_size) for n in lengths)
    table, used = torch.zeros(len(lengths), width + 3, dtype=torch.int32), 0  # wider than needed, as the buffers
    for i, n in enumerate(lengths):
        nb = -(-n // block_size)
        table[i, :nb] = torch.tensor(perm[used : used + nb], dtype=torch.int32)
        used += nb
    return table, torch.tensor(lengths, dtype=torch.int32)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16", "fp16"])
@pytest.mark.parametrize("heads,hkv,d", [(9, 3, 64), (4, 4, 32), (16, 2, 128), (10, 2, 48)])  # 48: a 16-value tail
@pytest.mark.parametrize("lengths", [[1], [127, 128, 129], [1000, 3, 300]])
@pytest.mark.parametrize("with_sink", [False, True])
def test_decode_matches_the_reference_to_fp32_rounding(kv_dtype, heads, hkv, d, lengths, with_sink):
    """Several sequences of lengths around the 128-token task ranges, over shuffled blocks, with and without
    the exact sink: as close to a float64 computation over the same stored values as the reference is."""
    pool = _pool(kv_dtype, 100, hkv, d)
    table, lens = _tables(lengths, 100)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(lengths), heads, d, generator=gen)
    sink = None
    if with_sink:
        sink = (torch.randn(len(lengths), hkv, d, generator=gen), torch.randn(len(lengths), hkv, d, generator=gen))
    args = (q, pool, table, lens, d**-0.5, sink)
    got, want = cpu_attention.decode_attention(*args), ref.decode_attention(*args)
    assert got.shape == want.shape and got.dtype == torch.float32
    group = heads // hkv
    for i, n in enumerate(lengths):
        k = ref.gather_kv(pool.k_cache, pool.k_scale, table[i], n).double()
        v = ref.gather_kv(pool.v_cache, pool.v_scale, table[i], n).double()
        if sink is not None:
            k[0], v[0] = sink[0][i], sink[1][i]
        probs = torch.softmax(torch.einsum("hgd,thd->hgt", q[i].double().view(hkv, group, d), k) * d**-0.5, -1)
        exact = torch.einsum("hgt,thd->hgd", probs, v).reshape(heads, d)
        # a few fp32 ulps of the largest value, as the reference's own error (d <= 128 terms)
        bound = 4 * (want[i].double() - exact).abs().max().item() + 2e-6 * v.abs().max().item()
        assert (got[i].double() - exact).abs().max().item() <= bound


@needs_kernel
def test_a_rows_bits_depend_on_its_own_length_only():
    """Each row alone (1 thread, a table exactly as wide as it needs), all rows in one batch (2 threads), and
    the batch over a wider table: the same bits, short rows (under 16 tokens: torch's softmax takes another
    path there) included."""
    pool = _pool("fp8", 200, 3, 64)
    table, lens = _tables([3000 // 16 * 16 - 5, 7, 40, 1], 200)
    q = torch.randn(4, 9, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [cpu_attention.decode_attention(q[i : i + 1], pool, table[i : i + 1, : -(-int(n) // 16)].contiguous(),
                                                lens[i : i + 1], 0.125)
                 for i, n in enumerate(lens)]
        torch.set_num_threads(2)
        batch = cpu_attention.decode_attention(q, pool, table, lens, 0.125)
        wide = torch.cat([table, torch.zeros(4, 50, dtype=torch.int32)], dim=1)
        wider = cpu_attention.decode_attention(q, pool, wide, lens, 0.125)
    finally:
        torch.set_num_threads(before)
    for i in range(4):
        assert torch.equal(alone[i][0], batch[i]), i
    assert torch.equal(batch, wider)


@needs_kernel
def test_a_sequence_of_length_zero_gives_zeros():
    table, lens = _tables([20, 1], 10)
    lens[1] = 0  # a padded row
    out = cpu_attention.decode_attention(torch.randn(2, 9, 64), _pool("fp8", 10, 3, 64), table, lens, 0.125)
    assert torch.equal(out[1], torch.zeros(9, 64)) and out[0].abs().sum() > 0


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16", "fp16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_is_the_references_bit_for_bit(kv_dtype, dtype):
    """Random K/V over many magnitudes, zeros, outliers that saturate, fp8 subnormals and ties, slot -1
    skipped: the pools and scales end up byte-identical to the reference write's."""
    gen = torch.Generator().manual_seed(3)
    t, hkv, d = 50, 3, 64
    k = torch.randn(t, hkv, d, generator=gen) * torch.logspace(-8, 4, t)[:, None, None]
    v = torch.randn(t, hkv, d, generator=gen)
    k[3] = 0.0  # an all-zero token: scale FP8_EPS / 448, exact zeros
    v[4, :, 0] = 1e6  # one outlier per head: the others become fp8 subnormals
    v[5] = torch.tensor([448.0, -448.0, 1.0, 0.5]).repeat(d // 4) * torch.linspace(0.5, 2, d)  # ties, exact steps
    k, v = k.to(dtype), v.to(dtype)
    slots = torch.randperm(8 * 16, generator=gen)[:t]
    slots[7] = -1
    shape = (8, 16, hkv, d)
    pools = []
    for _ in range(2):
        caches = [torch.zeros(shape, dtype=POOL_DTYPES[kv_dtype]) for _ in range(2)]
        scales = [torch.full(shape[:3], -1.0) for _ in range(2)] if kv_dtype == "fp8" else [None, None]
        pools.append(KVLayer(*caches, *scales))
    ref.write_kv(k, v, pools[0], slots)
    cpu_attention.write_kv(k, v, pools[1], slots)
    for want, got in zip(_tensors(pools[0]), _tensors(pools[1])):
        if want is not None:
            assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16", "fp16"])
def test_write_of_nan_and_inf_is_the_references(kv_dtype):
    """A model that blew up: NaN and inf in a head are written as the reference writes them (fp8: the NaN
    bytes and a NaN or inf scale), not hidden as finite values."""
    k = torch.ones(3, 1, 16)
    k[0, 0, 2] = float("nan")
    k[1, 0, 5] = float("inf")
    k[2, 0, 0] = -float("inf")
    pools = []
    for _ in range(2):
        caches = [torch.zeros(3, 1, 1, 16, dtype=POOL_DTYPES[kv_dtype]) for _ in range(2)]
        scales = [torch.zeros(3, 1, 1) for _ in range(2)] if kv_dtype == "fp8" else [None, None]
        pools.append(KVLayer(*caches, *scales))
    ref.write_kv(k, -k, pools[0], torch.arange(3))
    cpu_attention.write_kv(k, -k, pools[1], torch.arange(3))
    for want, got in zip(_tensors(pools[0]), _tensors(pools[1])):
        if want is not None:
            assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    assert not pools[1].k_cache.float().isfinite().all()


@needs_kernel
def test_indices_outside_the_pool_or_the_table_are_refused():
    pool = _pool("fp8", 10, 3, 64)
    key = torch.randn(1, 3, 64)
    with pytest.raises(ValueError, match="outside a pool of 160 slots"):
        cpu_attention.write_kv(key, key, pool, torch.tensor([160]))
    table, lens = _tables([40], 10)
    with pytest.raises(ValueError, match="outside a block table"):
        cpu_attention.decode_attention(torch.randn(1, 9, 64), pool, table[:, :2], lens, 0.125)  # 40 tokens need 3 blocks
    assert not cpu_attention.takes_decode(torch.randn(0, 9, 64), pool, table[:0], lens[:0])  # no row


@needs_kernel
def test_every_fp8_value_round_trips_through_the_write():
    """Each of the 253 finite e4m3 magnitudes and both neighbours' midpoints, as K of one token per value
    (the token's absmax pinned at 448 so the scale is 1): the reference's bytes, every one."""
    values = torch.arange(256, dtype=torch.uint8).view(ref.FP8_DTYPE).float()
    values = values[values.isfinite()].unique()  # -448 .. 448
    mids = (values[1:] + values[:-1]) / 2  # ties: round half to even
    x = torch.cat([values, mids])
    n = x.numel()
    k = torch.full((n, 1, 16), 448.0)
    k[:, 0, 1] = x
    v = torch.zeros(n, 1, 16)
    pools = [KVLayer(torch.zeros(n, 1, 1, 16, dtype=ref.FP8_DTYPE), torch.zeros(n, 1, 1, 16, dtype=ref.FP8_DTYPE),
                     torch.zeros(n, 1, 1), torch.zeros(n, 1, 1)) for _ in range(2)]
    slots = torch.arange(n)
    ref.write_kv(k, v, pools[0], slots)
    cpu_attention.write_kv(k, v, pools[1], slots)
    assert torch.equal(pools[0].k_cache.view(torch.uint8), pools[1].k_cache.view(torch.uint8))
    assert torch.equal(pools[1].k_cache.float()[: values.numel(), 0, 0, 1], values)  # exact values stay exact


def test_dispatch_runs_the_compiled_kernels_on_a_cpu_pool_unless_asked_for_torch(monkeypatch):
    pool = _pool("fp8", 10, 3, 64)
    table, lens = _tables([100], 10)
    q = torch.randn(1, 9, 64)
    args = (q, pool, table, lens, 0.125)
    reference = ref.decode_attention(*args)
    monkeypatch.delenv("KVCHAT_ATTENTION", raising=False)
    compiled = cpu_attention._library() is not None
    assert dispatch.backend_for(pool.k_cache) == ("compiled" if compiled else "torch")
    step = dispatch.decode_attention(*args, provisional=True)  # a decode step
    if compiled:
        assert torch.equal(step, cpu_attention.decode_attention(*args))
        assert not torch.equal(step, reference)  # another summation order: it ran
    torch.testing.assert_close(step, reference, rtol=1e-5, atol=1e-6)
    assert torch.equal(dispatch.decode_attention(*args), reference)  # a one-token prefill chunk: stored K/V
    monkeypatch.setenv("KVCHAT_ATTENTION", "torch")
    assert dispatch.backend_for(pool.k_cache) == "torch"
    assert torch.equal(dispatch.decode_attention(*args, provisional=True), reference)


@needs_kernel
def test_what_it_does_not_take_is_refused():
    pool = _pool("fp8", 10, 3, 64)
    k_cache, v_cache, k_scale, v_scale = _tensors(pool)
    table, lens = _tables([100], 10)
    q = torch.randn(1, 9, 64)
    assert cpu_attention.takes_decode(q, pool, table, lens)
    assert not cpu_attention.takes_decode(q.double(), pool, table, lens)
    assert not cpu_attention.takes_decode(torch.randn(1, 8, 64), pool, table, lens)
    assert not cpu_attention.takes_decode(q, KVLayer(k_cache, v_cache), table, lens)  # fp8 without scales
    assert not cpu_attention.takes_decode(q, pool, table.long(), lens)
    assert not cpu_attention.takes_decode(q, pool, table, lens.long())
    table2, lens2 = _tables([100, 20], 10)
    columns = table2.t().contiguous().t()  # entries of a row not contiguous
    assert not cpu_attention.takes_decode(torch.randn(2, 9, 64), pool, columns, lens2)
    narrow = _pool("fp8", 10, 3, 8)  # head_dim not a multiple of 16
    assert not cpu_attention.takes_decode(torch.randn(1, 9, 8), narrow, table, lens)
    assert not cpu_attention.takes_pool(KVLayer(k_cache[:, ::2], v_cache[:, ::2], k_scale[:, ::2], v_scale[:, ::2]))
    assert not cpu_attention.takes_pool(KVLayer(k_cache.float(), v_cache.float()))  # not a pool dtype
    key = torch.randn(2, 3, 64)
    assert cpu_attention.takes_write(key, key, pool, torch.tensor([0, 5]))
    assert not cpu_attention.takes_write(key, key, pool, torch.tensor([0, 5]).int())
    assert not cpu_attention.takes_write(key[:, :2], key[:, :2], pool, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="not what the kernel takes"):
        cpu_attention.decode_attention(q.double(), pool, table, lens, 0.125)
    with pytest.raises(ValueError, match="not what the kernel takes"):
        cpu_attention.write_kv(key, key, KVLayer(k_cache, v_cache), torch.tensor([0, 5]))
