"""Compiled CPU decode attention (``cpu_attention.c``): one query token over a contiguous float32 K/V copy.

The CPU read path (:mod:`kvchat.engine.dense_kv`) keeps each sequence's K/V
as float32 ``[num_kv_heads, L, head_dim]``; a decode step reads all of it
twice per layer (scores, then values). ``torch.bmm`` over ``[3, 3, L]``
batches splits its work by batch entry, so one of this machine's two cores
sits out a third of the time; this kernel splits every head's tokens into
256-token ranges instead, and both passes read memory at the rate of the
int8 matmul. The softmax between them stays torch's. Its figures in a decode
step are in ``kvchat bench engine`` and the README.

Decode K/V are provisional (answers are recomputed as prefill chunks,
:data:`kvchat.engine.cache_identity.NUMERICS_VERSION` 2), so this kernel's
rounding (another summation order than ``torch.bmm``'s) never enters stored
K/V; its bits depend on ``L`` only, not on the thread count. Built and
loaded by :mod:`kvchat.kernels.cpu_build`; where it is not available the
reference's ``bmm`` path runs.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .cpu_build import load as load_library

SOURCE = Path(__file__).with_name("cpu_attention.c")


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load_library(SOURCE)
    if lib is not None:
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.kvchat_decode_scores.restype = lib.kvchat_decode_values.restype = lib.kvchat_decode_limits.restype = None
        lib.kvchat_decode_scores.argtypes = [ptr] * 3 + [i64] * 6 + [ctypes.c_float, ctypes.c_int]
        lib.kvchat_decode_values.argtypes = [ptr] * 4 + [i64] * 6 + [ctypes.c_int]
        lib.kvchat_decode_limits.argtypes = [ctypes.POINTER(i64)] * 2
    return lib


def available() -> bool:
    """Whether the compiled kernel is usable in this process (built or found on first call)."""
    return _library() is not None


@functools.cache
def _limits() -> tuple[int, int]:
    """``(tokens per task, largest head_dim)`` as the C source defines them."""
    split, dim = ctypes.c_int64(), ctypes.c_int64()
    _library().kvchat_decode_limits(ctypes.byref(split), ctypes.byref(dim))
    return split.value, dim.value


def takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` runs these: the library is available, one float32 CPU query token,
    float32 CPU K/V of at least one token with ``head_dim`` contiguous and equal strides, a head_dim that is
    a positive multiple of 8 the kernel compiles for, and whole query-head groups."""
    t, h, d = query.shape
    hkv = key.shape[0]
    return (t == 1 and query.device.type == key.device.type == "cpu" and key.dtype == value.dtype == torch.float32
            and key.shape == value.shape and key.shape[1] >= 1 and key.shape[2] == d and d >= 8 and d % 8 == 0
            and hkv >= 1 and h % hkv == 0 and key.stride() == value.stride() and key.stride(2) == 1
            and _library() is not None and d <= _limits()[1])


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Softmax attention of one token over all of ``key``/``value`` (no mask: every position is visible).

    Args:
        query: ``[1, num_heads, head_dim]`` (any float dtype; computed in float32), heads grouped under
            their KV head as in :func:`kvchat.kernels.reference.dense_attention`.
        key, value: float32 ``[num_kv_heads, L, head_dim]``, ``head_dim`` contiguous (views with a longer
            stride along ``L`` are read in place).
        sm_scale: softmax scale.
    Returns:
        ``[1, num_heads, head_dim]`` in ``query.dtype``.
    Raises:
        ValueError: inputs :func:`takes` refuses.
    """
    if not takes(query, key, value):
        raise ValueError(f"cpu decode attention: query {tuple(query.shape)} {query.dtype}, key {tuple(key.shape)} "
                         f"{key.dtype} stride {key.stride()}: not what the kernel takes (or it is not built)")
    lib = _library()
    _, h, d = query.shape
    hkv, length = key.shape[0], key.shape[1]
    group, threads = h // hkv, torch.get_num_threads()
    q = query.reshape(h, d).float().contiguous()
    scores = torch.empty(hkv, group, length)
    lib.kvchat_decode_scores(q.data_ptr(), key.data_ptr(), scores.data_ptr(), hkv, group, d, length,
                             key.stride(0), key.stride(1), sm_scale, threads)
    probs = torch.softmax(scores, dim=-1)
    out = torch.empty(1, h, d)
    work = torch.empty(hkv * -(-length // _limits()[0]), group, d)
    lib.kvchat_decode_values(probs.data_ptr(), value.data_ptr(), out.data_ptr(), work.data_ptr(), hkv, group, d,
                             length, value.stride(0), value.stride(1), threads)
    return out.to(query.dtype)
