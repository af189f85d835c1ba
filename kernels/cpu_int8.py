"""The compiled CPU int8 matmul (``cpu_int8.c``): int8 weights in asymmetric groups of 32, float32 activations.

Why compiled C: PyTorch's CPU int8 weight-only kernel
(``torch._weight_int8pack_mm``) takes one scale per output channel and is
vectorized for bf16 activations only (its fp32 path is scalar, ~15x slower),
so kvchat cast every decode row to bf16 before it and could not use finer
groups (one kernel call per group). This kernel takes the fp32 rows as they
are and a scale and an offset per 32 inputs of each output channel
(:func:`kvchat.model.quant.quantize_int8_groups`). Over SmolLM2's 30 layers
and LM head at one row (2 threads, this 2-core machine) it measured 10.4
ms, against 11-15 ms for the bf16 int8 kernel with per-channel scales and
6.7 ms for this kernel's per-channel variant (same run, side by side): the
groups' scales and offsets add 25% to the bytes read and a scaled FMA per
group, and buy the fidelity the module doc of :mod:`kvchat.model.quant`
quotes (per channel missed the +0.5% perplexity goal on two of three
seed articles; groups of 32 meet it on all three).

It is built and loaded by :mod:`kvchat.kernels.cpu_build` (once per machine;
its threads are torch's pool). Where it cannot be, or
``KVCHAT_CPU_KERNEL=0``, :func:`available` is False and int8 layers keep the
per-channel scheme on torch's kernel; the two enter the cache fingerprint
under different names (:func:`kvchat.model.int8_scheme.int8_compute_scheme`),
since their K/V differ.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .cpu_build import load as load_library

SOURCE = Path(__file__).with_name("cpu_int8.c")
GROUP = 32  # cpu_kernels.h's GROUP: inputs per scale and offset


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load_library(SOURCE)
    if lib is not None:
        fn = lib.kvchat_int8_matmul
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    return lib


def available() -> bool:
    """Whether the compiled kernel is usable in this process (built or found on first call; see the module doc)."""
    return _library() is not None


def small_rows_kernel() -> str:
    """The kernel this process runs int8 layers' few-row matmuls on: ``avx2`` (this one) when
    :func:`available`, else ``int8mm`` (torch's, bf16 activations); a
    :data:`kvchat.model.int8_scheme.SMALL_ROWS_KERNELS` name."""
    return "avx2" if available() else "int8mm"


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``y = x W^T`` with ``W[n, 32 g + k] = scale[n, g] * q[n, 32 g + k] + offset[n, g]``, fp32 throughout.

    Args:
        x: float32 ``[M, K]`` on the CPU (any strides), ``K = 32 G``.
        q: int8 ``[N, K]``, contiguous.
        scale, offset: float32 ``[N, G]``, contiguous.
    Returns:
        float32 ``[M, N]``. A row's bits do not depend on ``M`` (the C source says why).
    Raises:
        RuntimeError: the kernel is not :func:`available`.
        ValueError: shapes, dtypes or layout the kernel does not take.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the compiled CPU int8 kernel is not available")
    n, k = q.shape
    groups = k // GROUP
    if (x.dtype != torch.float32 or q.dtype != torch.int8 or scale.dtype != torch.float32
            or offset.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or k % GROUP
            or tuple(scale.shape) != (n, groups) or tuple(offset.shape) != (n, groups)
            or not (q.is_contiguous() and scale.is_contiguous() and offset.is_contiguous()) or x.device.type != "cpu"):
        raise ValueError(f"int8_matmul: x {tuple(x.shape)} {x.dtype}, q {tuple(q.shape)} {q.dtype}, "
                         f"scale {tuple(scale.shape)}, offset {tuple(offset.shape)}: not a layout the kernel takes")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    xsum = torch.empty(x.shape[0], groups, dtype=torch.float32)
    lib.kvchat_int8_matmul(x.data_ptr(), q.data_ptr(), scale.data_ptr(), offset.data_ptr(), xsum.data_ptr(),
                           y.data_ptr(), x.shape[0], n, groups, torch.get_num_threads())
    return y
