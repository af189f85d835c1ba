"""Triton paged decode attention: one query token per sequence, split-KV (flash-decoding).

Same signature and result as :func:`kvchat.kernels.reference.decode_attention`.

- Paging as in vLLM's PagedAttention (Kwon et al., SOSP 2023): token ``t`` of
  sequence ``s`` lives in block ``block_table[s, t // block_size]`` at offset
  ``t % block_size``. Tiles of ``BLOCK_N`` tokens are gathered through the
  block table, so tile sizes do not depend on ``block_size``.
- GQA: one program serves all query heads of one KV head, so each K/V byte
  is read once per split; the ``group`` query rows are padded to 16 for ``tl.dot``.
- Split-KV (Dao et al., "Flash-Decoding for long-context inference", 2023):
  each sequence's tokens are cut into ranges handled by separate programs,
  whose partial results are merged with their log-sum-exp, so one long
  sequence still fills the GPU. How many: :func:`splits_for` of the
  sequence's own length, about :data:`SPLIT_WAVES` programs per SM with at
  least :data:`MIN_TOKENS_PER_SPLIT` tokens each. The launch grid has the
  count for the block table's capacity (host-side numbers only, so a CUDA
  graph replays it at any length); each sequence's programs compute its own
  count from its length on the device (``split_tokens``) and those beyond it
  exit empty, carrying zero weight in the merge (as SGLang's Triton decode
  derives ``num_kv_splits`` per sequence).
- fp32 online softmax in base 2 (Dao, "FlashAttention-2", 2023); the fp8 K
  scale multiplies the scores and the V scale the probabilities.
- fp8 bytes are converted either by Triton's float8e4nv cast (compute
  capability >= 8.9) or, below it where Triton has no fp8 type, by integer
  bit operations (``FP8_BITS``, as :func:`kvchat.kernels.reference.fp8_bits_to_f16`):
  the byte becomes an fp16 bit pattern worth ``2**-8`` of the value, and the
  ``256`` is folded into the scale. Both are exact for every finite value.
- Exact attention sink (``HAS_SINK``, Xiao et al. 2023): position 0's fp32
  K/V, one row per sequence, replace the stored position 0. Its score and
  value are taken in fp32 (no ``tl.dot``) and start the online softmax of the
  split holding position 0, whose tiles then skip that position.

:func:`load_kv_tile` and :func:`sink_init` are shared with the extend kernel
so both read the pool and the sink identically.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .layout import KVLayer, Sink
from .triton_write import kernel_pools

LOG2E = 1.4426950408889634
BLOCK_N = 64  # KV tokens per tile: a multiple of 16 (and of 32 for 8-bit dot operands)
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 128  # splits per sequence at most (the merge kernel reads them as one tile)
SPLIT_WAVES = 2  # split programs per SM aimed at (see DEFAULT_TILES for the measurement)
NATIVE_FP8_CAPABILITY = (8, 9)  # Triton's float8e4nv needs sm_89+; below it the kernels convert fp8 bits


@triton.jit
def load_kv_tile(
    cache_ptr, scale_ptr, bt_row_ptr, pos, pos_mask, kv_head, offs_d, d_mask,
    stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
    BLOCK_SIZE: tl.constexpr, IS_FP8: tl.constexpr, FP8_BITS: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
):
    """Gather tokens ``pos`` (``[BLOCK_N]``) of one sequence and KV head from a pool.

    Returns ``(x, scale)``: ``x`` ``[BLOCK_N, BLOCK_D]`` in ``COMPUTE_DTYPE``
    (raw fp8 values converted exactly; zero where masked) and ``scale``
    ``[BLOCK_N]`` fp32 (the fp8 scale; zero where masked; 1 for 16-bit pools),
    with ``x * scale`` the stored value. ``FP8_BITS``: convert by integer bit
    operations, ``x`` then holds ``2**-8`` of the fp8 value and ``scale`` 256
    times the stored one (the bytes 0x7F/0xFF, NaN in e4m3fn, read as
    ±480 as in the reference; the cache write never stores them).
    """
    block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    offset = pos % BLOCK_SIZE
    rows = block * stride_cb + offset * stride_cs + kv_head * stride_ch
    x = tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=pos_mask[:, None] & d_mask[None, :], other=0)
    if IS_FP8:
        if FP8_BITS:  # sign to bit 15, exponent+mantissa up by 7: re-biases 7 -> 15, value x 2**-8
            i = x.to(tl.int32)
            x = (((i & 0x7F) << 7) | ((i & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(COMPUTE_DTYPE)
        else:
            x = x.to(tl.float8e4nv, bitcast=True).to(COMPUTE_DTYPE)
        scale = tl.load(scale_ptr + block * stride_sb + offset * stride_ss + kv_head * stride_sh,
                        mask=pos_mask, other=0.0)
        if FP8_BITS:
            scale = scale * 256.0
    else:
        x = x.to(COMPUTE_DTYPE)
        scale = tl.where(pos_mask, 1.0, 0.0)
    return x, scale


@triton.jit
def sink_init(q, sink_k_ptr, sink_v_ptr, sink_row, offs_d, d_mask, qk_scale, use):
    """Online-softmax state ``(m, l_sum, acc)`` after the exact sink, for query rows ``q`` ``[R, BLOCK_D]``.

    ``sink_row``: offset of this sequence's and KV head's row in the fp32 sink
    tensors. ``use`` (scalar): these rows see position 0; if false, the empty
    state (``-inf``, 0, 0). The score ``q . k0 * qk_scale`` (base 2) is summed in
    fp32, as the reference does; ``acc`` is ``v0`` with weight ``2**(s - m) = 1``.
    """
    k0 = tl.load(sink_k_ptr + sink_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    v0 = tl.load(sink_v_ptr + sink_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    s0 = tl.sum(q.to(tl.float32) * k0[None, :], axis=1) * qk_scale
    m = tl.where(use, s0, float("-inf"))
    l_sum = tl.where(use, tl.full(s0.shape, 1.0, tl.float32), 0.0)
    acc = tl.where(use, tl.zeros(q.shape, tl.float32) + v0[None, :], 0.0)
    return m, l_sum, acc


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq_lens_ptr,
    sink_k_ptr, sink_v_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, group, head_dim, num_splits, split_tokens,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh, stride_bt, stride_ks, stride_kh,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT_OUT: tl.constexpr, IS_FP8: tl.constexpr, FP8_BITS: tl.constexpr, HAS_SINK: tl.constexpr,
    PRECISION: tl.constexpr, F16_MATH: tl.constexpr,
):
    tl.static_assert(BLOCK_G >= 16)  # GPU tl.dot minimums: M, N, K >= 16 (K >= 32 for 8-bit operands)
    tl.static_assert(BLOCK_N >= 32)
    tl.static_assert(BLOCK_D >= 16)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # this sequence's splits: splits_for(its length), as min(grid, cdiv(length, split_tokens)) (see splits_for);
    # split_tokens 1 keeps all num_splits (an explicit count: the same ranges as cdiv(length, num_splits))
    used = tl.maximum(tl.minimum(tl.cdiv(seq_len, split_tokens), num_splits), 1)
    split_len = tl.cdiv(tl.cdiv(seq_len, used), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < group
    d_mask = offs_d < head_dim
    heads = kv_head * group + offs_g
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if F16_MATH:  # bf16 -> fp16 is exact for |q| in fp16's normal range; fp8 -> fp16 is exact for every value
        q = q.to(tl.float16)
    compute_dtype = q.dtype
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt

    if HAS_SINK:  # the split holding position 0 starts from the exact sink
        m, l_sum, acc = sink_init(q, sink_k_ptr, sink_v_ptr, seq.to(tl.int64) * stride_ks + kv_head * stride_kh,
                                  offs_d, d_mask, qk_scale, (start == 0) & (end > 0))
    else:
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t0 in range(start, end, BLOCK_N):  # empty when the split holds no tokens
        pos = t0 + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        if HAS_SINK:  # position 0 came from the sink
            pos_mask = pos_mask & (pos > 0)
        k, ks = load_kv_tile(k_cache_ptr, k_scale_ptr, bt_row, pos, pos_mask, kv_head, offs_d, d_mask,
                             stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
                             BLOCK_SIZE, IS_FP8, FP8_BITS, compute_dtype)
        v, vs = load_kv_tile(v_cache_ptr, v_scale_ptr, bt_row, pos, pos_mask, kv_head, offs_d, d_mask,
                             stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
                             BLOCK_SIZE, IS_FP8, FP8_BITS, compute_dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (ks * qk_scale)[None, :]
        s = tl.where(pos_mask[None, :], s, float("-inf"))
        # finite: every tile has a valid token, or follows the sink (a tile of position 0 alone)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if F16_MATH:  # V scales relative to the tile's largest keep p x scale in [0, 1], inside fp16's normal range
            v_top = tl.max(vs, axis=0)
            v_top = tl.where(v_top > 0.0, v_top, 1.0)
            pv = (p * (vs / v_top)[None, :]).to(compute_dtype)
            acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION) * v_top
        else:
            pv = (p * vs[None, :]).to(compute_dtype)
            acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
        m = m_new

    has = l_sum > 0.0  # false for an empty split (or a zero-length sequence)
    out = acc / tl.where(has, l_sum, 1.0)[:, None]
    io_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT_OUT:  # a single split: no merge pass
        tl.store(out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        lse = tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf"))
        row = (seq.to(tl.int64) * tl.num_programs(1) * group + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], out, mask=io_mask)
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, head_dim, num_heads, num_splits, stride_os, stride_oh,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    base = (seq.to(tl.int64) * num_heads + head) * num_splits
    top = tl.max(tl.load(part_lse_ptr + base + offs_s, mask=offs_s < num_splits, other=float("-inf")), axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # all splits empty: weights are all zero
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = 0.0
    # summed in split order, not as a block reduction (whose order on a GPU follows the block's width): empty
    # splits add exact zeros, so a sequence split the same way gives the same bits under any grid (its split
    # count is the smaller of the grid's and its length's, splits_for: a batch can lower it)
    for split in range(num_splits):
        w = tl.exp2(tl.load(part_lse_ptr + base + split) - top)
        acc += tl.load(part_out_ptr + (base + split) * BLOCK_D + offs_d, mask=d_mask, other=0.0) * w
        total += w
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


@dataclass(frozen=True, slots=True)
class DecodeTiles:
    """How the split kernel is launched: ``block_n`` KV tokens per tile (a multiple of 32), and Triton's
    ``num_warps`` and ``num_stages`` (software-pipelined tile loads in flight per program).

    ``f16_math``: for an fp8 pool and a 16-bit query, convert the pool's bytes to fp16 and run both products
    in fp16 (fp32 accumulation), whatever the query's dtype. The fp8 -> bf16 cast is two conversions per
    value on sm_90 (e4m3 -> f16 -> bf16; the second through fp32), fp8 -> fp16 one packed conversion per two
    values (or none on the integer path), and the fp8 kernel measured on an H200 is bound by those
    conversions, not by memory (docs/performance.md). The scores keep their bits up to the summation
    order: fp8 and bf16 values are exact in fp16. ``p x V scale`` is taken relative to the tile's largest V
    scale, so it lies in [0, 1] and keeps fp16's 11 bits where bf16 kept 8; the tile's scale multiplies the
    fp32 product. An fp32 query ignores it (the fp32 path converts the pool to fp32).
    """

    block_n: int = BLOCK_N
    num_warps: int = 4
    num_stages: int = 3
    f16_math: bool = False


DEFAULT_TILES = DecodeTiles(block_n=128, num_warps=4, num_stages=3)
"""The launch of every decode. Measured on an H200 (``bench/gpu.py``'s (c) sweep, Llama-3-8B layer, 4K and 32K
tokens, batch 1 and 8, docs/performance.md): with :data:`SPLIT_WAVES` 2, 1.32x faster than 64-token tiles
at one wave for fp8 pools and 1.26x for bf16 (geometric means over the four cases; up to 1.84x at 32K, batch 1)."""


INTERPRETED: bool = isinstance(_decode_split_kernel, InterpretedFunction)
"""True when this module was imported with ``TRITON_INTERPRET=1`` (kernels then run on CPU tensors)."""


def splits_for(num_seqs: int, num_kv_heads: int, length: int, num_sms: int, waves: int = SPLIT_WAVES) -> int:
    """Splits of a sequence of ``length`` tokens: about ``waves`` programs per SM
    (``num_seqs x num_kv_heads x splits`` close to ``waves x num_sms``), each split at least
    :data:`MIN_TOKENS_PER_SPLIT` tokens, 1 to :data:`MAX_SPLITS`.

    ``max(1, min(ceil(waves x num_sms / (num_seqs x num_kv_heads)), ceil(length / MIN_TOKENS_PER_SPLIT),
    MAX_SPLITS))``. A launch's grid takes it at the block table's capacity; the kernel takes it at each
    sequence's length, and since the length term only grows with the length,
    ``min(grid count, ceil(length / MIN_TOKENS_PER_SPLIT))`` is this function of the length (what the
    kernel computes). :data:`SPLIT_WAVES` is measured (``bench/gpu.py``'s sweep, docs/performance.md).

    Args:
        num_seqs, num_kv_heads: the grid's first two dimensions.
        length: the sequence's tokens (for a launch grid: the block table's capacity, width x block_size).
        num_sms: the GPU's streaming multiprocessors (1 for the interpreter).
        waves: programs per SM aimed at.
    """
    wave = triton.cdiv(num_sms * waves, max(1, num_seqs * num_kv_heads))
    return max(1, min(wave, triton.cdiv(length, MIN_TOKENS_PER_SPLIT), MAX_SPLITS))


@functools.cache  # a device query per launch otherwise
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``; 1 for anything else (the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    """:func:`splits_for` on ``device``.

    Uses only host-side numbers (``max_len`` is the block table's capacity in
    tokens), so no device sync and a fixed value under CUDA graph capture.
    """
    return splits_for(num_seqs, num_kv_heads, max_len, num_sms(device))


def merge_block(num_splits: int) -> int:
    """The merge kernel's ``BLOCK_S`` (a compile-time size) for ``num_splits`` > 1 splits."""
    return triton.next_power_of_2(num_splits)


@functools.cache  # a device query per launch otherwise
def fp8_bits_default(device: torch.device) -> bool:
    """Whether fp8 pools on ``device`` are read by bit conversion: CUDA below compute capability 8.9."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) < NATIVE_FP8_CAPABILITY


def sink_args(sink: Sink | None, placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(sink K, sink V, seq stride, head stride)`` for a kernel launch; the placeholder when no sink."""
    if sink is None:
        return placeholder, placeholder, 0, 0
    k0, v0 = (t if t.dtype == torch.float32 and t.stride(-1) == 1 else t.float().contiguous() for t in sink)
    assert k0.stride() == v0.stride(), "sink K and V must share strides"
    return k0, v0, k0.stride(0), k0.stride(1)


def paged_decode(query: torch.Tensor, kv: KVLayer, block_table: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                 sink: Sink | None = None, num_splits: int | None = None, fp8_bits: bool | None = None,
                 split_tokens: int | None = None, tiles: DecodeTiles = DEFAULT_TILES) -> torch.Tensor:
    """:func:`decode_attention` with an explicit split count, fp8 conversion and launch tiling.

    Args:
        num_splits: the launch's splits per sequence (``None``: :func:`choose_num_splits`, from the block
            table's capacity). Splits beyond a sequence's length stay empty and carry zero weight in the merge.
        split_tokens: each sequence uses ``min(num_splits, ceil(length / split_tokens))`` of them (at
            least 1), cut from its own length (``None``: :data:`MIN_TOKENS_PER_SPLIT` when ``num_splits``
            is None, i.e. :func:`splits_for` of each length; 1 for an explicit count, all of them).
        fp8_bits: read fp8 bytes by integer bit conversion instead of Triton's
            float8e4nv cast (``None``: :func:`fp8_bits_default`; the switch lets
            the interpreter test the pre-8.9 path on CPU).
        tiles: the split kernel's tile size, warps and stages.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = kv.k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if split_tokens is None:
        split_tokens = MIN_TOKENS_PER_SPLIT if num_splits is None else 1
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, block_table.shape[1] * block_size, query.device)
    if fp8_bits is None:
        fp8_bits = fp8_bits_default(query.device)
    query = query if query.stride(-1) == 1 else query.contiguous()
    is_fp8, kc, vc, ks, vs = kernel_pools(kv)
    sink_k, sink_v, stride_ks, stride_kh = sink_args(sink, query)
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_out = torch.empty((num_seqs, num_heads, num_splits, block_d), dtype=torch.float32, device=query.device)
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, kc, vc, ks, vs, block_table, seq_lens, sink_k, sink_v, out, part_out, part_lse,
        sm_scale * LOG2E, group, head_dim, num_splits, split_tokens,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        block_table.stride(0), stride_ks, stride_kh,
        BLOCK_SIZE=block_size, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=tiles.block_n, DIRECT_OUT=num_splits == 1, IS_FP8=is_fp8, FP8_BITS=is_fp8 and fp8_bits,
        HAS_SINK=sink is not None, PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        F16_MATH=is_fp8 and tiles.f16_math and query.dtype != torch.float32, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if num_splits > 1:
        _merge_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, head_dim, num_heads, num_splits, out.stride(0), out.stride(1),
            BLOCK_S=merge_block(num_splits), BLOCK_D=block_d,
        )
    return out


def decode_attention(query: torch.Tensor, kv: KVLayer, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     sm_scale: float, sink: Sink | None = None) -> torch.Tensor:
    """:func:`kvchat.kernels.reference.decode_attention`, paged and split-KV.

    Beyond the reference's arguments: ``query`` fp16/bf16/fp32, the pools contiguous, ``block_table`` of unit
    stride on blocks, the sink's K and V of the same strides. A zero-length sequence gives zeros.
    """
    return paged_decode(query, kv, block_table, seq_lens, sm_scale, sink)
