"""The compiled CPU int4 matmul (``cpu_int4.c``): 4-bit weights in asymmetric groups of 32 with an fp16 scale and
minimum each (GGUF's Q4_1 block), float32 activations.

Why: a decode step reads every weight once, and on a CPU it is bound by those bytes. int8 groups of 32 with
fp32 scale and offset read 1.25 bytes per parameter; these read 0.625 (16 bytes of nibbles and 4 of fp16 scale
and minimum per 32), in the same arithmetic as :mod:`kvchat.kernels.cpu_int8` (an fp32 FMA chain per group;
the C source says why the rows' bits do not depend on the row count or the threads). The quantizer is
:func:`kvchat.model.quant.quantize_int4_groups`; the layer :class:`kvchat.model.quant.Int4GroupLinear`.

Built and loaded by :mod:`kvchat.kernels.cpu_build` (once per machine; its threads are torch's pool). Where it
cannot be, or ``KVCHAT_CPU_KERNEL=0``, :func:`available` is False and ``--weights int4`` is refused (there is no
torch kernel for this layout).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .cpu_build import load as load_library
from .cpu_int8 import GROUP

SOURCE = Path(__file__).with_name("cpu_int4.c")


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load_library(SOURCE)
    if lib is not None:
        fn = lib.kvchat_int4_matmul
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        lib.kvchat_int4_max_groups.restype = ctypes.c_int64
        lib.kvchat_int4_max_groups.argtypes = []
    return lib


def available() -> bool:
    """Whether the compiled kernel is usable in this process (built or found on first call; see the module doc)."""
    return _library() is not None


@functools.cache
def max_inputs() -> int:
    """The widest input row the kernel takes (its per-channel scales live on the stack: ``cpu_int4.c``'s
    ``MAX_GROUPS`` groups of 32). Raises RuntimeError: not :func:`available`."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the compiled CPU int4 kernel is not available")
    return int(lib.kvchat_int4_max_groups()) * GROUP


def takes(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> bool:
    """Whether a weight is in the layout the kernel takes: ``packed`` uint8 ``[N, K / 2]``, ``scale`` and
    ``minimum`` float16 ``[N, K / 32]``, all contiguous CPU tensors, ``K`` at most :func:`max_inputs`."""
    n, half = packed.shape if packed.dim() == 2 else (0, 1)
    groups = 2 * half // GROUP
    return (packed.dim() == 2 and packed.dtype == torch.uint8 and (2 * half) % GROUP == 0 and 0 < 2 * half <= max_inputs()
            and all(t.dtype == torch.float16 and tuple(t.shape) == (n, groups) for t in (scale, minimum))
            and all(t.is_contiguous() and t.device.type == "cpu" for t in (packed, scale, minimum)))


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """``y = x W^T`` with ``W[n, 32 g + k] = scale[n, g] * q[n, 32 g + k] + minimum[n, g]``, ``q`` the 4-bit
    values of ``packed`` (``cpu_int4.c`` gives the nibble order), fp32 arithmetic.

    Args:
        x: float32 ``[M, K]`` on the CPU (any strides), ``K = 32 G``.
        packed: uint8 ``[N, K / 2]``; scale, minimum: float16 ``[N, G]``; all contiguous (:func:`takes`).
    Returns:
        float32 ``[M, N]``. A row's bits do not depend on ``M`` nor on the thread count.
    Raises:
        RuntimeError: the kernel is not :func:`available`.
        ValueError: shapes, dtypes or layout the kernel does not take.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the compiled CPU int4 kernel is not available")
    if not (takes(packed, scale, minimum) and x.dtype == torch.float32 and x.dim() == 2
            and x.shape[1] == 2 * packed.shape[1] and x.device.type == "cpu"):
        raise ValueError(f"int4_matmul: x {tuple(x.shape)} {x.dtype}, packed {tuple(packed.shape)} {packed.dtype}, "
                         f"scale {tuple(scale.shape)} {scale.dtype}, minimum {tuple(minimum.shape)} {minimum.dtype}: "
                         "not a layout the kernel takes")
    n, groups = scale.shape
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    xsum = torch.empty(x.shape[0], groups, dtype=torch.float32)
    lib.kvchat_int4_matmul(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), minimum.data_ptr(), xsum.data_ptr(),
                           y.data_ptr(), x.shape[0], n, groups, torch.get_num_threads())
    return y


def pack(q: torch.Tensor) -> torch.Tensor:
    """4-bit values ``q`` (uint8 ``[N, K]``, each 0..15, ``K`` a multiple of 32) -> uint8 ``[N, K / 2]`` in the
    kernel's order: byte ``j`` of group ``g`` holds input ``32 g + j`` (low nibble) and ``32 g + 16 + j`` (high).

    Raises:
        ValueError: ``K`` is not a multiple of 32.
    """
    n, k = q.shape
    if k % GROUP:
        raise ValueError(f"{k} inputs do not split into groups of {GROUP}")
    g = q.view(n, k // GROUP, 2, GROUP // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """:func:`pack`'s inverse: uint8 ``[N, K / 2]`` -> the 4-bit values uint8 ``[N, K]``."""
    n, half = packed.shape
    g = packed.view(n, half // (GROUP // 2), 1, GROUP // 2)
    return torch.cat((g & 0x0F, g >> 4), dim=2).view(n, 2 * half)
