"""Opt-in phase markers for fault-injection runs (issue: reliability).

With ``KVCHAT_PHASE_TRACE=FILE`` set, ``kvchat ask`` appends one line per
phase it enters (``<unix time> <phase>``) with a single ``write`` on an
``O_APPEND`` descriptor, so a ``kill -9`` at any instant leaves whole lines
naming the last phase reached. Unset (the normal case) it does nothing.
Torch-free.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvchat import settings

TRACE_ENV = settings.PHASE_TRACE


def mark(phase: str) -> None:
    """Append ``phase`` (one word, no whitespace) with the current time to ``$KVCHAT_PHASE_TRACE``, if set.

    Raises:
        ValueError: ``phase`` is empty or contains whitespace.
    """
    if not phase or phase.split() != [phase]:
        raise ValueError(f"a phase name is one word, got {phase!r}")
    path = settings.phase_trace()
    if path is None:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, f"{time.time():.6f} {phase}\n".encode())
    finally:
        os.close(fd)


def read_trace(path: Path) -> list[tuple[float, str]]:
    """The ``(unix time, phase)`` lines of a trace file in order; [] if it does not exist.

    A last line without its newline (impossible with :func:`mark`'s single
    write, but cheap to tolerate) is ignored.
    """
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines(keepends=True):
        if line.endswith("\n") and len(parts := line.split()) == 2:
            out.append((float(parts[0]), parts[1]))
    return out
