"""Triton prefix-extend attention: a chunk of new queries over the cached prefix and causally over itself.

Same signature and result as :func:`kvchat.kernels.reference.extend_attention`.
Used for prefill (empty prefix) and for resuming a restored or shared
prefix. The chunk's own K/V are already in the pool, and every tile is read
with :func:`kvchat.kernels.triton_decode.load_kv_tile`, so extend sees
exactly the values decode will see (PagedAttention layout, Kwon et al.,
SOSP 2023).

One program handles ``BLOCK_Q`` consecutive query tokens times all
``group`` query heads of one KV head (GQA), flattened into ``BLOCK_R`` rows,
and walks the keys ``0 .. last query position`` in ``BLOCK_N`` tiles with
an fp32 online softmax in base 2 (Dao, "FlashAttention-2", 2023). The fp8
K scale multiplies the scores and the V scale the probabilities. fp8 bytes
are converted as in the decode kernel (``FP8_BITS`` below compute capability
8.9), and with an exact sink (``HAS_SINK``) every row starts from position
0's fp32 K/V (:func:`kvchat.kernels.triton_decode.sink_init`; key 0 is visible
to every query) and the tiles skip position 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .layout import KVLayer, Sink
from .triton_decode import BLOCK_N, LOG2E, fp8_bits_default, load_kv_tile, sink_args, sink_init
from .triton_write import kernel_pools

BLOCK_R = 64  # query rows (tokens x heads of a group) per program


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq_lens_ptr, cu_q_ptr,
    sink_k_ptr, sink_v_ptr, out_ptr, qk_scale, group, head_dim,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh, stride_bt, stride_ks, stride_kh,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, IS_FP8: tl.constexpr, FP8_BITS: tl.constexpr, HAS_SINK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tl.static_assert(BLOCK_Q * BLOCK_G >= 16)  # GPU tl.dot minimums: M, N, K >= 16 (K >= 32 for 8-bit operands)
    tl.static_assert(BLOCK_N >= 32)
    tl.static_assert(BLOCK_D >= 16)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)
    q_begin = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_begin
    if q_block * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix_len = seq_len - q_len
        rows = tl.arange(0, BLOCK_Q * BLOCK_G)
        tok = q_block * BLOCK_Q + rows // BLOCK_G  # query index within the chunk
        g = rows % BLOCK_G
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < head_dim
        row_mask = (tok < q_len) & (g < group)
        io_mask = row_mask[:, None] & d_mask[None, :]
        heads = kv_head * group + g
        q_row = (q_begin + tok).to(tl.int64)
        q = tl.load(q_ptr + q_row[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=io_mask, other=0.0)
        compute_dtype = q.dtype
        q_pos = prefix_len + tok
        kv_end = prefix_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
        bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt

        if HAS_SINK:  # every row sees key 0: start from the exact sink
            m, l_sum, acc = sink_init(q, sink_k_ptr, sink_v_ptr, seq.to(tl.int64) * stride_ks + kv_head * stride_kh,
                                      offs_d, d_mask, qk_scale, kv_end > 0)
        else:
            m = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
            l_sum = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
        for t0 in range(0, kv_end, BLOCK_N):
            pos = t0 + tl.arange(0, BLOCK_N)
            pos_mask = pos < kv_end
            if HAS_SINK:  # position 0 came from the sink
                pos_mask = pos_mask & (pos > 0)
            k, ks = load_kv_tile(k_cache_ptr, k_scale_ptr, bt_row, pos, pos_mask, kv_head, offs_d, d_mask,
                                 stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
                                 BLOCK_SIZE, IS_FP8, FP8_BITS, compute_dtype)
            v, vs = load_kv_tile(v_cache_ptr, v_scale_ptr, bt_row, pos, pos_mask, kv_head, offs_d, d_mask,
                                 stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
                                 BLOCK_SIZE, IS_FP8, FP8_BITS, compute_dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (ks * qk_scale)[None, :]
            # key 0 (or the sink) is visible to every row, so each row's max is finite after the first tile
            s = tl.where(pos_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            pv = (p * vs[None, :]).to(compute_dtype)
            acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
            m = m_new

        out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
        tl.store(out_ptr + q_row[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


INTERPRETED: bool = isinstance(_extend_kernel, InterpretedFunction)
"""True when this module was imported with ``TRITON_INTERPRET=1`` (kernels then run on CPU tensors)."""


def extend_attention(query: torch.Tensor, kv: KVLayer, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, sm_scale: float, sink: Sink | None = None,
                     fp8_bits: bool | None = None) -> torch.Tensor:
    """:func:`kvchat.kernels.reference.extend_attention` in one launch.

    Beyond the reference's arguments: ``query`` fp16/bf16/fp32, the pools contiguous, ``block_table`` of unit
    stride on blocks; ``fp8_bits``: read fp8 bytes by integer bit conversion (``None``: below compute
    capability 8.9; see :func:`kvchat.kernels.triton_decode.paged_decode`).

    The grid is sized by ``total_q`` (no device sync); query blocks past a
    sequence's own length exit at once.
    """
    total_q, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = kv.k_cache.shape
    num_seqs = block_table.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if total_q == 0 or num_seqs == 0:
        return out
    if fp8_bits is None:
        fp8_bits = fp8_bits_default(query.device)
    query = query if query.stride(-1) == 1 else query.contiguous()
    is_fp8, kc, vc, ks, vs = kernel_pools(kv)
    sink_k, sink_v, stride_ks, stride_kh = sink_args(sink, query)
    block_g = triton.next_power_of_2(group)
    block_q = max(1, BLOCK_R // block_g)
    _extend_kernel[(num_seqs, num_kv_heads, triton.cdiv(total_q, block_q))](
        query, kc, vc, ks, vs, block_table, seq_lens, cu_seqlens_q, sink_k, sink_v, out,
        sm_scale * LOG2E, group, head_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        block_table.stride(0), stride_ks, stride_kh,
        BLOCK_SIZE=block_size, BLOCK_G=block_g, BLOCK_Q=block_q,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=BLOCK_N, IS_FP8=is_fp8,
        FP8_BITS=is_fp8 and fp8_bits, HAS_SINK=sink is not None,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=8 if head_dim > 64 else 4,  # 4 warps spill registers at head_dim 128 on sm_80
    )
    return out
