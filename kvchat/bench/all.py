"""``kvchat bench all``: every benchmark on one model, one JSON each plus PNG plots, in one folder.

Runs, in this order, ``memory``, ``engine``, ``fidelity`` (with the
long-context retrieval probe), ``resume``, ``startup``, ``serve`` and — when
``llama-cpp-python`` is installed — ``peers``; each with the settings its own
sub-command uses by default, or with the small ``--quick`` settings
(:data:`QUICK`: a plumbing check that finishes in a few minutes on 2 cores;
its figures are not for quoting, and every JSON says ``"quick": true`` in its
``run`` block). A benchmark that fails leaves ``NAME.json`` with its
``error`` and the others still run; the exit code is then 1.

``--replot`` only redraws the PNGs from the JSON already in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from kvchat.bench.args import BENCHES, bench_defaults

# Settings of --quick, on top of each sub-command's defaults.
QUICK: dict[str, dict] = {
    "memory": {},
    "engine": {"lengths": [256, 512], "decode_tokens": 8, "repeats": 1},
    "fidelity": {"tokens": 384, "retrieval_tokens": 768},
    "resume": {"tokens": [256, 768], "repeats": 1, "cold_repeats": 1},
    "startup": {"repeats": 1},
    "serve": {"history_tokens": 512, "decode_tokens": 8, "streams": [1, 2], "repeats": 1},
    "peers": {"context": 512, "decode_tokens": 8, "repeats": 1, "resume_tokens": 512},
}


def bench_settings(name: str, quick: bool, base: argparse.Namespace) -> argparse.Namespace:
    """The Namespace ``kvchat bench NAME`` would get by default, with ``base``'s model/kv-dtype/threads,
    ``--text`` (fidelity) and, if ``quick``, :data:`QUICK`'s overrides."""
    ns = bench_defaults(name)
    ns.model, ns.kv_dtype, ns.threads = base.model, base.kv_dtype, base.threads
    if name == "fidelity":
        ns.text = list(getattr(base, "text", []) or [])
    for key, value in (QUICK[name] if quick else {}).items():
        setattr(ns, key, value)
    ns.json = None
    return ns


def run_one(name: str, ns: argparse.Namespace, quick: bool) -> tuple[dict, str]:
    """Run benchmark ``name`` with settings ``ns``; returns (its JSON-ready result, its printed report)."""
    if name == "memory":
        from kvchat.bench.memory import format_report, run_memory

        res = run_memory(ns, quick=quick)
    elif name == "engine":
        from kvchat.bench.engine import format_report, run_benchmark

        res = run_benchmark(ns, quick=quick)
    elif name == "fidelity":
        from kvchat.bench.fidelity import format_report, run_fidelity

        res = run_fidelity(ns, quick=quick)
    elif name == "resume":
        from kvchat.bench.resume import format_report, run_resume

        res = run_resume(ns, quick=quick)
    elif name == "startup":
        from kvchat.bench.startup import run_startup

        res = run_startup(ns, quick=quick)
        format_report = lambda r: json.dumps(r["summary"])  # noqa: E731 - startup prints its own table in its command
    elif name == "serve":
        from kvchat.bench.serve import format_report, run_serve

        res = run_serve(ns, quick=quick)
    elif name == "peers":
        from kvchat.bench.peers import format_report, run_peers

        res = run_peers(ns, quick=quick)
    else:
        raise ValueError(f"unknown benchmark {name!r}")
    return res, format_report(res)


def run_all(out: Path, settings: dict[str, argparse.Namespace], quick: bool) -> dict[str, dict]:
    """Run each benchmark in ``settings`` (name -> its Namespace) in order; write ``out/NAME.json``.

    A failing benchmark's JSON holds ``{"benchmark", "run", "error", "traceback"}``.
    Returns name -> the result written.
    """
    from kvchat.bench.run_info import run_info, write_json

    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, ns in settings.items():
        print(f"== kvchat bench {name}{' (quick)' if quick else ''} ==", flush=True)
        t0 = time.perf_counter()
        try:
            res, report = run_one(name, ns, quick)
            print(report, flush=True)
        except Exception as exc:  # noqa: BLE001 - one failing benchmark must not lose the others' results
            res = {"benchmark": name, "run": run_info(quick=quick), "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()}
            print(f"kvchat bench {name} failed: {res['error']}", file=sys.stderr, flush=True)
        res["wall_s"] = round(time.perf_counter() - t0, 2)
        write_json(out / f"{name}.json", res)
        results[name] = res
    return results


def load_results(out: Path) -> dict[str, dict]:
    """The ``NAME.json`` files of a ``bench all`` folder, name -> parsed JSON (unknown names ignored)."""
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(out.glob("*.json")) if p.stem in BENCHES}


def plot_and_report(results: dict[str, dict], out: Path) -> None:
    """Write the plots (or say in one line that matplotlib is missing) and list the files."""
    from kvchat.bench.plots import PLOTS_MISSING, write_plots

    written = write_plots(results, out)
    if written is None:
        print(PLOTS_MISSING)
    else:
        for path in written:
            print(f"wrote {path}")


def selected(args: argparse.Namespace) -> list[str]:
    """Benchmarks to run, in :data:`BENCHES` order; ``peers`` only when llama-cpp-python is importable
    (or named in ``--only``, so its absence is reported as that benchmark's error)."""
    import importlib.util

    names = [b for b in BENCHES if (not args.only or b in args.only) and b not in args.skip]
    if "peers" in names and not args.only and importlib.util.find_spec("llama_cpp") is None:
        print("peers skipped: llama-cpp-python is not installed (pip install 'kvchat[peers]')")
        names.remove("peers")
    return names


def cmd_bench_all(args: argparse.Namespace) -> int:
    """``kvchat bench all``: run the benchmarks, write JSON and plots into ``args.out``. Returns 0, or 1 if any failed."""
    out = Path(args.out)
    if args.replot:
        results = load_results(out)
        if not results:
            raise FileNotFoundError(f"no benchmark JSON in {out} to plot")
        plot_and_report(results, out)
        return 0
    t0 = time.perf_counter()
    settings = {name: bench_settings(name, args.quick, args) for name in selected(args)}
    results = run_all(out, settings, args.quick)
    plot_and_report(results, out)
    failed = [n for n, r in results.items() if r.get("error")]
    print(f"kvchat bench all: {len(results)} benchmarks in {time.perf_counter() - t0:.0f} s"
          f"{' (quick)' if args.quick else ''}; JSON in {out}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
