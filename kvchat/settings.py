"""Every ``KVCHAT_*`` environment variable kvchat reads: one accessor each, with its default and its check.

- ``KVCHAT_HOME``: the data dir (conversations, SQLite index, KV snapshots).
- ``KVCHAT_MODELS``: the dir of imported models.
- ``KVCHAT_DEVICE``: ``cpu``, ``cuda`` or ``cuda:N``.
- ``KVCHAT_ATTENTION``: ``torch`` or ``triton`` attention kernels.
- ``KVCHAT_KV_BUDGET_MB``: the KV pool's size, MiB.
- ``KVCHAT_DTYPE``: the compute dtype of the weights and activations.
- ``KVCHAT_RESIDENT_CHATS``: how many chats of full context the default KV pool is sized for.
- ``KVCHAT_GPU_MEMORY``: the share of the GPU's memory this process may hold.
- ``KVCHAT_CACHE_BUDGET_GB``: the disk budget of the KV snapshots, GB.
- ``KVCHAT_WEIGHTS``: the weight format the model computes with.
- ``KVCHAT_CUDA_GRAPHS``: ``0`` turns off the CUDA graphs of decode.
- ``KVCHAT_CPU_KERNEL``: ``0`` turns off the compiled CPU kernels (int8 matmul, decode attention); ``avx2``
  keeps their AVX2 build where the CPU has AVX-512.
- ``KVCHAT_INT8_PREFILL``: ``int8`` or ``float`` activations in int8 weights' prefill chunks on the CPU.
- ``KVCHAT_PHASE_TRACE``: a file ``kvchat ask`` appends its phases to (fault tests).
- ``KVCHAT_CRASH_AT``: a crash point for fault tests, read by :mod:`kvchat.store.faults`.
- ``KVCHAT_API_KEY``: the key ``kvchat serve`` requires when ``--api-key`` is not given.
- ``KVCHAT_SERVER``: the OpenAI-compatible server the TUI and ``kvchat ask`` use when ``--server`` is not given.
- ``KVCHAT_SERVER_TIMEOUT_S``: the longest silence accepted from that server inside an answer, seconds.

An empty value means unset. A value kvchat cannot use raises
:class:`SettingError` where it is read, with a one-line message naming the
variable, the value and what is accepted; :func:`check` reads every variable
whose check needs no torch, so the CLI refuses a bad one before it does any
work. The paths (``KVCHAT_HOME``, ``KVCHAT_MODELS``, ``KVCHAT_PHASE_TRACE``)
take any value; :mod:`kvchat.paths` refuses a data or models dir that is a
file. ``KVCHAT_CRASH_AT`` stays in the store (which imports nothing from
kvchat outside it) and is not checked: an unknown name just never crashes.
Torch-free and platformdirs-free at import (``bench/gpu.py`` imports the
engine on machines without platformdirs; only the default dirs need it).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

APP_NAME = "kvchat"
HOME = "KVCHAT_HOME"
MODELS = "KVCHAT_MODELS"
DEVICE = "KVCHAT_DEVICE"
ATTENTION = "KVCHAT_ATTENTION"
KV_BUDGET_MB = "KVCHAT_KV_BUDGET_MB"
CACHE_BUDGET_GB = "KVCHAT_CACHE_BUDGET_GB"
PHASE_TRACE = "KVCHAT_PHASE_TRACE"
DTYPE = "KVCHAT_DTYPE"
RESIDENT_CHATS = "KVCHAT_RESIDENT_CHATS"
GPU_MEMORY = "KVCHAT_GPU_MEMORY"
API_KEY = "KVCHAT_API_KEY"
SERVER = "KVCHAT_SERVER"
SERVER_TIMEOUT_S = "KVCHAT_SERVER_TIMEOUT_S"
DEFAULT_SERVER_TIMEOUT_S = 300.0  # a long prompt's prefill on a busy server comes before its first byte
DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")
DEFAULT_RESIDENT_CHATS = 4
WEIGHTS = "KVCHAT_WEIGHTS"
WEIGHTS_CHOICES = ("auto", "fp32", "bf16", "int8", "int4")  # auto: resolved by kvchat.engine.cache_identity.resolve_weight_format
ATTENTION_CHOICES = ("torch", "triton")
CUDA_GRAPHS = "KVCHAT_CUDA_GRAPHS"
CUDA_GRAPHS_CHOICES = ("1", "0")
CPU_KERNEL = "KVCHAT_CPU_KERNEL"
CPU_KERNEL_CHOICES = ("1", "0", "avx2")
INT8_PREFILL = "KVCHAT_INT8_PREFILL"
INT8_PREFILL_CHOICES = ("auto", "int8", "float")
_DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?")


class SettingError(ValueError):
    """An environment variable holds a value kvchat cannot use; the message is one line naming
    the variable, the value and the accepted values."""


def _raw(name: str) -> str | None:
    """The variable's value stripped of surrounding whitespace; None when unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None


def _positive(name: str, unit: str) -> float | None:
    """The variable as a positive finite number; None when unset.

    Raises:
        SettingError: not a number, not finite, or <= 0.
    """
    value = _raw(name)
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0 < number < math.inf:  # also rejects nan
        raise SettingError(f"{name} must be a positive number of {unit}, got {os.environ[name]!r}")
    return number


def home() -> Path:
    """``KVCHAT_HOME``: the data dir (conversations, SQLite index, KV snapshots); ``~`` is expanded.

    Default: platformdirs' user data dir for "kvchat" (``~/.local/share/kvchat`` on Linux).
    """
    value = _raw(HOME)
    if value:
        return Path(value).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir(APP_NAME))


def models() -> Path:
    """``KVCHAT_MODELS``: the dir of imported models, independent of :func:`home`; ``~`` is expanded.

    Default: platformdirs' user cache dir for "kvchat" + ``/models`` (``~/.cache/kvchat/models`` on Linux).
    """
    value = _raw(MODELS)
    if value:
        return Path(value).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir(APP_NAME)) / "models"


def _device_spec() -> str | None:
    """``KVCHAT_DEVICE`` lower-cased if it is ``cpu``, ``cuda`` or ``cuda:N``; None when unset.

    Raises:
        SettingError: any other value.
    """
    value = _raw(DEVICE)
    if value is None:
        return None
    if not _DEVICE_RE.fullmatch(value.lower()):
        raise SettingError(f"{DEVICE} must be cpu, cuda or cuda:N, got {os.environ[DEVICE]!r}")
    return value.lower()


def device() -> "torch.device":
    """``KVCHAT_DEVICE``: where the model runs, ``cpu``, ``cuda`` or ``cuda:N`` (N from 0).

    Default: ``cuda`` if torch sees a CUDA device, else ``cpu``. Imports torch.

    Raises:
        SettingError: another value; ``cuda`` where this torch has no CUDA or sees
            no device; ``cuda:N`` beyond the devices torch sees.
    """
    import torch

    spec = _device_spec()
    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if torch.version.cuda is None:
            raise SettingError(f"{DEVICE} is {spec!r} but this torch ({torch.__version__}) is built without CUDA;"
                               " use cpu or unset it")
        count = torch.cuda.device_count()
        if count == 0:
            raise SettingError(f"{DEVICE} is {spec!r} but torch sees no CUDA device; use cpu or unset it")
        if (dev.index or 0) >= count:
            raise SettingError(f"{DEVICE} is {spec!r} but torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return dev


def attention() -> str | None:
    """``KVCHAT_ATTENTION``: ``torch`` (the PyTorch reference kernels) or ``triton`` (the Triton kernels;
    on CPU tensors only under ``TRITON_INTERPRET=1``), case-insensitive.

    Default (None): Triton for CUDA tensors; for CPU tensors the compiled kernels of
    :mod:`kvchat.kernels.cpu_attention` for decode steps and cache writes where they build
    (:func:`cpu_kernel_enabled`), PyTorch for the rest; ``torch`` runs PyTorch for everything.
    Whether ``triton`` can run here is checked by :func:`kvchat.kernels.dispatch.backend_for`.

    Raises:
        SettingError: any other value.
    """
    value = _raw(ATTENTION)
    if value is None:
        return None
    if value.lower() not in ATTENTION_CHOICES:
        raise SettingError(f"{ATTENTION} must be torch or triton (or unset: chosen by device), "
                           f"got {os.environ[ATTENTION]!r}")
    return value.lower()


def kv_budget_mb() -> float | None:
    """``KVCHAT_KV_BUDGET_MB``: the KV pool's size in MiB (2**20 bytes), a positive number.

    Default (None): :func:`kvchat.engine.pool_size.plan_pool`: on CUDA ``KVCHAT_RESIDENT_CHATS``
    chats of full context, capped by the memory left after weights and activations; 512 MiB on CPU.

    Raises:
        SettingError: not a positive finite number.
    """
    return _positive(KV_BUDGET_MB, "MiB")


def cache_budget_gb() -> float | None:
    """``KVCHAT_CACHE_BUDGET_GB``: how much disk the KV snapshots may use, in GB (10**9 bytes), a positive number.

    Default (None): :func:`kvchat.engine.disk_budget.budget_bytes` takes 20% of (the free disk
    plus what the snapshots already use), at most 50 GB, leaving the disk's free floor free.

    Raises:
        SettingError: not a positive finite number (0 would evict every unpinned chunk).
    """
    return _positive(CACHE_BUDGET_GB, "GB")


def _choice(name: str, choices: tuple[str, ...]) -> str:
    """The variable ``name`` lower-cased, one of ``choices`` (unset: the first, ``auto``).

    Raises:
        SettingError: any other value.
    """
    value = _raw(name)
    if value is None:
        return choices[0]
    if value.lower() not in choices:
        raise SettingError(f"{name} must be one of {', '.join(choices)}, got {os.environ[name]!r}")
    return value.lower()


def compute_dtype() -> str:
    """``KVCHAT_DTYPE``: the dtype weights and activations are computed in, ``auto``, ``bf16``, ``fp16`` or
    ``fp32`` (case-insensitive); ``kvchat --dtype`` sets it for the command it runs.

    Default ``auto``: :func:`kvchat.engine.runner.compute_dtype` (bf16 on CUDA; on CPU fp32 for models
    up to 2B parameters, bf16 above).

    Raises:
        SettingError: any other value.
    """
    return _choice(DTYPE, DTYPE_CHOICES)


def resident_chats() -> int:
    """``KVCHAT_RESIDENT_CHATS``: how many chats of the model's full context the default KV pool holds at
    once, a whole number >= 1 (:func:`kvchat.engine.pool_size.plan_pool` caps it by memory).

    Default: :data:`DEFAULT_RESIDENT_CHATS`.

    Raises:
        SettingError: not a whole number >= 1.
    """
    value = _raw(RESIDENT_CHATS)
    if value is None:
        return DEFAULT_RESIDENT_CHATS
    if not value.isdigit() or int(value) < 1:
        raise SettingError(f"{RESIDENT_CHATS} must be a whole number of chats >= 1, got {os.environ[RESIDENT_CHATS]!r}")
    return int(value)


def fraction_value(name: str, value: str) -> float:
    """``value`` as a fraction in (0, 1]; ``name`` (the variable or the CLI flag) is what an error names.

    Raises:
        SettingError: not a number in (0, 1].
    """
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0 < number <= 1:  # also rejects nan
        raise SettingError(f"{name} must be a fraction of the GPU's memory, above 0 and at most 1, got {value!r}")
    return number


def gpu_memory() -> float | None:
    """``KVCHAT_GPU_MEMORY``: the share of the GPU's total memory this process may hold (weights,
    activations and KV pool), in (0, 1], as vLLM's ``gpu_memory_utilization``; ``--gpu-memory`` sets it for
    the command it runs and its children.

    Default (None): the KV pool takes half of the memory still free once the weights and one prefill
    chunk's activations are in place, leaving the rest to whatever else uses the GPU (a desktop, a browser, a
    second kvchat) (:func:`kvchat.engine.pool_size.gpu_pool_cap`).

    Raises:
        SettingError: not a number in (0, 1].
    """
    value = _raw(GPU_MEMORY)
    return None if value is None else fraction_value(GPU_MEMORY, os.environ[GPU_MEMORY])


def weights() -> str:
    """``KVCHAT_WEIGHTS``: the weight format, ``auto``, ``fp32``, ``bf16``, ``int8`` or ``int4`` (CPU only, the
    compiled kernel; case-insensitive);
    the ``--weights`` option of every command that runs the model sets it for the process and its children.

    Default ``auto``: on a CPU int4 for a model storing 500M parameters or more, int8 below (:mod:`kvchat.model.quant`),
    bf16 on CUDA (:func:`kvchat.engine.cache_identity.resolve_weight_format`).

    Raises:
        SettingError: any other value.
    """
    return _choice(WEIGHTS, WEIGHTS_CHOICES)


def cuda_graphs() -> bool:
    """``KVCHAT_CUDA_GRAPHS``: ``1`` (default) captures the decode step as CUDA graphs where it can
    (:func:`kvchat.engine.decode_graphs.graphs_wanted`: CUDA with the Triton kernels), ``0`` decodes eagerly.

    Raises:
        SettingError: any other value.
    """
    return _choice(CUDA_GRAPHS, CUDA_GRAPHS_CHOICES) == "1"


def cpu_kernel_enabled() -> bool:
    """``KVCHAT_CPU_KERNEL``: ``1`` (default) runs kvchat's compiled CPU kernels where they build
    (:mod:`kvchat.kernels.cpu_build`: the int8 groups scheme's matmul, a decode step's attention on the paged pool, the cache write,
    a decode step's whole layers), ``0``
    keeps torch's code (int8 weights per channel on torch's kernel: another cache fingerprint), ``avx2`` runs
    them as ``1`` does but from their AVX2 build even where the CPU has AVX-512 (:func:`cpu_kernel_isa`).

    Raises:
        SettingError: any other value.
    """
    return _choice(CPU_KERNEL, CPU_KERNEL_CHOICES) != "0"


def cpu_kernel_isa() -> str:
    """``auto`` (the default: the kernels' AVX-512 build where the CPU has it, :func:`kvchat.kernels.cpu_build.chosen_variant`)
    or ``avx2`` (``KVCHAT_CPU_KERNEL=avx2``: their AVX2 build; the bits are the same, so a side-by-side needs no new cache).

    Raises:
        SettingError: a ``KVCHAT_CPU_KERNEL`` outside ``1``, ``0``, ``avx2``.
    """
    return "avx2" if _choice(CPU_KERNEL, CPU_KERNEL_CHOICES) == "avx2" else "auto"


def int8_prefill() -> str:
    """``KVCHAT_INT8_PREFILL``: how int8 weights multiply prefill chunks (more rows than the compiled fp32
    kernel takes) on the CPU: ``int8`` quantizes the activations per 32 inputs and runs the integer kernel
    (:mod:`kvchat.kernels.cpu_int8_int8`) where it builds, ``float`` the fp32 GEMM over the dequantized
    weight; ``auto`` (default): :data:`kvchat.model.int8_scheme.DEFAULT_INT8_PREFILL`. Resolved by
    :func:`kvchat.engine.cache_identity.int8_prefill_enabled`; the two store different K/V (another cache
    fingerprint).

    Raises:
        SettingError: any other value.
    """
    return _choice(INT8_PREFILL, INT8_PREFILL_CHOICES)


def phase_trace() -> Path | None:
    """``KVCHAT_PHASE_TRACE``: a file ``kvchat ask`` appends one line per phase to (fault-injection runs,
    :mod:`kvchat.phase_trace`). Default (None): no trace."""
    value = _raw(PHASE_TRACE)
    return Path(value) if value else None


def api_key() -> str | None:
    """``KVCHAT_API_KEY``: the key ``kvchat serve`` requires (``Authorization: Bearer KEY``) when no
    ``--api-key`` is given (the flag wins); unlike the flag it does not show in other users' process list
    (``/proc/PID/cmdline``). Surrounding whitespace is stripped. Default (None): no key, loopback only."""
    return _raw(API_KEY)


def server() -> str | None:
    """``KVCHAT_SERVER``: the OpenAI-compatible server (``http://`` or ``https://`` URL, with or without
    ``/v1``) the TUI and ``kvchat ask`` use instead of a local model when no ``--server`` is given (the
    flag wins), as :func:`kvchat.server_address.base_url` records it. Default (None): the local model.

    Raises:
        SettingError: not an http(s) URL with a host.
    """
    from kvchat.server_address import base_url

    value = _raw(SERVER)
    if value is None:
        return None
    try:
        return base_url(value)
    except ValueError as exc:
        if "@" in value:  # a user or password: the value is not repeated
            raise SettingError(f"{SERVER}: {exc}") from None
        raise SettingError(f"{SERVER} must be an http:// or https:// URL with a host, "
                           f"got {os.environ[SERVER]!r}") from None


def server_timeout_s() -> float:
    """``KVCHAT_SERVER_TIMEOUT_S``: how long kvchat waits for the next byte of a server's answer (the first
    one included) before it drops the answer, in seconds, a positive number. Default:
    :data:`DEFAULT_SERVER_TIMEOUT_S`.

    Raises:
        SettingError: not a positive finite number.
    """
    return _positive(SERVER_TIMEOUT_S, "seconds") or DEFAULT_SERVER_TIMEOUT_S


def check() -> None:
    """Read every variable whose check needs no torch (all but ``KVCHAT_DEVICE``'s CUDA checks and
    whether Triton can run), so a bad value is refused before any work.

    Raises:
        SettingError: the first bad value, in the order of the module doc's list.
    """
    _device_spec()
    attention()
    kv_budget_mb()
    compute_dtype()
    resident_chats()
    gpu_memory()
    cache_budget_gb()
    weights()
    cuda_graphs()
    cpu_kernel_enabled()
    int8_prefill()
    server()
    server_timeout_s()
