"""The torch reference of the paged FP8 cache: quantization, write, and the attention paths agreeing."""

from __future__ import annotations

import torch

from kvchat.engine.kv_pool import KVCacheSpec, KVPool
from kvchat.kernels import reference as ref


def _pool(kv_dtype: str, num_blocks: int = 8, hkv: int = 3, d: int = 64) -> KVPool:
    return KVPool(KVCacheSpec(1, hkv, d, kv_dtype), num_blocks)


def _slots(block_table: list[int], n: int, block_size: int = 16) -> torch.Tensor:
    pos = torch.arange(n)
    return torch.tensor(block_table)[pos // block_size].long() * block_size + pos % block_size


def test_fp8_bit_trick_is_exact_for_every_finite_byte():
    allbytes = torch.arange(256, dtype=torch.uint8)
    want = allbytes.view(torch.float8_e4m3fn).float()
    got = ref.fp8_bits_to_f16(allbytes).float() * 256
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])
    # the NaN bytes 0x7F/0xFF read as +-480, as the Triton kernels' (i & 0x7F) << 7 | (i & 0x80) << 8 reads them
    assert got[0x7F].item() == 480.0 and got[0xFF].item() == -480.0


def test_outliers_saturate_and_zero_tokens_stay_finite():
    x = torch.zeros(4, 3, 64)
    x[1] = torch.randn(3, 64)
    x[1, 0, 5] = 1e4  # a K outlier: its own head's scale absorbs it
    x[2] = 1e-12  # tiny: clamped scale, no division blow-up
    q, scale = ref.quantize_fp8(x)
    back = ref.dequantize_fp8(q, scale)
    assert torch.isfinite(back).all()
    assert torch.equal(back[0], torch.zeros(3, 64)), "an all-zero token must round-trip to zeros"
    assert abs(back[1, 0, 5].item() - 1e4) / 1e4 < 1 / 16, "outlier must keep its magnitude (e4m3: 3 mantissa bits)"
    rel = (back[1, 1:] - x[1, 1:]).abs().max() / x[1, 1:].abs().max()
    assert rel < 1 / 16, "other heads keep their own scale"


def test_fixed_scale_would_have_overflowed():
    """Why per-token scales: a raw cast of 1e4 to e4m3fn is NaN, ours is finite."""
    raw = torch.tensor([1e4]).to(torch.float8_e4m3fn).float()
    assert raw.isnan().all() or raw.abs().max() != 1e4
    q, s = ref.quantize_fp8(torch.tensor([[1e4, 1.0]]))
    assert torch.isfinite(ref.dequantize_fp8(q, s)).all()


def test_write_skips_padding_and_16bit_pools_copy_exactly():
    pool = _pool("fp16")
    k = torch.randn(5, 3, 64, dtype=torch.float16)
    slots = torch.tensor([0, -1, 17, 18, -1])
    kc = pool.layer(0).k_cache
    ref.write_kv(k, k, pool.layer(0), slots)
    assert torch.equal(kc[0, 0], k[0]) and torch.equal(kc[1, 1], k[2]) and torch.equal(kc[1, 2], k[3])
    assert kc[0, 1].abs().sum() == 0, "a -1 slot must not be written"


def test_decode_equals_last_row_of_extend_on_shuffled_blocks():
    for kv_dtype in ("fp8", "bf16"):
        torch.manual_seed(0)
        pool = _pool(kv_dtype)
        table = [5, 2, 7, 0]
        n = 50
        k, v, q = torch.randn(n, 3, 64) * 3, torch.randn(n, 3, 64), torch.randn(n, 9, 64)
        kv = pool.layer(0)
        ref.write_kv(k, v, kv, _slots(table, n))
        bt = torch.tensor([table], dtype=torch.int32)
        # prefill 30 then extend 20 over the cached prefix
        ext = torch.cat([
            ref.extend_attention(q[:30], kv, bt, torch.tensor([30]), torch.tensor([0, 30]), 0.125),
            ref.extend_attention(q[30:], kv, bt, torch.tensor([n]), torch.tensor([0, 20]), 0.125),
        ])
        dec = ref.decode_attention(q[-1:], kv, bt, torch.tensor([n]), 0.125)
        assert torch.allclose(dec[0], ext[-1], atol=1e-5)
        # and both equal plain causal attention over the dequantized values
        kd = ref.gather_kv(kv.k_cache, kv.k_scale, bt[0], n)
        vd = ref.gather_kv(kv.v_cache, kv.v_scale, bt[0], n)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), kd.repeat_interleave(3, 1).transpose(0, 1), vd.repeat_interleave(3, 1).transpose(0, 1),
            is_causal=True, scale=0.125,
        ).transpose(0, 1)
        assert torch.allclose(ext, want, atol=1e-4)
        if kv_dtype == "fp8":  # the pool really holds quantized values
            assert not torch.allclose(kd, k, atol=1e-3) and torch.allclose(kd, k, rtol=1 / 16, atol=1e-6)


def test_pool_bytes_per_token_matches_allocation():
    for kv_dtype, elem in (("fp8", 1), ("bf16", 2), ("fp16", 2)):
        spec = KVCacheSpec(30, 3, 64, kv_dtype)
        pool = KVPool(spec, 10)
        assert pool.nbytes == spec.bytes_per_token * pool.capacity_tokens
        assert spec.bytes_per_token == 2 * 30 * 3 * (64 * elem + (4 if kv_dtype == "fp8" else 0))


def test_read_slots_paths_agree_bit_for_bit():
    """The small-read cast, the bulk bit trick and the in-place ``out=`` path give the same values."""
    pool = _pool("fp8", num_blocks=40)
    kc, ks = pool.layer(0).k_cache, pool.layer(0).k_scale
    slots = torch.randperm(40 * 16)[:600]
    ref.write_kv(torch.randn(600, 3, 64) * 3, torch.randn(600, 3, 64), pool.layer(0), slots)
    want = ref.gather_kv(kc, ks, torch.arange(40), 640).view(40 * 16, 3, 64)[slots]
    small = ref.read_slots(kc, ks, slots[:100])  # 19,200 elements: the cast path
    bulk = ref.read_slots(kc, ks, slots)  # 115,200 elements: the bit trick
    out = torch.full((3, 600, 64), float("nan")).transpose(0, 1)
    ref.read_slots(kc, ks, slots, out=out)
    assert torch.equal(small, want[:100]) and torch.equal(bulk, want) and torch.equal(out, want)


def test_the_reused_additive_mask_gives_the_boolean_masks_bits():
    """dense_attention's cached additive causal mask: the same bits as SDPA with a boolean mask made per call,
    for a prefill chunk from 0 and a question after a prefix, in and out of inference mode."""
    torch.manual_seed(0)
    hkv, group, d = 3, 3, 64
    for q_start, t in ((0, 40), (260, 16)):
        length = q_start + t
        q, k, v = torch.randn(t, hkv * group, d), torch.randn(hkv, length, d), torch.randn(hkv, length, d)
        pos = torch.arange(q_start, length).repeat(group)
        allowed = torch.arange(length)[None, :] <= pos[:, None]
        qg = q.view(t, hkv, group, d).permute(1, 2, 0, 3).reshape(1, hkv, group * t, d)
        want = torch.nn.functional.scaled_dot_product_attention(qg, k[None], v[None], attn_mask=allowed, scale=0.125)
        want = want[0].view(hkv, group, t, d).permute(2, 0, 1, 3).reshape(t, hkv * group, d)
        with torch.inference_mode():
            first = ref.dense_attention(q, k, v, q_start, 0.125)
        again = ref.dense_attention(q, k, v, q_start, 0.125)  # the cached mask, outside inference mode
        assert torch.equal(first, want) and torch.equal(again, want)
        mask = ref.causal_mask(q_start, t, length, group, q.device)
        assert mask.shape == (group * t, length) and torch.equal(mask == 0, allowed)
