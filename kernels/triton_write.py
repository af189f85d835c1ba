"""Triton cache write: new tokens' K/V into the paged pools (vLLM's ``reshape_and_cache``).

Same signature and result as :func:`kvchat.kernels.reference.write_kv`
(layout from Kwon et al., "Efficient Memory Management for Large Language
Model Serving with PagedAttention", SOSP 2023). One program per token
handles all of its KV heads, K and V.

FP8 pools: the per-token, per-KV-head scale ``max(amax, 1e-6) / 448`` and
the division by it use IEEE round-to-nearest division (``tl.math.div_rn``;
Triton's ``/`` may lower to an approximate divide on NVIDIA GPUs), and the
fp32 -> float8_e4m3fn rounding is done with integer bit operations, so the
stored bytes equal torch's round-to-nearest-even cast bit for bit on a GPU
and under the Triton interpreter alike (whose own fp8 cast mis-rounds
carries and does not saturate). 16-bit pools take a plain cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .layout import KVLayer
from .reference import FP8_DTYPE, FP8_EPS, FP8_MAX


@triton.jit
def fp8_e4m3_bits(x):
    """fp32 values in [-448, 448] -> float8_e4m3fn bit patterns (uint8), round to nearest even.

    Normal range (|x| >= 2**-6): round the 23-bit fp32 mantissa to 3 bits
    with the usual ``+0x7FFFF + lsb`` carry trick; the carry may roll into
    the exponent, which is exactly right. Below 2**-6 the e4m3 encoding is
    ``round(|x| * 2**9)`` (subnormals, and 8 = the smallest normal), done by
    shifting the mantissa with its implicit bit and rounding ties to even.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    mant = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - (a >> 23), 21), 25)
    q = mant >> shift
    below = mant >> (shift - 1)
    half = below & 1
    sticky = (mant - (below << (shift - 1))) != 0
    sub = q + (half & (sticky.to(tl.int32) | (q & 1)))
    mag = tl.where(a >= 0x3C800000, normal, sub)
    return (sign | mag).to(tl.uint8)


@triton.jit
def store_rows(
    x, cache_ptr, scale_ptr, dst_offs, scale_offs, mask, head_mask,
    IS_FP8: tl.constexpr, FP8_MAX_C: tl.constexpr, FP8_EPS_C: tl.constexpr,
):
    """Store one token's K or V rows ``x`` (``[heads, dim]``, zero where ``mask`` is false) into a pool.

    FP8 pools: per row, the scale ``max(amax, FP8_EPS_C) / FP8_MAX_C`` goes to ``scale_ptr + scale_offs``
    and the bytes of ``x / scale`` (clamped, rounded to nearest even) to ``cache_ptr + dst_offs``;
    16-bit pools take a plain cast.
    """
    if IS_FP8:
        xf = x.to(tl.float32)
        amax = tl.max(tl.abs(xf), axis=1)
        scale = tl.math.div_rn(tl.maximum(amax, FP8_EPS_C), tl.full(amax.shape, FP8_MAX_C, tl.float32))
        y = tl.math.div_rn(xf, scale[:, None])
        y = tl.minimum(tl.maximum(y, -FP8_MAX_C), FP8_MAX_C)
        tl.store(cache_ptr + dst_offs, fp8_e4m3_bits(y), mask=mask)
        tl.store(scale_ptr + scale_offs, scale, mask=head_mask)
    else:
        tl.store(cache_ptr + dst_offs, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_token(
    src_ptr, cache_ptr, scale_ptr, src_offs, dst_offs, scale_offs, mask, head_mask,
    IS_FP8: tl.constexpr, FP8_MAX_C: tl.constexpr, FP8_EPS_C: tl.constexpr,
):
    x = tl.load(src_ptr + src_offs, mask=mask, other=0.0)
    store_rows(x, cache_ptr, scale_ptr, dst_offs, scale_offs, mask, head_mask, IS_FP8, FP8_MAX_C, FP8_EPS_C)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    stride_sb, stride_ss, stride_sh,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr, FP8_MAX_C: tl.constexpr, FP8_EPS_C: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        head_mask = h < num_kv_heads
        mask = head_mask[:, None] & (d < head_dim)[None, :]
        dst = block * stride_cb + offset * stride_cs + h[:, None] * stride_ch + d[None, :]
        sc = block * stride_sb + offset * stride_ss + h * stride_sh
        k_src = tok.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :]
        v_src = tok.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :]
        _store_token(key_ptr, k_cache_ptr, k_scale_ptr, k_src, dst, sc, mask, head_mask,
                     IS_FP8, FP8_MAX_C, FP8_EPS_C)
        _store_token(value_ptr, v_cache_ptr, v_scale_ptr, v_src, dst, sc, mask, head_mask,
                     IS_FP8, FP8_MAX_C, FP8_EPS_C)


INTERPRETED: bool = isinstance(_write_kv_kernel, InterpretedFunction)
"""True when this module was imported with ``TRITON_INTERPRET=1`` (kernels then run on CPU tensors)."""


def kernel_pools(kv: KVLayer) -> tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(is_fp8, K pool, V pool, K scales, V scales)`` as this package's kernels take them: fp8 pools as their
    bytes; 16-bit pools, which have no scales, passed again in their place (never dereferenced)."""
    if kv.k_cache.dtype == FP8_DTYPE:
        return True, kv.k_cache.view(torch.uint8), kv.v_cache.view(torch.uint8), kv.k_scale, kv.v_scale
    return False, kv.k_cache, kv.v_cache, kv.k_cache, kv.v_cache


def write_kv(key: torch.Tensor, value: torch.Tensor, kv: KVLayer, slot_mapping: torch.Tensor) -> None:
    """:func:`kvchat.kernels.reference.write_kv`, quantizing in-kernel for fp8 pools.

    Beyond the reference's arguments: ``key``/``value`` may have any token/head strides (unit stride on
    head_dim); the pools and scales must be contiguous; ``slot_mapping`` may be int32.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    is_fp8, kc, vc, ks, vs = kernel_pools(kv)
    _write_kv_kernel[(num_tokens,)](
        key, value, kc, vc, ks, vs, slot_mapping.contiguous(),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=kc.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        IS_FP8=is_fp8, FP8_MAX_C=FP8_MAX, FP8_EPS_C=FP8_EPS,
    )
