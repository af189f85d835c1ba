"""The compiled CPU integer prefill matmul (``cpu_int8_int8.c``): int8 weights in asymmetric groups of 32 (the
layout of :mod:`kvchat.kernels.cpu_int8`) times activations quantized to int8 per group of 32, on integer dot
products (AVX-512 VNNI ``vpdpbusd`` where the CPU has it, else ``vpmaddubsw`` + ``vpmaddwd``).

Why: prefill is compute bound, and a float FMA does 16 multiply-adds per 512-bit instruction where
``vpdpbusd`` does 64 (llama.cpp multiplies int8-quantized activations by its quantized weights the same way).
The activations' rounding changes the numbers (the C source's formula), so an engine runs it only where its
:class:`kvchat.engine.runner.ExecutionPlan` says so, for prefill chunks alone (the K/V of a cold and a resumed
run come from the same chunks either way), and it enters the cache fingerprint
(:func:`kvchat.model.int8_scheme.int8_compute_scheme`'s ``prefill``). int4 weights' prefill chunks always run it,
on their nibbles unpacked to one byte each, with Q8_1's block sums (:class:`kvchat.model.quant.Int4GroupLinear`).

Every build (``avx2``, ``avx512``, ``avx512vnni``: :func:`kvchat.kernels.cpu_build.integer_variant`) computes
the same bits, and a row's bits depend on neither the number of rows nor the thread count.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .cpu_build import integer_variant
from .cpu_build import load as load_library
from .cpu_int8 import GROUP

SOURCE = Path(__file__).with_name("cpu_int8_int8.c")
LANES = 16  # output channels per block in the C source: out_features must be a multiple


@functools.cache
def _library(variant: str | None = None) -> ctypes.CDLL | None:
    lib = load_library(SOURCE, variant=variant or integer_variant())
    if lib is not None:
        fn = lib.kvchat_int8_int8_matmul
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        lib.kvchat_int8_int8_work_bytes.restype = ctypes.c_int64
        lib.kvchat_int8_int8_work_bytes.argtypes = [ctypes.c_int64]
    return lib


def available() -> bool:
    """Whether the compiled kernel is usable in this process (built or found on first call)."""
    return _library() is not None


def takes(out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape fits the kernel (``out_features`` a multiple of 16, ``in_features`` of 32)."""
    return out_features % LANES == 0 and in_features % GROUP == 0


def int8_int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                     variant: str | None = None) -> torch.Tensor:
    """``y = quantize(x) W^T`` with ``W[n, 32 g + k] = scale[n, g] * q[n, 32 g + k] + offset[n, g]`` and each
    32 inputs of a row of ``x`` quantized to int8 (symmetric, ``max|x| / 127``); the offsets' term uses the
    float sums of ``x``. The C source gives the exact formula and order.

    Args:
        x: float32 ``[M, K]`` on the CPU (any strides), ``K = 32 G``.
        q: int8 ``[N, K]``, contiguous, ``N`` a multiple of 16.
        scale, offset: float32 ``[N, G]``, contiguous.
        variant: a :data:`kvchat.kernels.cpu_build.VARIANTS` build (None: this process's); the bits are equal.
    Returns:
        float32 ``[M, N]``.
    Raises:
        RuntimeError: the kernel is not :func:`available`.
        ValueError: shapes, dtypes or layout the kernel does not take.
    """
    lib = _library(variant)
    if lib is None:
        raise RuntimeError("the compiled CPU integer prefill kernel is not available")
    n, k = q.shape
    groups = k // GROUP
    if (x.dtype != torch.float32 or q.dtype != torch.int8 or scale.dtype != torch.float32
            or offset.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or not takes(n, k)
            or tuple(scale.shape) != (n, groups) or tuple(offset.shape) != (n, groups)
            or not (q.is_contiguous() and scale.is_contiguous() and offset.is_contiguous()) or x.device.type != "cpu"):
        raise ValueError(f"int8_int8_matmul: x {tuple(x.shape)} {x.dtype}, q {tuple(q.shape)} {q.dtype}, "
                         f"scale {tuple(scale.shape)}, offset {tuple(offset.shape)}: not a layout the kernel takes")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    xq = torch.empty(m, k, dtype=torch.int8)
    xd = torch.empty(m, groups, dtype=torch.float32)
    xsum = torch.empty(m, groups, dtype=torch.float32)
    threads = torch.get_num_threads()
    # the threads' block buffers, from a 64-byte boundary (the C source's aligned loads)
    work = torch.empty(threads * lib.kvchat_int8_int8_work_bytes(groups) + 63, dtype=torch.uint8)
    lib.kvchat_int8_int8_matmul(x.data_ptr(), q.data_ptr(), scale.data_ptr(), offset.data_ptr(), xq.data_ptr(),
                                xd.data_ptr(), xsum.data_ptr(), y.data_ptr(), -(-work.data_ptr() // 64) * 64, m, n,
                                groups, threads)
    return y


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[M, K]`` -> ``(a float32 [M, K] of integers in [-127, 127], d float32 [M, K / 32])``: each 32
    inputs quantized as the C kernels do (``cpu_kernels.h``'s ``quantize32``), in torch (tests' references)."""
    m = x.shape[0]
    xf = x.float().view(m, -1, GROUP)
    amax = xf.abs().amax(dim=2)
    zero = ~(amax >= 127 * torch.finfo(torch.float32).tiny)  # as the C source: 127 / amax would overflow
    d = torch.where(zero, torch.zeros_like(amax), amax / 127)
    inv = torch.where(zero, torch.zeros_like(amax), 127 / amax)
    a = torch.round(xf * inv[..., None]).clamp(-127, 127)  # round half to even, as _mm256_cvtps_epi32
    return a.view(m, -1), d


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
              block_sums: bool = False) -> torch.Tensor:
    """The kernel's formula in float64 torch (tests): activations quantized as the C source does, the integer
    dot products exact, the epilogue in float64 (so it differs from the kernel only by float32 rounding)."""
    m, k = x.shape
    n = q.shape[0]
    a, d = quantize_activations(x)
    dots = torch.einsum("mgk,ngk->mng", a.double().view(m, -1, GROUP), q.double().view(n, -1, GROUP))
    sums = (d.double() * a.double().view(m, -1, GROUP).sum(dim=2) if block_sums
            else x.double().view(m, -1, GROUP).sum(dim=2))
    return (torch.einsum("mng,ng,mg->mn", dots, scale.double(), d.double())
            + torch.einsum("ng,mg->mn", offset.double(), sums)).float()
