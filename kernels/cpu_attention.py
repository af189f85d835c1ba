"""Compiled CPU decode attention and cache write (``cpu_attention.c``), straight on the paged pool.

A CPU decode step used to read each sequence's K/V from a contiguous float32
copy (:mod:`kvchat.engine.dense_kv`): 189 MB per step at 4,096 tokens of
SmolLM2, four times the fp8 pool's 47 MB (plus 3 MB of scales), plus the
copy's own upkeep (the new token read back from the pool and appended, every
layer). These kernels read the pool itself through the block table: each
128-token range of a sequence, all KV heads (one contiguous run per token),
is dequantized into a small float32 tile in cache (the dense copy's values,
the fp8 scale applied after the dot product) and attended to there, so DRAM
sees the pool's bytes once. The write
quantizes the new token's K/V exactly as :func:`kvchat.kernels.reference.write_kv`
does (bit for bit, NaN and inf included; tested), without its dozen small torch ops per layer.
Through :func:`decode_attention` the attention runs for decode steps only (:func:`kvchat.kernels.dispatch.decode_attention`'s
``provisional``); the compiled decoder layers (:mod:`kvchat.kernels.cpu_decode`) also run it for short chunks
of one sequence, whose K/V are stored (every chunk of that size runs there, so the bits are the same cold or
resumed). It needs ``head_dim`` a multiple of 16.
Figures (decode step at 4,096 tokens, this 2-core machine) are in docs/performance.md
and ``kvchat bench engine``.

Decode K/V are provisional (answers are recomputed as prefill chunks,
:data:`kvchat.engine.cache_identity.NUMERICS_VERSION` 2), so through
:func:`decode_attention` the attention's rounding (another summation order than
the reference's ``bmm``) never enters stored K/V; a query's bits depend on its
sequence's length and its place among the chunk's tokens only, not on the
thread count or on the other sequences of a batch. Built and loaded by
:mod:`kvchat.kernels.cpu_build`; where it is not available the reference runs
(and the engine decodes over its dense copy).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .cpu_build import load as load_library
from .layout import KVLayer, Sink
from .reference import FP8_DTYPE

SOURCE = Path(__file__).with_name("cpu_attention.c")
KINDS = {FP8_DTYPE: 0, torch.bfloat16: 1, torch.float16: 2}  # the C source's KIND_* per pool dtype
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # query and new K/V: computed in float32


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load_library(SOURCE)
    if lib is not None:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        for fn in (lib.kvchat_paged_attention, lib.kvchat_paged_write):
            fn.restype = None
        lib.kvchat_paged_attention.argtypes = [ptr] * 6 + [i64, ptr, ptr, ptr, i64, ptr, ptr, ptr] + [i64] * 7 + [
            ctypes.c_float, i32, i32]
        lib.kvchat_paged_write.argtypes = [ptr] * 7 + [i64] * 3 + [i32]
        lib.kvchat_attention_max_head_dim.restype = lib.kvchat_attention_tile_floats.restype = i64
        lib.kvchat_attention_work_floats.restype = i64
        lib.kvchat_attention_max_head_dim.argtypes = []
        lib.kvchat_attention_tile_floats.argtypes = [i64, i64, i64, i32]
        lib.kvchat_attention_work_floats.argtypes = [i64] * 5
    return lib


def available() -> bool:
    """Whether the compiled kernels are usable in this process (built or found on first call)."""
    return _library() is not None


def takes_pool(kv: KVLayer) -> bool:
    """A layer's pools the kernels read and write: CPU, contiguous ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` of one :data:`KINDS` dtype, ``head_dim`` a multiple of 16 up to the C source's limit, fp8 with
    contiguous float32 scales."""
    k_cache, v_cache = kv.k_cache, kv.v_cache
    if (k_cache.device.type != "cpu" or k_cache.dtype not in KINDS or v_cache.dtype != k_cache.dtype
            or k_cache.dim() != 4 or v_cache.shape != k_cache.shape
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return False
    d = k_cache.shape[3]
    if d % 16 or _library() is None or d > _library().kvchat_attention_max_head_dim():
        return False
    if k_cache.dtype != FP8_DTYPE:
        return True
    return all(s is not None and s.dtype == torch.float32 and s.is_contiguous() and s.shape == k_cache.shape[:3]
               for s in (kv.k_scale, kv.v_scale))


def takes_decode(query: torch.Tensor, kv: KVLayer, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 sink: Sink | None = None) -> bool:
    """Whether :func:`decode_attention` runs these (the arguments of
    :func:`kvchat.kernels.reference.decode_attention`): the pools as :func:`takes_pool` says, a float32 CPU
    query (any of :data:`FLOAT_DTYPES`) of whole query-head groups, int32 block table (``[num_seqs, max_blocks]``, columns contiguous)
    and lengths, and a sink of float32 ``[num_seqs, num_kv_heads, head_dim]`` rows with ``[num_kv_heads,
    head_dim]`` contiguous (any row stride), K and V alike."""
    if not takes_pool(kv):
        return False
    r, heads, d = query.shape
    hkv = kv.k_cache.shape[2]
    if (r < 1 or query.dtype not in FLOAT_DTYPES or d != kv.k_cache.shape[3] or heads % hkv
            or block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != r
            or block_table.stride(1) != 1 or seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (r,)
            or not seq_lens.is_contiguous()
            or any(t.device.type != "cpu" for t in (query, block_table, seq_lens, *(sink or ())))):
        return False
    return sink is None or all(
        s.dtype == torch.float32 and tuple(s.shape) == (r, hkv, d) and s.stride()[1:] == (d, 1)
        and s.stride() == sink[0].stride() for s in sink)


def decode_attention(query: torch.Tensor, kv: KVLayer, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     sm_scale: float, sink: Sink | None = None) -> torch.Tensor:
    """One query token per sequence over its whole cached sequence, read from the paged pool.

    Arguments, result and meaning as :func:`kvchat.kernels.reference.decode_attention`; zeros for a sequence
    of length 0.

    One pass over the pool: each 128-token range's scores, softmax and values in the thread's cache, the ranges
    merged with the online softmax's rescaling (``cpu_attention.c`` says how), so a row's bits depend on its length
    alone.

    Raises:
        ValueError: inputs :func:`takes_decode` refuses, or a length the block table cannot cover
            (the kernel reads ``ceil(L / block_size)`` entries of each row, unchecked).
    """
    if not takes_decode(query, kv, block_table, seq_lens, sink):
        raise ValueError(f"cpu decode attention: query {tuple(query.shape)} {query.dtype}, pool "
                         f"{tuple(kv.k_cache.shape)} {kv.k_cache.dtype}: not what the kernel takes (or it is not built)")
    lib = _library()
    r, heads, d = query.shape
    _, bs, hkv, _ = kv.k_cache.shape
    group, threads = heads // hkv, torch.get_num_threads()
    lengths = seq_lens.tolist()
    lmax = max(lengths)
    if min(lengths) < 0 or lmax > block_table.shape[1] * bs:
        raise ValueError(f"cpu decode attention: lengths {lengths} outside a block table of {block_table.shape[1]} "
                         f"blocks of {bs} tokens")
    q = query.float().contiguous()
    tile = torch.empty(lib.kvchat_attention_tile_floats(hkv, group, d, threads))
    work = torch.empty(lib.kvchat_attention_work_floats(r, hkv, group, d, lmax))
    out = torch.empty(r, heads, d)
    sink_k, sink_v, sink_stride = (None, None, 0) if sink is None else (sink[0].data_ptr(), sink[1].data_ptr(),
                                                                        sink[0].stride(0))
    lib.kvchat_paged_attention(q.data_ptr(), *pool_pointers(kv), block_table.data_ptr(), block_table.stride(0),
                               seq_lens.data_ptr(), sink_k, sink_v, sink_stride, out.data_ptr(), work.data_ptr(),
                               tile.data_ptr(), r, hkv, group, 1, d, bs, lmax, sm_scale, KINDS[kv.k_cache.dtype], threads)
    return out.to(query.dtype)


def takes_write(key: torch.Tensor, value: torch.Tensor, kv: KVLayer, slot_mapping: torch.Tensor) -> bool:
    """Whether :func:`write_kv` runs these (the arguments of :func:`kvchat.kernels.reference.write_kv`): the
    pools as :func:`takes_pool` says, CPU ``[num_tokens, num_kv_heads, head_dim]`` K/V of their
    shape in one of :data:`FLOAT_DTYPES`, int64 slots."""
    return (takes_pool(kv) and key.dtype == value.dtype and key.dtype in FLOAT_DTYPES
            and key.dim() == 3 and key.shape == value.shape and tuple(key.shape[1:]) == tuple(kv.k_cache.shape[2:])
            and slot_mapping.dtype == torch.int64 and tuple(slot_mapping.shape) == (key.shape[0],)
            and key.device.type == value.device.type == slot_mapping.device.type == "cpu")


def pool_pointers(kv: KVLayer) -> tuple[int, int, int | None, int | None]:
    """The addresses of the pools and (fp8) scales, as the C functions take them."""
    fp8 = kv.k_cache.dtype == FP8_DTYPE
    return (kv.k_cache.data_ptr(), kv.v_cache.data_ptr(), kv.k_scale.data_ptr() if fp8 else None,
            kv.v_scale.data_ptr() if fp8 else None)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv: KVLayer, slot_mapping: torch.Tensor) -> None:
    """:func:`kvchat.kernels.reference.write_kv` (same arguments; slot -1 skips a token), bit for bit the
    same pool contents.

    Raises:
        ValueError: inputs :func:`takes_write` refuses, or a slot outside the pool (the kernel writes unchecked).
    """
    if not takes_write(key, value, kv, slot_mapping):
        raise ValueError(f"cpu write_kv: key {tuple(key.shape)} {key.dtype}, pool {tuple(kv.k_cache.shape)} "
                         f"{kv.k_cache.dtype}: not what the kernel takes (or it is not built)")
    slots_in_pool = kv.k_cache.shape[0] * kv.k_cache.shape[1]
    if slot_mapping.numel() and int(slot_mapping.max()) >= slots_in_pool:
        raise ValueError(f"cpu write_kv: slot {int(slot_mapping.max())} outside a pool of {slots_in_pool} slots")
    k, v, slots = key.float().contiguous(), value.float().contiguous(), slot_mapping.contiguous()
    _library().kvchat_paged_write(k.data_ptr(), v.data_ptr(), *pool_pointers(kv), slots.data_ptr(),
                                  k.shape[0], k.shape[1], k.shape[2], KINDS[kv.k_cache.dtype])
