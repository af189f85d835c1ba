"""``--threads``: checked, and capped at the cores this process may run on.

More torch threads than usable cores only makes them wait for each other
(``--threads 999`` on 2 cores took 24 s for 4 tokens). Torch-free, so the CLI
checks the value before the TUI draws its first frame.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


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


def on_own_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` run on a new thread that ends with it; its result returned, its exception re-raised.

    For loading a model that another thread will run (``kvchat serve``'s scheduler). PyTorch's OpenMP
    runtime on Linux (libgomp) keeps a pool of worker threads for every thread that has run a parallel
    region, until that thread ends; while the process holds more OpenMP threads than CPUs, libgomp cuts
    the spinning at its barriers to 100 rounds (GOMP_SPINCOUNT, libgomp manual), so each of a decode
    step's hundreds of parallel regions waits for a futex wake-up. Measured here (2 cores, 2 threads,
    SmolLM2 decode at ~140 tokens, one process per variant, alternated): loaded on the main thread and
    run on another, 49-69 ms per step; loaded on a thread that ended, 33-34 ms; all on the main thread,
    31-44 ms. A thread that ends frees its pool, so the running thread's pool is the only one.
    """
    out: list = []

    def run() -> None:
        try:
            out.append((True, fn(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            out.append((False, exc))

    worker = threading.Thread(target=run, name="kvchat-load", daemon=True)  # Ctrl-C in join() ends the process
    worker.start()
    worker.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value
