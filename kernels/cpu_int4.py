"""The compiled CPU int4 matmul (``cpu_int4.c``): 4-bit weights in asymmetric groups of 32 with an fp16 scale and
minimum each (GGUF's Q4_1 block) times activations quantized to int8 per group of 32 (llama.cpp's Q8_1 block), on
integer dot products (AVX-512 VNNI ``vpdpbusd`` where the CPU has it, else ``vpmaddubsw`` + ``vpmaddwd``).

Why: a decode step reads every weight once, and on a CPU it is bound by those bytes. int8 groups of 32 with
fp32 scale and offset read 1.25 bytes per parameter; these read 0.625 (16 bytes of nibbles and 4 of fp16 scale
and minimum per 32). With float activations each nibble had to be widened to a float and multiplied on its own
FMA lane, which left a one-row matmul partly compute bound; on integer dot products a group of 32 is one
``vpdpbusd`` (or two instructions on AVX2) and one float FMA. Two kernels: the group kernel (decode rows, inputs
in the lanes) and the channel-lanes kernel (a prefill chunk's rows, ``lanes=True``: 16 output channels in the
lanes, each group's nibbles transposed once per call, the float work per group and 16 channels; 2x the group
kernel from ~6 rows). The C source gives the formula of each and why a row's bits
depend neither on the row count, nor the threads, nor the build (``avx2``, ``avx512``, ``avx512vnni``:
:func:`kvchat.kernels.cpu_build.integer_variant`). The quantizer is
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

from .cpu_build import integer_variant
from .cpu_build import load as load_library
from .cpu_int8 import GROUP
from .cpu_int8_int8 import reference as int8_int8_reference

SOURCE = Path(__file__).with_name("cpu_int4.c")


@functools.cache
def _library(variant: str | None = None) -> ctypes.CDLL | None:
    lib = load_library(SOURCE, variant=variant or integer_variant())
    if lib is not None:
        lib.kvchat_int4_matmul.restype = lib.kvchat_int4_matmul_lanes.restype = None
        lib.kvchat_int4_matmul.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        lib.kvchat_int4_matmul_lanes.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        lib.kvchat_int4_lanes_work_bytes.restype = ctypes.c_int64
        lib.kvchat_int4_lanes_work_bytes.argtypes = [ctypes.c_int64, ctypes.c_int]
        lib.kvchat_int4_max_groups.restype = ctypes.c_int64
        lib.kvchat_int4_max_groups.argtypes = []
        lib.kvchat_int4_lane_min_tokens.restype = ctypes.c_int64
        lib.kvchat_int4_lane_min_tokens.argtypes = []
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


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                variant: str | None = None, lanes: bool = False) -> torch.Tensor:
    """``y = quantize(x) W^T`` with ``W[n, 32 g + k] = scale[n, g] * q[n, 32 g + k] + minimum[n, g]``, ``q`` the
    4-bit values of ``packed`` (``cpu_int4.c`` gives the nibble order), each 32 inputs of a row of ``x`` quantized
    to int8 (symmetric, ``max|x| / 127``; the minima's term takes the quantized values' sum): the C source gives
    the exact formula and order (:func:`reference` in float64).

    Args:
        x: float32 ``[M, K]`` on the CPU (any strides), ``K = 32 G``.
        packed: uint8 ``[N, K / 2]``; scale, minimum: float16 ``[N, G]``; all contiguous (:func:`takes`).
        variant: a :data:`kvchat.kernels.cpu_build.VARIANTS` build (None: this process's); the bits are equal.
        lanes: the channel-lanes kernel of a prefill chunk's rows: the same product in another float order, so
            other bits (``cpu_int4.c``).
    Returns:
        float32 ``[M, N]``. A row's bits depend neither on ``M``, nor on the thread count, nor on the build.
    Raises:
        RuntimeError: the kernel is not :func:`available`.
        ValueError: shapes, dtypes or layout the kernel does not take.
    """
    lib = _library(variant)
    if lib is None:
        raise RuntimeError("the compiled CPU int4 kernel is not available")
    if not (takes(packed, scale, minimum) and x.dtype == torch.float32 and x.dim() == 2
            and x.shape[1] == 2 * packed.shape[1] and x.device.type == "cpu"):
        raise ValueError(f"int4_matmul: x {tuple(x.shape)} {x.dtype}, packed {tuple(packed.shape)} {packed.dtype}, "
                         f"scale {tuple(scale.shape)} {scale.dtype}, minimum {tuple(minimum.shape)} {minimum.dtype}: "
                         "not a layout the kernel takes")
    n, groups = scale.shape
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    xq = torch.empty(m, x.shape[1], dtype=torch.int8)
    xd, xs = torch.empty(m, groups, dtype=torch.float32), torch.empty(m, groups, dtype=torch.float32)
    threads = torch.get_num_threads()
    args = (x.data_ptr(), packed.data_ptr(), scale.data_ptr(), minimum.data_ptr(), xq.data_ptr(), xd.data_ptr(),
            xs.data_ptr(), y.data_ptr())
    if lanes:
        work = torch.empty(lib.kvchat_int4_lanes_work_bytes(groups, threads), dtype=torch.uint8)
        lib.kvchat_int4_matmul_lanes(*args, work.data_ptr(), m, n, groups, threads)
    else:
        lib.kvchat_int4_matmul(*args, m, n, groups, threads)
    return y


def reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The kernel's formula in float64 torch (tests): the int8 x int8 kernel's reference
    (:func:`kvchat.kernels.cpu_int8_int8.reference`) on the unpacked nibbles with Q8_1's block sums, so it differs
    from the kernel only by float32 rounding. Shapes as :func:`int4_matmul`'s."""
    return int8_int8_reference(x, unpack(packed), scale, minimum, block_sums=True)


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
