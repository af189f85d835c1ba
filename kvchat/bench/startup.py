"""Startup benchmark of the TUI: time to the first frame and to "ready" (model loaded), in a fresh process.

Each run spawns ``python -c CHILD`` with a temporary data dir; the child runs
the app headless (Textual's compositor renders, nothing is written to a
terminal) and reports wall-clock marks; times are measured from just before
the spawn, so they include interpreter start-up and imports. Target: the
first frame < 1 s. Prints a table, then one JSON object.

Usage (wired by the CLI as ``kvchat bench startup``)::

    kvchat bench startup [--repeats 3] [--fake] [--json FILE] [--model M] [--kv-dtype fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

from kvchat.bench import PYTHON

CHILD = r"""
import json, sys, time
marks = {"child_start": time.time()}
from kvchat.tui.app import KvchatApp
marks["app_imported"] = time.time()
if sys.argv[1] == "fake":
    from kvchat.tui.fake_backend import FakeBackend
    backend = FakeBackend()
else:
    from kvchat.tui.real_backend import RealBackend
    backend = RealBackend(sys.argv[2] or None, sys.argv[3], threads=int(sys.argv[4]) or None)

class BenchApp(KvchatApp):
    def on_mount(self):
        self.call_after_refresh(self._first_frame)
        self.set_interval(0.005, self._poll)

    def _first_frame(self):
        marks["first_frame"] = time.time()
        marks["torch_imported_at_first_frame"] = "torch" in sys.modules

    def _poll(self):
        st = self.backend.status()
        if st.phase != "loading" and "first_frame" in marks:
            marks["ready" if st.phase == "ready" else "error"] = time.time() if st.phase == "ready" else st.message
            marks["model"], marks["device"], marks["kv_dtype"] = st.model, st.device, st.kv_dtype
            self.exit()

app = BenchApp(backend)
app.run(headless=True)
backend.shutdown()
print(json.dumps(marks))
"""


def add_startup_args(p: argparse.ArgumentParser) -> None:
    """The ``kvchat bench startup`` options (the CLI adds ``--model``/``--kv-dtype``/``--threads`` itself)."""
    p.add_argument("--repeats", type=int, default=3, help="fresh processes to time (default 3)")
    p.add_argument("--fake", action="store_true", help="scripted backend: UI start-up only, no model")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def run_once(fake: bool, model: str | None, kv_dtype: str, threads: int | None) -> dict:
    """One fresh process; returns seconds from spawn to each mark, plus the child's facts.

    Raises:
        RuntimeError: the child failed or reported a model load error (message included).
    """
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-") as home:
        env = {**os.environ, "KVCHAT_HOME": home}
        argv = [*PYTHON, "-c", CHILD, "fake" if fake else "real", model or "", kv_dtype, str(threads or 0)]
        t0 = time.time()
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"startup child failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    marks = json.loads(proc.stdout.strip().splitlines()[-1])
    if "error" in marks:
        raise RuntimeError(f"model load failed in the startup child: {marks['error']}")
    out = {k: marks[k] - t0 for k in ("child_start", "app_imported", "first_frame", "ready")}
    out.update({k: marks[k] for k in ("torch_imported_at_first_frame", "model", "device", "kv_dtype")})
    return out


ROWS = [("python started", "child_start"), ("kvchat.tui.app imported", "app_imported"),
        ("first frame", "first_frame"), ("ready (model loaded)", "ready")]


def run_startup(args: argparse.Namespace, *, quick: bool = False) -> dict:
    """``args.repeats`` fresh processes; the JSON-ready result (seconds since spawn, median and min per mark).

    Raises:
        ValueError: ``--repeats`` < 1; RuntimeError: see :func:`run_once`.
    """
    from kvchat.bench.run_info import run_info

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    runs = [run_once(args.fake, args.model, args.kv_dtype, args.threads) for _ in range(args.repeats)]
    summary = {key: {"median_s": statistics.median(r[key] for r in runs), "min_s": min(r[key] for r in runs)}
               for _, key in ROWS}
    return {"benchmark": "startup", "run": run_info(threads=args.threads, quick=quick), "fake": args.fake,
            "runs": runs, "summary": summary, "first_frame_target_s": 1.0}


def cmd_bench_startup(args: argparse.Namespace) -> int:
    """Run ``args.repeats`` fresh processes; print a table and a JSON object (and write ``args.json``)."""
    result = run_startup(args)
    runs, summary, rows = result["runs"], result["summary"], ROWS
    first = runs[0]
    print(f"kvchat startup: {args.repeats} fresh processes · model {first['model']} · {first['device']} · "
          f"KV {first['kv_dtype']}")
    print(f"{'seconds since spawn':<26}{'median':>9}{'min':>9}")
    for label, key in rows:
        print(f"{label:<26}{summary[key]['median_s']:>9.3f}{summary[key]['min_s']:>9.3f}")
    target = "met" if summary["first_frame"]["median_s"] < 1.0 else "MISSED"
    print(f"first-frame target < 1 s: {target}; torch in sys.modules at the first frame (from the load worker): "
          f"{any(r['torch_imported_at_first_frame'] for r in runs)}")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0
