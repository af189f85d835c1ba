"""Page-cache control for disk benchmarks: drop a file's cached pages, probe residency, time reads.

Dropping uses ``fsync`` then ``posix_fadvise(POSIX_FADV_DONTNEED)``: clean
pages of a file nobody maps are evicted, without root (unlike writing to
``/proc/sys/vm/drop_caches``). Residency is probed with ``preadv2(RWF_NOWAIT)``,
which fails with EAGAIN instead of reading from the device when a page is not
cached (and, since Linux 5.9, without starting readahead), so probing does not
change what it measures.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PROBE_STRIDE = 1 << 20
READ_PIECE = 8 << 20


def drop_file_cache(path: Path) -> float | None:
    """Write back and evict ``path``'s pages from the page cache; return what is still cached.

    The advice is only advice: some file systems (network and FUSE mounts, some
    container overlays) keep the pages. The return value says whether the drop
    took effect, so a benchmark can label a "dropped" figure that is not one.

    Returns:
        :func:`resident_fraction` after the drop: 0.0 when every probed page
        left the cache, None where residency cannot be probed.

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
    """Fraction of probed 4 KiB pages (one per MiB, and the first) that are in the page cache.

    Returns None where ``RWF_NOWAIT`` reads are not supported (old kernel or file system).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        offsets = list(range(0, size, PROBE_STRIDE)) or [0]
        buf = bytearray(4096)
        hits = 0
        for off in offsets:
            try:
                os.preadv(fd, [buf], off, os.RWF_NOWAIT)
                hits += 1
            except BlockingIOError:
                pass
            except OSError:
                return None
        return hits / len(offsets)
    finally:
        os.close(fd)


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
