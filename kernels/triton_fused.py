"""Triton kernels that fuse a decode step's elementwise work, so a decoder layer runs in few launches.

A decode step of one or a few tokens is launch-bound on a GPU: each torch operator is a kernel launch
of a few microseconds that moves a few kilobytes. The model (``kvchat.model.transformer``) runs these
kernels in decode steps on the Triton backend, in place of:

- :func:`add_rms_norm`: the residual add and RMSNorm (8 operators in bf16, plus the add) -> 1 launch,
  as vLLM's ``fused_add_rms_norm``;
- :func:`rope_write_kv`: RoPE of Q and K, the K shift (``kvchat.engine.calibration``) and the cache
  write of K and V (``triton_write``, whose row store it shares) -> 1 launch; Q comes back rotated;
- :func:`silu_mul`: SwiGLU's ``silu(gate) * up`` -> 1 launch.

Each kernel rounds where the torch operators round (to the compute dtype after every operator, in the
same order: ``x * cos`` is rounded before ``+ swap(x) * sin``, the residual sum before the norm, the
normalised row before the weight multiplies it, ``silu(gate)`` before ``* up``), so the results equal
the operators' up to what differs inside one operator: the order of the sum of squares in the norm,
``rsqrt``/``exp`` implementations, and whether a multiply-add is contracted to an FMA. Those differ
in the last bits of fp32 (up to 4 units in the last place measured bound: rsqrt's error carried through
two multiplies) and, after the rounding to bf16/fp16, by at most one unit in the last place in rare ties
(tests/kernels/test_kernels_fused.py checks these bounds). Decode steps' K/V are provisional
(recomputed as prefill chunks when the turn ends,
``kvchat.engine.runner.Engine.decode``), so this rounding never reaches stored K/V; prefill chunks keep
the torch operators. The fp8 cache write itself is ``triton_write``'s, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .layout import KVLayer
from .reference import FP8_EPS, FP8_MAX
from .triton_write import kernel_pools, store_rows


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, delta_ptr, w_ptr, out_ptr, sum_ptr, n, eps,
    stride_x, stride_d, stride_o, stride_s,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:  # the residual sum, rounded to the compute dtype as torch's add rounds it
        d = tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.math.div_rn(tl.sum(xf * xf, axis=0), n.to(tl.float32))
    y = (xf * tl.math.rsqrt(mean_sq + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


INTERPRETED: bool = isinstance(_add_rms_norm_kernel, InterpretedFunction)
"""True when this module was imported with ``TRITON_INTERPRET=1`` (kernels then run on CPU tensors)."""


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + delta) * weight, x + delta)`` in one launch (``delta`` None: no add; then ``x`` itself).

    As :meth:`kvchat.model.transformer.RMSNorm.add_forward`: the sum rounded to ``x.dtype``, the norm in
    fp32 (Zhang & Sennrich 2019), the normalised row rounded to ``x.dtype`` before ``weight`` (same
    dtype) multiplies it. See the module doc for where the bits may differ.

    Args:
        x, delta: ``[rows, n]`` fp32/fp16/bf16, unit stride on ``n``.
        weight: ``[n]``, ``x.dtype``, contiguous.
    """
    rows, n = x.shape
    out = torch.empty_like(x)
    total = x if delta is None else torch.empty_like(x)
    if rows == 0:
        return out, total
    d = x if delta is None else delta
    _add_rms_norm_kernel[(rows,)](
        x, d, weight, out, total, n, eps, x.stride(0), d.stride(0), out.stride(0), total.stride(0),
        HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8,
    )
    return out, total


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)  # silu, rounded as F.silu's output
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * up).to(out_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[rows, 2 * inter]`` (gate first, as ``MLP.gate_up`` stores them),
    unit stride on the last dimension; returns ``[rows, inter]`` in its dtype (Shazeer 2020's SwiGLU)."""
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(SILU_BLOCK, triton.next_power_of_2(inter))
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                             BLOCK=block)
    return out


@triton.jit
def _rotate(rows_ptr, mask, offs_d, swap_d, cos, sin, OUT_DTYPE: tl.constexpr):
    """RoPE of the head rows at ``rows_ptr`` (``[BLOCK_H, 1]`` pointers to each row's start; ``mask``
    ``[BLOCK_H, BLOCK_D]``), rounded as :func:`kvchat.model.transformer.apply_rope`: ``x * cos`` rounded,
    then ``+ swap(x) * sin`` rounded."""
    x = tl.load(rows_ptr + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xs = tl.load(rows_ptr + swap_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xc = (x * cos[None, :]).to(OUT_DTYPE).to(tl.float32)
    return (xc + xs * sin[None, :]).to(OUT_DTYPE)


@triton.jit
def _rope_write_kernel(
    qk_ptr, v_ptr, cos_ptr, sin_ptr, shift_ptr, q_out_ptr,
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_qk, stride_v, stride_rope, stride_qo_t, stride_qo_h,
    stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
    num_heads, num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SHIFT: tl.constexpr, IS_FP8: tl.constexpr, FP8_MAX_C: tl.constexpr, FP8_EPS_C: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    half = head_dim // 2
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    swap_d = tl.where(offs_d < half, offs_d + half, offs_d - half)  # rotate-half's partner element
    cos = tl.load(cos_ptr + tok * stride_rope + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tok * stride_rope + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    out_dtype = q_out_ptr.dtype.element_ty

    h = tl.arange(0, BLOCK_H)
    h_mask = h < num_heads
    q_rows = qk_ptr + tok * stride_qk + h[:, None] * head_dim
    q_mask = h_mask[:, None] & d_mask[None, :]
    q = _rotate(q_rows, q_mask, offs_d, swap_d, cos, sin, out_dtype)
    tl.store(q_out_ptr + tok * stride_qo_t + h[:, None] * stride_qo_h + offs_d[None, :], q, mask=q_mask)

    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:  # -1: a padded row, nothing stored
        kv = tl.arange(0, BLOCK_KV)
        kv_mask = kv < num_kv_heads
        mask = kv_mask[:, None] & d_mask[None, :]
        k_rows = qk_ptr + tok * stride_qk + (num_heads + kv[:, None]) * head_dim
        k = _rotate(k_rows, mask, offs_d, swap_d, cos, sin, out_dtype)
        if HAS_SHIFT:  # K centring, rounded as torch's ``k - k_shift``
            shift = tl.load(shift_ptr + kv[:, None] * head_dim + offs_d[None, :], mask=mask, other=0.0)
            k = (k.to(tl.float32) - shift.to(tl.float32)).to(out_dtype)
        k = tl.where(mask, k, 0.0)
        v = tl.load(v_ptr + tok * stride_v + kv[:, None] * head_dim + offs_d[None, :], mask=mask, other=0.0)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        dst = block * stride_cb + offset * stride_cs + kv[:, None] * stride_ch + offs_d[None, :]
        sc = block * stride_sb + offset * stride_ss + kv * stride_sh
        store_rows(k, k_cache_ptr, k_scale_ptr, dst, sc, mask, kv_mask, IS_FP8, FP8_MAX_C, FP8_EPS_C)
        store_rows(v, v_cache_ptr, v_scale_ptr, dst, sc, mask, kv_mask, IS_FP8, FP8_MAX_C, FP8_EPS_C)


def rope_write_kv(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                  k_shift: torch.Tensor | None, kv: KVLayer, slot_mapping: torch.Tensor) -> torch.Tensor:
    """RoPE of Q and K, ``K - k_shift``, and K/V into the paged pools, in one launch; returns rotated Q.

    The same values as :func:`kvchat.model.transformer.apply_rope` on ``qk``, ``k - k_shift`` and
    :func:`kvchat.kernels.triton_write.write_kv` (whose fp8 row store this kernel calls); see the
    module doc for where the bits may differ.

    Args:
        qk: ``[T, num_heads + num_kv_heads, head_dim]`` Q heads then K heads, unit stride on the
            last two dimensions (a view of the fused q/k/v projection's rows); fp32/fp16/bf16.
        v: ``[T, num_kv_heads, head_dim]``, unit stride on the last two dimensions.
        cos, sin_signed: ``[T, 1, head_dim]`` from :meth:`kvchat.model.transformer.Transformer.rope`
            (``sin_signed`` carries rotate-half's sign), unit stride on ``head_dim``.
        k_shift: ``[num_kv_heads, head_dim]`` contiguous in ``qk.dtype``, or None.
        kv, slot_mapping: as :func:`kvchat.kernels.triton_write.write_kv`.
    Returns:
        Q ``[T, num_heads, head_dim]`` in ``qk.dtype``, rotated.
    """
    num_tokens, _, head_dim = qk.shape
    num_kv_heads = v.shape[1]
    num_heads = qk.shape[1] - num_kv_heads
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qk.dtype, device=qk.device)
    if num_tokens == 0:
        return q
    assert qk.stride(2) == 1 and qk.stride(1) == head_dim and v.stride(2) == 1 and v.stride(1) == head_dim
    is_fp8, kc, vc, ks, vs = kernel_pools(kv)
    cos2, sin2 = cos.reshape(num_tokens, head_dim), sin_signed.reshape(num_tokens, head_dim)
    assert cos2.stride() == sin2.stride() and cos2.stride(1) == 1
    _rope_write_kernel[(num_tokens,)](
        qk, v, cos2, sin2, qk if k_shift is None else k_shift, q,
        kc, vc, ks, vs, slot_mapping,
        qk.stride(0), v.stride(0), cos2.stride(0), q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        num_heads, num_kv_heads, head_dim,
        BLOCK_SIZE=kc.shape[1], BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_SHIFT=k_shift is not None, IS_FP8=is_fp8, FP8_MAX_C=FP8_MAX, FP8_EPS_C=FP8_EPS,
    )
    return q


def warm_up(hidden_size: int, intermediate_size: int, num_heads: int, dtype: torch.dtype,
            pool_layer: KVLayer, k_shift: torch.Tensor | None) -> None:
    """Launch every kernel here once as an engine's decode steps launch them (same dtypes, strides and
    constexprs), on zeros, so Triton compiles them at engine start rather than at the first token
    (``kvchat.kernels.warmup`` does the attention kernels). Writes nothing to the pool (slot -1).

    Args:
        pool_layer: one layer's pools (``KVPool.layer``).
        k_shift: the layers' K shift (``[num_kv_heads, head_dim]``) or None, as the model holds it.
    """
    dev, (num_kv_heads, head_dim) = pool_layer.k_cache.device, pool_layer.k_cache.shape[2:]
    x = torch.zeros((1, hidden_size), dtype=dtype, device=dev)
    weight = torch.ones(hidden_size, dtype=dtype, device=dev)
    add_rms_norm(x, None, weight, 1e-6)
    add_rms_norm(x, x, weight, 1e-6)
    silu_mul(torch.zeros((1, 2 * intermediate_size), dtype=dtype, device=dev))
    qkv = torch.zeros((1, (num_heads + 2 * num_kv_heads) * head_dim), dtype=dtype, device=dev)
    split = (num_heads + num_kv_heads) * head_dim
    rope = torch.zeros((1, 1, head_dim), dtype=dtype, device=dev)
    rope_write_kv(qkv[:, :split].view(1, -1, head_dim), qkv[:, split:].view(1, num_kv_heads, head_dim), rope, rope,
                  k_shift, pool_layer, torch.full((1,), -1, dtype=torch.long, device=dev))
