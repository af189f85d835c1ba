"""How fast this process reads KV snapshots, from measurements only, and whether a restore beats recomputing.

The rule of :meth:`kvchat.engine.persistence.KVPersist.restore`: read ``nbytes`` of chunk files when that
takes less time than prefilling the same tokens (:func:`restore_pays`). Both speeds are measured: prefill by
the engine (:attr:`kvchat.engine.runner.Engine.prefill_tokens_per_s`), reading here, by a probe (the first
:data:`PROBE_BYTES` of the chain about to be read, timed) and by every restore that runs.

A rule fed only by the restores it lets run locks itself out: once one measurement (a cold page cache, a
busy disk) says reading is slower than a fast GPU's prefill, no restore runs and nothing measures the disk
again. So a decision never rests on a measurement older than :data:`STALE_S`: before it, a stale or missing
one is replaced by a probe of the very files the restore would read (page cache included, as the restore
would see them; a probe that ends up restoring read bytes the restore then finds cached). No speed is assumed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

PROBE_BYTES = 4 * 2**20  # a few ms on an SSD; enough that open/seek latency is a small share of it
STALE_S = 60.0  # a measurement older than this is probed again before the next decision


def probe_read(path: Path, limit: int = PROBE_BYTES, clock: Callable[[], float] = time.perf_counter) -> tuple[int, float]:
    """Read the first ``limit`` bytes of ``path`` (unbuffered); ``(bytes read, seconds)`` timed by ``clock``.

    Raises:
        OSError: the file cannot be opened or read.
    """
    buf = bytearray(limit)
    view = memoryview(buf)
    done = 0
    t0 = clock()
    with open(path, "rb", buffering=0) as f:
        while done < limit:
            n = f.readinto(view[done:])
            if not n:
                break
            done += n
    return done, clock() - t0


@dataclass(slots=True)
class ReadSpeed:
    """The latest read-speed measurement and when it was taken.

    Attributes:
        clock: seconds, monotonic (the measurements' age); tests pass a fake one.
        probe: ``(path) -> (bytes, seconds)``, a timed read of a file's first bytes (:func:`probe_read`).
        bytes_per_s: the latest measurement (None: none yet).
        measured_at: ``clock()`` when it was taken.
    """

    clock: Callable[[], float] = time.monotonic
    probe: Callable[[Path], tuple[int, float]] = probe_read
    bytes_per_s: float | None = None
    measured_at: float = float("-inf")

    @classmethod
    def fixed(cls, bytes_per_s: float) -> "ReadSpeed":
        """A speed that never goes stale and never probes (``inf``: always restore), for a benchmark or a
        test that measures the restore itself rather than the rule's choice."""
        return cls(clock=lambda: 0.0, bytes_per_s=bytes_per_s, measured_at=0.0)

    def record(self, nbytes: int, seconds: float) -> None:
        """A read of ``nbytes`` that took ``seconds`` (a probe or a restore); it replaces the estimate. A read
        of nothing (an empty, damaged file) measures nothing and is ignored: a speed of 0 would stop every
        restore until it went stale, where the damaged file is dropped by the read itself."""
        if nbytes <= 0:
            return
        self.bytes_per_s = nbytes / max(seconds, 1e-9)
        self.measured_at = self.clock()

    def current(self, path: Path) -> float | None:
        """Bytes/s, probed on ``path`` (a file the caller is about to read) first when the latest
        measurement is missing or older than :data:`STALE_S`; None when nothing was ever measured (the probe
        read an empty file).

        Raises:
            OSError: the probe cannot read ``path`` (the restore would fail on it too).
        """
        if self.bytes_per_s is None or self.clock() - self.measured_at > STALE_S:
            self.record(*self.probe(path))
        return self.bytes_per_s


def restore_pays(nbytes: int, tokens: int, read_bytes_per_s: float, prefill_tokens_per_s: float) -> bool:
    """Whether reading ``nbytes`` of snapshot takes no longer than prefilling its ``tokens``:
    ``nbytes / read_bytes_per_s <= tokens / prefill_tokens_per_s``."""
    return nbytes / read_bytes_per_s <= tokens / prefill_tokens_per_s
