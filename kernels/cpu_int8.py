"""The compiled CPU int8 matmul (``cpu_int8.c``): int8 weights, float32 activations, AVX2 + FMA, few rows.

Why compiled C: PyTorch's CPU int8 weight-only kernel
(``torch._weight_int8pack_mm``) is vectorized for bf16 activations only, so
kvchat cast every decode row to bf16 before it; its fp32 path is scalar
(~15x slower). This kernel takes the fp32 rows as they are (no bf16
rounding) and, over SmolLM2's 30 layers and LM head at one row, measured
5.4-6.3 ms against 11-15 ms for the bf16 int8 kernel (2 threads, this
2-core machine; ``kvchat bench engine`` has the figures in a decode step).

It is built and loaded by :mod:`kvchat.kernels.cpu_build` (once per machine;
its threads are torch's pool). Where it cannot be, or
``KVCHAT_CPU_KERNEL=0``, :func:`available` is False and int8 layers keep the
bf16 int8 kernel; the two choices enter the cache fingerprint under different names
(:func:`kvchat.model.int8_scheme.int8_compute_scheme`), since their K/V differ.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import cpu_build

SOURCE = Path(__file__).with_name("cpu_int8.c")
GROUP_MULTIPLE = 32  # the kernel's inner step over k (four 8-lane vectors)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load(SOURCE)
    if lib is not None:
        fn = lib.kvchat_int8_matmul
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    return lib


def available() -> bool:
    """Whether the compiled kernel is usable in this process (built or found on first call; see the module doc)."""
    return _library() is not None


def small_rows_kernel() -> str:
    """The kernel this process runs int8 layers' few-row matmuls on: ``avx2`` (this one) when
    :func:`available`, else ``int8mm`` (torch's, bf16 activations); a
    :data:`kvchat.model.int8_scheme.SMALL_ROWS_KERNELS` name."""
    return "avx2" if available() else "int8mm"


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``y[m, n] = sum_g scale[g, n] * (x[m, g-th group] · q[g, n])``, fp32 throughout.

    Args:
        x: float32 ``[M, K]`` on the CPU, ``K = G * group``.
        q: int8 ``[G, N, group]``, contiguous, ``group`` a multiple of :data:`GROUP_MULTIPLE`.
        scale: float32 ``[G, N]``, contiguous.
    Returns:
        float32 ``[M, N]``. A row's bits do not depend on ``M`` (the C source says why).
    Raises:
        RuntimeError: the kernel is not :func:`available`.
        ValueError: shapes, dtypes or layout the kernel does not take.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the compiled CPU int8 kernel is not available")
    groups, n, group = q.shape
    if (x.dtype != torch.float32 or q.dtype != torch.int8 or scale.dtype != torch.float32 or x.dim() != 2
            or x.shape[1] != groups * group or tuple(scale.shape) != (groups, n) or group % GROUP_MULTIPLE
            or not (q.is_contiguous() and scale.is_contiguous()) or x.device.type != "cpu"):
        raise ValueError(f"int8_matmul: x {tuple(x.shape)} {x.dtype}, q {tuple(q.shape)} {q.dtype}, "
                         f"scale {tuple(scale.shape)} {scale.dtype}: not a layout the kernel takes")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    lib.kvchat_int8_matmul(x.data_ptr(), q.data_ptr(), scale.data_ptr(), y.data_ptr(), x.shape[0], n, groups, group,
                           torch.get_num_threads())
    return y
