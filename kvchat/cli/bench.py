"""``kvchat bench …``: run the benchmark the sub-command names (each prints its table and writes its JSON)."""

from __future__ import annotations

import argparse


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``kvchat bench <args.bench_command>`` (:mod:`kvchat.bench`); returns its exit code."""
    sub = args.bench_command
    if sub == "fidelity":
        from kvchat.bench.fidelity import cmd_bench_fidelity

        return cmd_bench_fidelity(args)
    if sub == "resume":
        from kvchat.bench.resume import cmd_bench_resume

        return cmd_bench_resume(args)
    if sub == "memory":
        from kvchat.bench.memory import cmd_bench_memory

        return cmd_bench_memory(args)
    if sub == "all":
        from kvchat.bench.all import cmd_bench_all

        return cmd_bench_all(args)
    if sub == "peers":
        from kvchat.bench.peers import cmd_bench_peers

        return cmd_bench_peers(args)
    if sub == "load":
        from kvchat.bench.load import cmd_bench_load

        return cmd_bench_load(args)
    if sub == "serve":
        from kvchat.bench.serve import cmd_bench_serve

        return cmd_bench_serve(args)
    if sub == "startup":
        from kvchat.bench.startup import cmd_bench_startup

        return cmd_bench_startup(args)
    from kvchat.bench.engine import cmd_bench_engine

    return cmd_bench_engine(args)
