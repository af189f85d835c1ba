"""Attention and cache-write dispatch for the paged KV cache.

Every call site in kvchat goes through :func:`write_kv`,
:func:`decode_attention` and :func:`extend_attention` here. The pure-torch
reference (``reference.py``) is the CPU backend and the test oracle; Triton
kernels with the same signatures (``triton_write.py``, ``triton_decode.py``,
``triton_extend.py``) serve CUDA tensors. Triton is imported only when a
Triton kernel is about to run, so this package imports where Triton is absent.

:func:`read_slots` and :func:`dense_attention` (CPU only) serve the CPU
read path, ``kvchat.engine.dense_kv``: a sequence's K/V read back from the pool
once into a contiguous fp32 copy, which prefill chunks and extends attend over
without gathering and dequantizing the whole cache again. Decode steps and
cache writes on a CPU pool run the compiled kernels of
:mod:`kvchat.kernels.cpu_attention` where they are built (backend
``compiled``): decode reads the paged pool itself (a quarter of the copy's
bytes for fp8, half for 16-bit pools). With int8 group weights a decode step's
whole layers run compiled instead (:mod:`kvchat.kernels.cpu_decode`, over the same kernels;
picked by :mod:`kvchat.model.compiled_decode`).

Backend choice per call:

- ``KVCHAT_ATTENTION=torch``: always the reference.
- ``KVCHAT_ATTENTION=triton``: always Triton; CPU tensors then run under the
  Triton interpreter, which needs ``TRITON_INTERPRET=1`` in the environment
  before Triton is first imported (Triton reads it when ``@triton.jit``
  decorates its own library functions and kvchat's kernels). Where Triton
  cannot run (not installed, or CPU tensors without the interpreter) the
  first dispatch raises :class:`kvchat.settings.SettingError`.
- unset: Triton for CUDA tensors; on CPU tensors ``compiled`` where
  :func:`kvchat.kernels.cpu_attention.available` (``KVCHAT_CPU_KERNEL``, a C
  compiler): its kernels for :func:`write_kv` and a decode step's
  :func:`decode_attention` where they take the arguments, the reference for
  the rest; the reference otherwise. CUDA without an
  importable Triton, or where Triton cannot build its host launcher (no C
  compiler or Python headers: :mod:`kvchat.kernels.triton_build`, checked
  once, or a build that failed in the engine's warm-up,
  :func:`disable_triton`), falls back to the reference with a one-time
  logged notice. FP8 pools stay on Triton on every CUDA GPU: below compute
  capability 8.9 (where Triton has no float8e4nv) the kernels convert the fp8
  bytes with integer bit operations (``triton_decode.fp8_bits_default``).

An engine decides once, when it loads, which kernels its model runs (:func:`kernel_choice`, a
:class:`KernelChoice` passed as ``backend`` to the functions here): then no call reads a setting or
queries the device. Without ``backend`` a call decides for itself as above (direct callers, tests).
On the Triton backend decode steps also run :mod:`kvchat.kernels.triton_fused` (the residual add and
RMSNorm, RoPE with the K shift and the cache write, SiLU·mul: one launch each).

Both backends read an exact attention sink (position 0's fp32 K/V per
sequence) when the caller passes one, so an engine's scale scheme does not
depend on the backend.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from dataclasses import dataclass
from types import ModuleType

import torch

from kvchat import settings
from kvchat.settings import SettingError

from . import cpu_attention, reference, triton_build
from .layout import KVLayer, Sink
from .reference import (
    FP8_DTYPE,
    FP8_EPS,
    FP8_MAX,
    SCALE_SCHEME,
    dense_attention,
    dequantize_fp8,
    dequantize_into,
    quantize_fp8,
    read_slots,
)

__all__ = [
    "FP8_DTYPE",
    "FP8_EPS",
    "FP8_MAX",
    "SCALE_SCHEME",
    "KVLayer",
    "KernelChoice",
    "Sink",
    "backend_for",
    "decode_attention",
    "dense_attention",
    "dequantize_fp8",
    "dequantize_into",
    "extend_attention",
    "kernel_choice",
    "quantize_fp8",
    "read_slots",
    "write_kv",
]

ENV_VAR = settings.ATTENTION
_log = logging.getLogger(__name__)
_noticed: set[str] = set()


def _notice_once(message: str) -> None:
    if message not in _noticed:
        _noticed.add(message)
        _log.warning(message)


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _launcher_problem() -> str | None:
    return triton_build.launcher_problem()


_build_failed: list[str] = []  # why Triton's launcher failed to build in this process, once it did


def triton_unusable() -> str | None:
    """Why Triton cannot launch on a GPU in this process (one line), or None: its launcher cannot be built
    here (:func:`kvchat.kernels.triton_build.launcher_problem`, checked once) or failed to (:func:`disable_triton`)."""
    return _build_failed[0] if _build_failed else _launcher_problem()


def disable_triton(reason: str) -> None:
    """Send CUDA tensors to the reference kernels from now on: Triton failed to build its launcher (``reason``,
    one line), e.g. in the engine's kernel warm-up. The notice is logged by the next dispatch."""
    if not _build_failed:
        _build_failed.append(reason)


def _cuda_backend() -> str:
    """The backend of CUDA tensors when ``KVCHAT_ATTENTION`` is unset: Triton, or the reference with a
    one-time notice where Triton is not installed or cannot build its launcher."""
    if not _triton_importable():
        _notice_once("kvchat: Triton is not installed; attention runs on the PyTorch reference path")
        return "torch"
    problem = triton_unusable()
    if problem is not None:
        _notice_once(f"kvchat: Triton cannot build its kernel launcher: {problem} ({triton_build.FIX}); "
                     "attention runs on the PyTorch reference path")
        return "torch"
    return "triton"


def backend_for(cache: torch.Tensor) -> str:
    """``"triton"``, ``"compiled"`` or ``"torch"`` for a call on this pool (see module doc).

    Raises:
        SettingError: ``KVCHAT_ATTENTION`` is neither unset, ``torch`` nor ``triton``, or it is
            ``triton`` and Triton cannot run on ``cache`` (see :func:`_triton_module`).
    """
    choice = settings.attention()
    if choice == "triton":
        _triton_module("triton_write", cache)  # fail on the first dispatch, not in the middle of a forward
    if choice:
        return choice
    if not cache.is_cuda:
        return "compiled" if cpu_attention.available() else "torch"
    return _cuda_backend()


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The kernels a model runs on one pool, decided once (:func:`kernel_choice`) when an engine loads.

    Attributes:
        backend: ``"triton"``, ``"compiled"`` or ``"torch"`` (:func:`backend_for`).
        fused: :mod:`kvchat.kernels.triton_fused` where decode steps run it (the Triton backend), else None.
    """

    backend: str
    fused: ModuleType | None = None


def kernel_choice(cache: torch.Tensor) -> KernelChoice:
    """:func:`backend_for` ``cache``, with the Triton kernels imported (and checked) now when it is Triton.

    Raises:
        SettingError: see :func:`backend_for`.
    """
    backend = backend_for(cache)
    if backend != "triton":
        return KernelChoice(backend)
    for name in ("triton_write", "triton_decode", "triton_extend"):
        _triton_module(name, cache)
    return KernelChoice(backend, _triton_module("triton_fused", cache))


@functools.cache
def _import_kernels(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.{name}")


def _triton_module(name: str, cache: torch.Tensor) -> ModuleType:
    """Import ``kvchat.kernels.<name>``; CPU tensors need it built for the interpreter.

    Raises:
        SettingError: Triton is not installed, or CPU tensors meet compiled kernels.
    """
    if not _triton_importable():
        raise SettingError(f"{ENV_VAR} is 'triton' but Triton is not installed; use torch or unset it")
    problem = triton_unusable() if cache.is_cuda else None
    if problem is not None:
        raise SettingError(f"{ENV_VAR} is 'triton' but Triton cannot build its kernel launcher: {problem} "
                           f"({triton_build.FIX}); use torch or unset it")
    module = _import_kernels(name)
    if not cache.is_cuda and not module.INTERPRETED:
        raise SettingError(f"{ENV_VAR} is 'triton' but Triton cannot run on the CPU without TRITON_INTERPRET=1"
                           " set before Triton is first imported; use torch, a CUDA device, or unset it")
    return module


def _triton(name: str, cache: torch.Tensor, backend: str | None) -> ModuleType:
    """``kvchat.kernels.<name>``: checked now (:func:`_triton_module`) unless ``backend`` was decided at load,
    where :func:`kernel_choice` checked it."""
    return _import_kernels(name) if backend else _triton_module(name, cache)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv: KVLayer, slot_mapping: torch.Tensor,
             backend: str | None = None) -> None:
    """:func:`reference.write_kv` on the backend of ``kv`` (see the module doc).

    ``backend``: :attr:`KernelChoice.backend` decided at load (None: :func:`backend_for` now).

    Raises:
        SettingError: see :func:`backend_for` and the module doc.
    """
    choice = backend or backend_for(kv.k_cache)
    if choice == "triton":
        fn = _triton("triton_write", kv.k_cache, backend).write_kv
    elif choice == "compiled" and cpu_attention.takes_write(key, value, kv, slot_mapping):
        fn = cpu_attention.write_kv
    else:
        fn = reference.write_kv
    fn(key, value, kv, slot_mapping)


def decode_attention(query: torch.Tensor, kv: KVLayer, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     sm_scale: float, sink: Sink | None = None, provisional: bool = False,
                     backend: str | None = None) -> torch.Tensor:
    """:func:`reference.decode_attention` on the backend of ``kv``.

    ``provisional``: a decode step's tokens, whose K/V prefill recomputes later; only then may a CPU pool take
    the compiled kernel here (another rounding than the reference's), never for a one-token prefill chunk on
    the torch layers, whose K/V are stored (the compiled decoder layers run such chunks themselves, every one
    of them: :meth:`kvchat.engine.runner.Engine.runs_compiled`).

    ``backend``: as :func:`write_kv`'s.

    Raises:
        SettingError: see :func:`backend_for` and the module doc.
    """
    choice = backend or backend_for(kv.k_cache)
    if choice == "triton":
        fn = _triton("triton_decode", kv.k_cache, backend).decode_attention
    elif provisional and choice == "compiled" and cpu_attention.takes_decode(query, kv, block_table, seq_lens, sink):
        fn = cpu_attention.decode_attention
    else:
        fn = reference.decode_attention
    return fn(query, kv, block_table, seq_lens, sm_scale, sink)


def extend_attention(query: torch.Tensor, kv: KVLayer, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, sm_scale: float, sink: Sink | None = None,
                     backend: str | None = None) -> torch.Tensor:
    """:func:`reference.extend_attention` on the backend of ``kv``.

    ``backend``: as :func:`write_kv`'s.

    Raises:
        SettingError: see :func:`backend_for` and the module doc.
    """
    if (backend or backend_for(kv.k_cache)) == "triton":
        fn = _triton("triton_extend", kv.k_cache, backend).extend_attention
    else:
        fn = reference.extend_attention
    return fn(query, kv, block_table, seq_lens, cu_seqlens_q, sm_scale, sink)
