"""Build and load kvchat's compiled CPU kernels (C sources beside this file; AVX2, FMA, F16C), once per machine.

Each library is compiled from its source (and any sources linked in with it;
every source includes ``cpu_kernels.h``, the entry points) with the system C compiler (``$CC`` when set, else
``cc``, else ``gcc``; :data:`FLAGS`: ``-ffp-contract=off``, so only a kernel's own
FMAs round; about a second) into ``<user cache dir>/kvchat/kernels/``, named
by the digest of its sources, the header and the flags, and loaded with ctypes; a later
process loads the library built, with no compiler needed. The kernels use
OpenMP, and ``libgomp.so.1`` resolves to torch's own copy, already loaded, so
their threads are torch's pool (a second pool would fight it for the cores).

Two builds of each (:data:`VARIANTS`): ``avx2``, and ``avx512`` (the same sources with ``KVCHAT_AVX512``
defined: the hot loops put two 8-lane computations, or 16 independent lanes, in each 16-lane register,
so their bits equal the ``avx2`` build's; each source says how). A process loads ``avx512`` where the
CPU has its flags and ``KVCHAT_CPU_KERNEL`` is not ``avx2`` (:func:`chosen_variant`), else ``avx2``.
The integer-dot-product kernels (``cpu_int8_int8.c``, ``cpu_int4.c`` and the decode layer that links it) have a
third, ``avx512vnni`` (:func:`integer_variant`).

Where a library cannot be built or loaded (no compiler, no AVX2/FMA/F16C, no
writable cache dir, no platformdirs) or ``KVCHAT_CPU_KERNEL=0``, :func:`load`
returns None after one logged notice per library and the callers keep their
torch code (an ``avx512`` build that fails falls back to ``avx2`` first, with one notice per library; a
failed build is tried again by the next process). A build removes the libraries of
other versions of its source unused for a week (each load touches its own).
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
import time
from dataclasses import dataclass
from pathlib import Path

from kvchat import settings
from kvchat.load_steps import step

FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")


@dataclass(frozen=True, slots=True)
class Variant:
    """One build of the kernels: compiler flags beyond :data:`FLAGS`, and the ``/proc/cpuinfo`` flags it needs."""

    flags: tuple[str, ...]
    cpu_flags: frozenset[str]


_BASE_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})
VARIANTS = {
    "avx2": Variant((), _BASE_CPU_FLAGS),
    "avx512": Variant(("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-DKVCHAT_AVX512"),
                      _BASE_CPU_FLAGS | {"avx512f", "avx512vl", "avx512bw", "avx512dq"}),
    # avx512 plus VNNI's integer dot product (vpdpbusd): built only for the sources that use it
    # (cpu_int8_int8.c, cpu_int4.c and cpu_decode.c with it, :func:`integer_variant`); their bits equal the other
    # builds'
    "avx512vnni": Variant(("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx512vnni", "-DKVCHAT_AVX512",
                           "-DKVCHAT_VNNI"),
                          _BASE_CPU_FLAGS | {"avx512f", "avx512vl", "avx512bw", "avx512dq", "avx512_vnni"}),
}
_log = logging.getLogger(__name__)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def supported(variant: str) -> bool:
    """Whether this CPU has the flags the :data:`VARIANTS` build ``variant`` needs."""
    return VARIANTS[variant].cpu_flags <= _cpu_flags()


def chosen_variant() -> str:
    """The :data:`VARIANTS` name this process loads: ``avx512`` where the CPU has its flags, unless
    ``KVCHAT_CPU_KERNEL=avx2`` asks for the ``avx2`` build; else ``avx2``.

    Raises:
        kvchat.settings.SettingError: a bad ``KVCHAT_CPU_KERNEL``.
    """
    if settings.cpu_kernel_isa() == "avx2" or not supported("avx512"):
        return "avx2"
    return "avx512"


def integer_variant() -> str:
    """The build an integer-dot-product source loads: ``avx512vnni`` where :func:`chosen_variant` is ``avx512``
    and the CPU has VNNI, else :func:`chosen_variant`'s."""
    chosen = chosen_variant()
    return "avx512vnni" if chosen == "avx512" and supported("avx512vnni") else chosen


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


def library_path(source: Path, *also: Path, variant: str = "avx2") -> Path:
    """Where the ``variant`` library built from ``source`` (and the sources ``also``, linked in) lives (built or
    not): named by ``source`` and the variant, versioned by the digest of every source, :data:`HEADER` and the flags."""
    text = "".join(p.read_text() for p in (source, *also, HEADER)) + " ".join(_flags(variant))
    digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    return _cache_dir() / f"{source.stem}-{variant}-{digest}.so"


def _flags(variant: str) -> tuple[str, ...]:
    return FLAGS + VARIANTS[variant].flags


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


def _build(sources: tuple[Path, ...], variant: str) -> Path:
    """Compile ``sources`` into their one ``variant`` library (atomically: a concurrent build of the same digest
    writes the same bytes); return its path.

    Raises:
        FileNotFoundError: no compiler (:func:`_compiler`).
        OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired: the build failed.
    """
    compiler = _compiler()
    target = library_path(*sources, variant=variant)
    target.parent.mkdir(parents=True, exist_ok=True)
    stem = sources[0].stem
    step(f"building the compiled CPU kernel {stem} ({variant}, once per machine)", first_time=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{stem}-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([*compiler, *_flags(variant), "-o", tmp, *map(str, sources)], check=True, capture_output=True,
                       timeout=120)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    current = {library_path(*sources, variant=v) for v in VARIANTS}
    for old in target.parent.glob(f"{stem}-*.so"):  # other sources' builds, unused for STALE_S (loads touch them)
        try:
            if old not in current and time.time() - old.stat().st_mtime > STALE_S:
                old.unlink(missing_ok=True)
        except OSError:  # removed meanwhile by another process's build
            pass
    return target


# another sources' version's library is removed by a build once unused this long, s: two kvchat versions sharing
# one cache (two checkouts, an upgrade beside a running process) each keep theirs instead of rebuilding by turns
STALE_S = 7 * 86400
_build_lock = threading.Lock()  # one build per source even when two threads ask first


def load(source: Path, *also: Path, variant: str | None = None) -> ctypes.CDLL | None:
    """The loaded library of ``source`` with the sources ``also`` linked in (built first if absent), or None
    where it cannot be (see the module doc). ``variant``: a :data:`VARIANTS` name (None: :func:`chosen_variant`)."""
    with _build_lock:
        return _load(source, *also, variant=variant or chosen_variant())


@functools.cache
def _load(source: Path, *also: Path, variant: str) -> ctypes.CDLL | None:
    if not settings.cpu_kernel_enabled():
        return None
    failed: list[str] = []  # each variant tried: why it did not load
    for name in dict.fromkeys((variant, "avx2")):  # an avx512 build that fails falls back to avx2
        try:
            lib = _load_variant(source, also, name)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = (getattr(exc, "stderr", None) or b"").decode(errors="replace").strip().splitlines()[:1]
            failed.append(f"{name}: {exc}{f': {detail[0]}' if detail else ''}")
            continue
        if failed:
            _log.warning("kvchat: compiled CPU kernel %s: its %s build is unavailable (%s); its %s build runs",
                         source.stem, variant, failed[0], name)
        return lib
    _log.warning("kvchat: compiled CPU kernel %s unavailable (%s); torch's code runs instead", source.stem,
                 "; ".join(failed))
    return None


def _load_variant(source: Path, also: tuple[Path, ...], variant: str) -> ctypes.CDLL:
    """Build (if absent) and load one variant. Raises: OSError, subprocess.SubprocessError (see :func:`_build`)."""
    missing = VARIANTS[variant].cpu_flags - _cpu_flags()
    if missing:
        raise OSError(f"the CPU lacks {', '.join(sorted(missing))}")
    target = library_path(source, *also, variant=variant)
    if not target.exists():
        _build((source, *also), variant)
    lib = ctypes.CDLL(str(target))
    try:
        os.utime(target)  # in use: another version's build leaves it (STALE_S)
    except OSError:
        pass
    return lib
