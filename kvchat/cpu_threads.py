"""``--threads``: checked, and capped at the cores this process may run on.

More torch threads than usable cores only makes them wait for each other
(``--threads 999`` on 2 cores took 24 s for 4 tokens). Torch-free, so the CLI
checks the value before the TUI draws its first frame.
"""

from __future__ import annotations

import os
import sys


def usable_cores() -> int:
    """CPUs this process may run on: its affinity mask where the OS has one, else every CPU."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def checked_threads(n: int | None) -> int | None:
    """``n`` capped at :func:`usable_cores` (None stays None: torch's default).

    A cap is said in one ``kvchat: note: …`` line on stderr.

    Raises:
        ValueError: ``n`` < 1.
    """
    if n is None:
        return None
    if n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    cores = usable_cores()
    if n <= cores:
        return n
    print(f"kvchat: note: --threads {n} capped at {cores} usable core{'s' if cores > 1 else ''}", file=sys.stderr)
    return cores
