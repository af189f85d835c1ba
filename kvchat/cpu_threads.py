"""``--threads``: checked, and capped at the cores this process may run on; how OpenMP threads wait.

More torch threads than usable cores only makes them wait for each other
(``--threads 999`` on 2 cores took 24 s for 4 tokens). Torch-free, so the CLI
checks the value before the TUI draws its first frame, and sets the OpenMP
spin before torch loads its OpenMP runtime (:func:`short_openmp_spins`).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


SPIN_ROUNDS = "1000"
OPENMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # either one set by the user: theirs is kept


def short_openmp_spins(environ=os.environ) -> None:
    """Set ``GOMP_SPINCOUNT=1000`` unless the user set it or ``OMP_WAIT_POLICY``; call it before torch is
    imported (libgomp reads its settings when it loads).

    A thread waiting at an OpenMP barrier spins some rounds, then sleeps (libgomp manual, GOMP_SPINCOUNT).
    A decode step runs hundreds of parallel regions (torch's and the compiled kernels'), so both ends of
    that range cost: libgomp's default spins up to 300,000 rounds, and on cores busy with other work the
    spinning partner takes the very core a descheduled thread needs; ``OMP_WAIT_POLICY=PASSIVE`` sleeps at
    once, and each region then waits for a futex wake-up. A short spin covers the gap between two regions
    of one step and gives the core up soon after. Measured on this 2-core EPYC, SmolLM2 int8, 2 threads:
    idle machine, 200 tokens: default 116.6-122.4 tok/s, passive 63.8-71.6, 1,000 rounds 117.9-139.6;
    beside one ``while True: pass`` process, 48 tokens: passive 55.4-72.2, 1,000 rounds 42.7-50.9,
    10,000 rounds 14.7-33.8; beside six: passive 17.5-19.0, 1,000 rounds 18.0-19.8 (the default gave
    0.44-0.77 at load 7-8).
    """
    if not any(name in environ for name in OPENMP_WAIT_VARIABLES):
        environ["GOMP_SPINCOUNT"] = SPIN_ROUNDS


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
