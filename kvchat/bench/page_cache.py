"""Page-cache control for disk benchmarks: drop a file's cached pages, probe residency, time reads.

Dropping uses ``fsync`` then ``posix_fadvise(POSIX_FADV_DONTNEED)``: clean
pages of a file nobody maps are evicted, without root (unlike writing to
``/proc/sys/vm/drop_caches``). Residency comes from ``mincore(2)`` on a
mapping of the file, which reads nothing, so probing does not change what it
measures. (A ``preadv2(RWF_NOWAIT)`` probe does: on Linux 6.18 a miss still
starts readahead, and with an 8 MiB readahead window one probe per MiB
brought a dropped 64 MiB file wholly back within 0.2 s.)
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import time
from pathlib import Path

READ_PIECE = 8 << 20


def drop_file_cache(path: Path) -> float | None:
    """Write back and evict ``path``'s pages from the page cache; return what is still cached.

    The advice is only advice: some file systems (network and FUSE mounts, some
    container overlays) keep the pages. The return value says whether the drop
    took effect, so a benchmark can label a "dropped" figure that is not one.

    Returns:
        :func:`resident_fraction` after the drop: 0.0 when every page left
        the cache, None where residency cannot be probed.

    Raises:
        OSError: the file cannot be opened or advised.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_fraction(path)


def resident_fraction(path: Path) -> float | None:
    """Fraction of ``path``'s pages (of ``mmap.PAGESIZE`` bytes) that are in the page cache.

    From ``mincore(2)`` on a private read mapping that is never touched, so
    nothing is read or prefetched. An empty file counts as fully resident.

    Returns:
        0.0 … 1.0, or None where ``mincore`` is not available (no C library
        found, or the call fails on this file system).
    """
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    mincore = _mincore()
    if mincore is None:
        return None
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
            start = ctypes.c_char.from_buffer(mapping)  # ACCESS_COPY: writable, so ctypes can take its address
            try:
                rc = mincore(ctypes.addressof(start), size, vec)
            finally:
                del start  # the mapping cannot close while ctypes holds a pointer into it
    except OSError:  # a file system that cannot map files
        return None
    if rc != 0:
        return None
    return sum(v & 1 for v in vec) / pages


@functools.cache
def _mincore():
    """The C library's ``mincore(addr, length, vec)``, or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    fn.restype = ctypes.c_int
    return fn


def kept_pages_warning(fractions: list[float | None]) -> str | None:
    """One report line when a drop left pages cached, else None.

    ``fractions`` are :func:`drop_file_cache` results (None: not probed). A
    figure labelled "dropped" then partly measures page-cache reads.
    """
    kept = [f for f in fractions if f]
    if not kept:
        return None
    return (f"warning: this file system kept up to {max(kept):.0%} of a file's pages after POSIX_FADV_DONTNEED; "
            "the 'dropped' figures partly read from the page cache")


def read_file(path: Path, buf: bytearray | None = None) -> tuple[int, float]:
    """Read ``path`` sequentially in 8 MiB pieces into one reused buffer; return ``(bytes, seconds)``."""
    buf = buf if buf is not None else bytearray(READ_PIECE)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        t0 = time.perf_counter()
        total = 0
        while n := os.preadv(fd, [view], total):
            total += n
        return total, time.perf_counter() - t0
    finally:
        os.close(fd)


def write_random_file(path: Path, nbytes: int) -> None:
    """Create ``path`` with ``nbytes`` random bytes (incompressible), fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        piece = os.urandom(READ_PIECE)
        left = nbytes
        while left > 0:
            left -= os.write(fd, piece[: min(left, len(piece))])
        os.fsync(fd)
    finally:
        os.close(fd)
