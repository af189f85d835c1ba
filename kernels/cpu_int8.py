"""The compiled CPU int8 matmul (``cpu_int8.c``): int8 weights, float32 activations, AVX2 + FMA, few rows.

Why compiled C: PyTorch's CPU int8 weight-only kernel
(``torch._weight_int8pack_mm``) is vectorized for bf16 activations only, so
kvchat cast every decode row to bf16 before it; its fp32 path is scalar
(~15x slower). This kernel takes the fp32 rows as they are (no bf16
rounding) and, over SmolLM2's 30 layers and LM head at one row, measured
5.4-6.3 ms against 11-15 ms for the bf16 int8 kernel (2 threads, this
2-core machine; ``kvchat bench engine`` has the figures in a decode step).

It is built once per machine with the system C compiler (``$CC``, else
``cc``; ``-O3 -mavx2 -mfma -fopenmp -ffp-contract=off``: no contraction, so
only the kernel's own FMAs round; about a second) into ``<user cache
dir>/kvchat/kernels/``, named by the digest of its source and flags, and
loaded with ctypes; a later process loads the library built. OpenMP's ``libgomp.so.1`` resolves to
torch's own copy, already loaded, so the kernel's threads are torch's pool.
Where it cannot be built or loaded (no compiler, no AVX2/FMA, a sandbox
without a writable cache dir) or ``KVCHAT_CPU_KERNEL=0``, :func:`available`
is False, one notice is logged, and int8 layers keep the bf16 int8 kernel;
the two choices enter the cache fingerprint under different names
(:func:`kvchat.model.int8_scheme.int8_compute_scheme`), since their K/V differ.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvchat import settings

SOURCE = Path(__file__).with_name("cpu_int8.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
GROUP_MULTIPLE = 32  # the kernel's inner step over k (four 8-lane vectors)
_log = logging.getLogger(__name__)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _cache_dir() -> Path:
    try:
        import platformdirs
    except ImportError:  # bench/gpu.py's machines: never on the int8 path, but stay importable
        return Path(tempfile.gettempdir()) / "kvchat-kernels"
    return Path(platformdirs.user_cache_dir(settings.APP_NAME)) / "kernels"


def _target() -> Path:
    """Where the library for this source and these flags lives (built or not)."""
    digest = hashlib.blake2b((SOURCE.read_text() + " ".join(FLAGS)).encode(), digest_size=8).hexdigest()
    return _cache_dir() / f"cpu_int8-{digest}.so"


def _build(target: Path) -> None:
    """Compile the source into ``target`` (atomically: a concurrent build of the same digest writes the same bytes).

    Raises:
        FileNotFoundError: no C compiler on PATH (``$CC``, else ``cc``, else ``gcc``).
        OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired: the build failed.
    """
    compiler = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".cpu_int8-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not settings.cpu_kernel_enabled():
        return None
    missing = {"avx2", "fma"} - _cpu_flags()
    try:
        if missing:
            raise OSError(f"the CPU lacks {', '.join(sorted(missing))}")
        target = _target()
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (getattr(exc, "stderr", None) or b"").decode(errors="replace").strip().splitlines()[:1]
        _log.warning("kvchat: compiled CPU int8 kernel unavailable (%s%s); int8 layers use torch's bf16 kernel",
                     exc, f": {detail[0]}" if detail else "")
        return None
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
