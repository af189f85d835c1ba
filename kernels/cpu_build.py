"""Build and load kvchat's compiled CPU kernels (C sources beside this file; AVX2, FMA, F16C), once per machine.

Each library is compiled from its source (and any sources linked in with it;
every source includes ``cpu_kernels.h``, the entry points) with the system C compiler (``$CC`` when set, else
``cc``, else ``gcc``; :data:`FLAGS`: ``-ffp-contract=off``, so only a kernel's own
FMAs round; about a second) into ``<user cache dir>/kvchat/kernels/``, named
by the digest of its sources, the header and the flags, and loaded with ctypes; a later
process loads the library built, with no compiler needed. The kernels use
OpenMP, and ``libgomp.so.1`` resolves to torch's own copy, already loaded, so
their threads are torch's pool (a second pool would fight it for the cores).

Where a library cannot be built or loaded (no compiler, no AVX2/FMA/F16C, no
writable cache dir, no platformdirs) or ``KVCHAT_CPU_KERNEL=0``, :func:`load`
returns None after one logged notice per library and the callers keep their
torch code. A build removes the libraries of earlier versions of its source.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from kvchat import settings

FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
REQUIRED_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})
_log = logging.getLogger(__name__)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _cache_dir() -> Path:
    """The user's own cache dir (never a shared one such as /tmp, where another user could plant a library).

    Raises:
        OSError: platformdirs is not installed (bench/gpu.py's machines, which never run these CPU paths).
    """
    try:
        import platformdirs
    except ImportError as exc:
        raise OSError("platformdirs is not installed: no user cache dir for compiled kernels") from exc
    return Path(platformdirs.user_cache_dir(settings.APP_NAME)) / "kernels"


HEADER = Path(__file__).with_name("cpu_kernels.h")  # the entry points every source includes


def library_path(source: Path, *also: Path) -> Path:
    """Where the library built from ``source`` (and the sources ``also``, linked in) with :data:`FLAGS` lives
    (built or not): named by ``source``, versioned by the digest of every source, :data:`HEADER` and the flags."""
    text = "".join(p.read_text() for p in (source, *also, HEADER)) + " ".join(FLAGS)
    digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    return _cache_dir() / f"{source.stem}-{digest}.so"


def _compiler() -> list[str]:
    """The compiler command: ``$CC`` as written (split like a shell command) when set, else ``cc``, else ``gcc``.

    Raises:
        FileNotFoundError: ``$CC`` names no executable, or neither ``cc`` nor ``gcc`` is on PATH.
    """
    cc = os.environ.get("CC", "").strip()
    if cc:
        argv = shlex.split(cc)
        if shutil.which(argv[0]) is None:
            raise FileNotFoundError(f"$CC ({cc!r}) is not an executable")
        return argv
    found = shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise FileNotFoundError("no C compiler (cc) on PATH")
    return [found]


def _build(sources: tuple[Path, ...], target: Path) -> None:
    """Compile ``sources`` into the one library ``target`` (atomically: a concurrent build of the same digest writes the same bytes).

    Raises:
        FileNotFoundError: no compiler (:func:`_compiler`).
        OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired: the build failed.
    """
    compiler = _compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    stem = sources[0].stem
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{stem}-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([*compiler, *FLAGS, "-o", tmp, *map(str, sources)], check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    for old in target.parent.glob(f"{stem}-*.so"):  # earlier sources' builds: never loaded again
        if old != target:
            old.unlink(missing_ok=True)


_build_lock = threading.Lock()  # one build per source even when two threads ask first


def load(source: Path, *also: Path) -> ctypes.CDLL | None:
    """The loaded library of ``source`` with the sources ``also`` linked in (built first if absent), or None
    where it cannot be (see the module doc)."""
    with _build_lock:
        return _load(source, *also)


@functools.cache
def _load(source: Path, *also: Path) -> ctypes.CDLL | None:
    if not settings.cpu_kernel_enabled():
        return None
    missing = REQUIRED_CPU_FLAGS - _cpu_flags()
    try:
        if missing:
            raise OSError(f"the CPU lacks {', '.join(sorted(missing))}")
        target = library_path(source, *also)
        if not target.exists():
            _build((source, *also), target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (getattr(exc, "stderr", None) or b"").decode(errors="replace").strip().splitlines()[:1]
        _log.warning("kvchat: compiled CPU kernel %s unavailable (%s%s); torch's code runs instead",
                     source.stem, exc, f": {detail[0]}" if detail else "")
        return None
