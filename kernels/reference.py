"""Pure-PyTorch reference for the paged KV cache kernels.

This module is both the CPU backend and the test oracle for the Triton
kernels (same signatures, see ``kvchat.kernels.dispatch``); the layout they
share is :mod:`kvchat.kernels.layout`'s. Its docstrings are the kernels'
contract: the other backends document only what they add to it.

FP8 scheme "pth1": per-token, per-KV-head absmax scale
``max(amax, FP8_EPS) / 448``, values clamped to ±448 before the cast, so
outliers saturate instead of overflowing and an all-zero token is exact.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from .layout import KVLayer, Sink

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_EPS = 1e-6
SCALE_SCHEME = "pth1"
SMALL_READ = 1 << 15  # elements; below this read_slots converts with torch's own fp8 cast


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last axis with one absmax scale per row.

    Args:
        x: ``[..., head_dim]`` float16/bfloat16/float32.
    Returns:
        ``(q, scale)``: ``q`` ``[..., head_dim]`` float8_e4m3fn (round to
        nearest even, clamped to ±448); ``scale`` ``[...]`` float32 with
        ``x ≈ q * scale``.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp_min(FP8_EPS)
    # a tensor divisor: CUDA turns a division by a Python number into a product with its reciprocal, which
    # differs from the kernels' correctly rounded division in the last bit of some scales
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fp8_bits_to_f16(u8: torch.Tensor) -> torch.Tensor:
    """Reinterpret float8_e4m3fn bytes as float16 values scaled by 2**-8.

    Exact for every finite e4m3fn value (normals and subnormals): the
    sign moves to bit 15 and exponent+mantissa shift left by 7, which
    re-biases the exponent from 7 to 15. On CPU this is ~15x faster than
    torch's own float8 -> float conversion. Multiply by 256 (fold it into
    the scale) to get the true value.

    One copy into an int16 temporary (the byte read as int8, sign-extended),
    then two in-place passes: a left shift by 7 (the sign lands in bits 15
    and 14) and bit 14 cleared (measured, 23.6 M values, 1 thread: 19.4-19.8 ms for the
    conversion into float32 vs 25.5-26.6 ms with a separate sign mask).

    Args:
        u8: uint8 tensor of float8_e4m3fn bit patterns, any shape.
    Returns:
        float16 tensor of the same shape.
    """
    i = u8.view(torch.int8).to(torch.int16)
    return i.bitwise_left_shift_(7).bitwise_and_(~0x4000).view(torch.float16)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``[..., head_dim]`` fp8 and ``[...]`` fp32 -> fp32."""
    return fp8_bits_to_f16(q.view(torch.uint8)).float() * (scale * 256.0).unsqueeze(-1)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv: KVLayer, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K/V into the paged pools (vLLM's ``reshape_and_cache``).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` fp16/bf16/fp32.
        kv: the layer's pools; fp8 pools are quantized per token and KV head
            (their scales written too), 16-bit pools take a plain cast.
        slot_mapping: int64 ``[num_tokens]``; -1 skips the token.
    """
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if slot_mapping.numel() == 0:
        return
    if kv.k_cache.dtype == FP8_DTYPE:
        assert kv.k_scale is not None and kv.v_scale is not None
        q, s = quantize_fp8(torch.stack((key, value)))  # K and V in one pass
        q = q.view(torch.uint8)
        kv.k_cache.view(torch.uint8).flatten(0, 1)[slot_mapping] = q[0]
        kv.v_cache.view(torch.uint8).flatten(0, 1)[slot_mapping] = q[1]
        kv.k_scale.flatten(0, 1)[slot_mapping] = s[0]
        kv.v_scale.flatten(0, 1)[slot_mapping] = s[1]
    else:
        kv.k_cache.flatten(0, 1)[slot_mapping] = key.to(kv.k_cache.dtype)
        kv.v_cache.flatten(0, 1)[slot_mapping] = value.to(kv.v_cache.dtype)


def gather_kv(cache: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """Read one sequence's first ``length`` tokens from a pool, dequantized.

    Args:
        cache: pool ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        scale: its ``[num_blocks, block_size, num_kv_heads]`` fp32 scales, or ``None`` (16-bit pool).
        blocks: int ``[n]`` block ids covering at least ``length`` tokens.
    Returns:
        float32 ``[length, num_kv_heads, head_dim]``, the values attention sees.
    """
    nb = (length + cache.shape[1] - 1) // cache.shape[1]
    idx = blocks[:nb].long()
    if cache.dtype == FP8_DTYPE:
        raw = cache.view(torch.uint8)[idx].flatten(0, 1)[:length]
        s = scale[idx].flatten(0, 1)[:length] * 256.0
        return fp8_bits_to_f16(raw).float() * s.unsqueeze(-1)
    return cache[idx].flatten(0, 1)[:length].float()


def read_slots(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Read tokens at pool ``slots`` back, dequantized, for one layer or all layers at once.

    Args:
        cache: pool ``[..., num_blocks, block_size, num_kv_heads, head_dim]``
            (one layer, or ``[num_layers, ...]`` for all of them).
        scale: its ``[..., num_blocks, block_size, num_kv_heads]`` fp32 scales, or ``None``.
        slots: int64 ``[T]`` slot ids (``block * block_size + offset``), all valid.
        out: optional float32 destination ``[..., T, num_kv_heads, head_dim]``
            (any strides, e.g. a transposed view of a larger tensor). Bulk
            reads should pass it: the values are converted straight into it
            and the temporaries are modified in place, which on a CPU halves
            the time of a 4,096-token, 30-layer read (fewer fresh pages to fault in).
    Returns:
        float32 ``[..., T, num_kv_heads, head_dim]`` (``out`` when given): exactly
        the values attention reads.
    """
    flat = cache.flatten(-4, -3)
    dim = flat.dim() - 3
    if cache.dtype != FP8_DTYPE:
        values = flat.index_select(dim, slots)
        return values.float() if out is None else out.copy_(values)
    raw = flat.view(torch.uint8).index_select(dim, slots)
    s = scale.flatten(-3, -2).index_select(dim, slots)
    if out is None and raw.numel() < SMALL_READ:  # few elements: one conversion op beats the bit trick's
        return raw.view(FP8_DTYPE).float() * s.unsqueeze(-1)
    return dequantize_into(raw.view(FP8_DTYPE), s, out)


def dequantize_into(values: torch.Tensor, scale: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Stored K or V values to float32, written into ``out``: the bulk conversion of every CPU read path.

    Args:
        values: ``[..., head_dim]`` float8_e4m3fn (then ``scale`` ``[...]`` float32, not modified) or a
            16-bit pool dtype (``scale`` None).
        out: optional float32 ``[..., head_dim]`` destination, any strides.
    Returns:
        float32 values (``out`` when given), bit-identical to :func:`dequantize_fp8`.

    fp8 goes through :func:`fp8_bits_to_f16`'s bit trick. Measured against a
    256-entry table gather (``table[bytes]``, the table holding every e4m3 value) on 4,096 tokens' K of SmolLM2 (23.6 M
    values, 1 thread, a shared machine): bit trick 94 ms, table gather 199-376 ms
    (``take``/``index`` with int64/int32 indices), torch's own fp8 cast 87-252 ms.
    """
    if values.dtype != FP8_DTYPE:
        return values.float() if out is None else out.copy_(values)
    if out is None:
        out = torch.empty(values.shape, dtype=torch.float32, device=values.device)
    out.copy_(fp8_bits_to_f16(values.view(torch.uint8)))
    return out.mul_((scale * 256.0).unsqueeze(-1))


@lru_cache(maxsize=1)
def causal_mask(q_start: int, t: int, length: int, group: int, device: torch.device) -> torch.Tensor:
    """The additive causal mask of :func:`dense_attention`'s grouped queries: float32 ``[group * t, length]``,
    0 where query row ``g * t + i`` (position ``q_start + i``) may read key ``j`` (``j <= q_start + i``), -inf
    elsewhere.

    Made once per shape and reused by every layer of a forward (the last shape is kept until the next one,
    at most ``group * 512 * context * 4`` bytes; callers never write to it; a normal tensor, usable in and
    out of inference mode). SDPA turns a boolean mask into this additive one on every call (measured, 30
    layers, 2 threads: a 512-token chunk at 4,096 tokens 1.08-1.13 s with it vs 1.21-1.24 s with the
    boolean mask, a 16-token question 51 vs 60-65 ms), with bit-identical outputs.
    """
    with torch.inference_mode(False):
        pos = torch.arange(q_start, q_start + t, device=device).repeat(group)
        allowed = torch.arange(length, device=device)[None, :] <= pos[:, None]
        return torch.zeros(allowed.shape, device=device).masked_fill_(~allowed, float("-inf"))


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_start: int, sm_scale: float) -> torch.Tensor:
    """Causal GQA attention over one sequence's contiguous, dequantized K/V.

    The attention of both CPU read paths: over the contiguous copy of
    ``kvchat.engine.dense_kv`` (a decode step reads ``L`` tokens without gathering
    or dequantizing them) and, per sequence, over the K/V that
    :func:`decode_attention` and :func:`extend_attention` gather. Its result
    does not depend on the strides of ``key``/``value``, so both paths give
    bit-identical outputs and a chunk's K/V do not depend on which path ran it.
    Query heads are grouped under their KV head (``h = kv_head * group + g``,
    as in Hugging Face's GQA), so K/V are never repeated.

    Args:
        query: ``[T, num_heads, head_dim]`` at positions ``q_start .. q_start + T - 1``.
        key, value: float32 ``[num_kv_heads, L, head_dim]`` (may be views with
            a longer stride along ``L``), ``L = q_start + T``.
        sm_scale: softmax scale.
    Returns:
        ``[T, num_heads, head_dim]`` in ``query.dtype`` (fp32 math).
    """
    t, h, d = query.shape
    hkv, length = key.shape[0], key.shape[1]
    group = h // hkv
    if t == 1:  # decode: no mask; three small ops beat SDPA's set-up
        q = query.float().view(hkv, group, d)
        probs = torch.softmax(torch.bmm(q, key.transpose(1, 2)) * sm_scale, dim=-1)
        return torch.bmm(probs, value).view(1, h, d).to(query.dtype)
    q = query.float().view(t, hkv, group, d).permute(1, 2, 0, 3).reshape(1, hkv, group * t, d)
    mask = causal_mask(q_start, t, length, group, query.device)
    out = F.scaled_dot_product_attention(q, key[None], value[None], attn_mask=mask, scale=sm_scale)
    return out[0].view(hkv, group, t, d).permute(2, 0, 1, 3).reshape(t, h, d).to(query.dtype)


def _gather_seq(kv: KVLayer, blocks: torch.Tensor, length: int, sink: Sink | None, i: int):
    """Sequence ``i``'s dequantized K/V ``[length, num_kv_heads, head_dim]``, position 0 from ``sink`` if given."""
    k = gather_kv(kv.k_cache, kv.k_scale, blocks, length)
    v = gather_kv(kv.v_cache, kv.v_scale, blocks, length)
    if sink is not None:
        k[0], v[0] = sink[0][i], sink[1][i]
    return k, v


def decode_attention(query: torch.Tensor, kv: KVLayer, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     sm_scale: float, sink: Sink | None = None) -> torch.Tensor:
    """One query token per sequence attending to its whole cached sequence.

    Args:
        query: ``[num_seqs, num_heads, head_dim]``; ``num_heads`` a multiple
            of ``num_kv_heads`` (GQA).
        kv: the layer's pools.
        block_table: int32 ``[num_seqs, max_blocks]``; seq_lens: int32 ``[num_seqs]``
            (the query token's own K/V already written, so it is included).
        sm_scale: softmax scale, usually ``head_dim ** -0.5``.
        sink: optional exact K/V of position 0 (:data:`kvchat.kernels.layout.Sink`).
    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``query.dtype`` (fp32 math).
    """
    out = torch.empty_like(query)
    for i in range(query.shape[0]):
        length = int(seq_lens[i])
        k, v = _gather_seq(kv, block_table[i], length, sink, i)
        out[i] = dense_attention(query[i : i + 1], k.transpose(0, 1), v.transpose(0, 1), length - 1, sm_scale)[0]
    return out


def extend_attention(query: torch.Tensor, kv: KVLayer, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, sm_scale: float, sink: Sink | None = None) -> torch.Tensor:
    """A chunk of new tokens per sequence attending to the cached prefix and causally to itself.

    Used for prefill (empty prefix) and for extending a restored or shared
    prefix. The chunk's own K/V must already be in the pool (:func:`write_kv`),
    so it reads exactly the values decode will read later.

    Args:
        query: ``[total_q, num_heads, head_dim]``, sequences concatenated.
        kv, block_table, sm_scale, sink: as :func:`decode_attention`'s.
        seq_lens: int32 ``[num_seqs]``, cached prefix + new tokens.
        cu_seqlens_q: int32 ``[num_seqs + 1]``, offsets of each sequence's
            new tokens in ``query``; its queries sit at positions
            ``seq_len - q_len .. seq_len - 1``.
    Returns:
        ``[total_q, num_heads, head_dim]`` in ``query.dtype``.
    """
    out = torch.empty_like(query)
    for i in range(block_table.shape[0]):
        a, b = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        if a == b:
            continue
        length = int(seq_lens[i])
        k, v = _gather_seq(kv, block_table[i], length, sink, i)
        out[a:b] = dense_attention(query[a:b], k.transpose(0, 1), v.transpose(0, 1), length - (b - a), sm_scale)
    return out
