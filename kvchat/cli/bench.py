"""``kvchat bench …``: run the benchmark the sub-command names (each prints its table and writes its JSON)."""

from __future__ import annotations

import argparse
import importlib


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``kvchat bench NAME``: ``kvchat.bench.NAME.cmd_bench_NAME``, imported only now (every name of
    :data:`kvchat.bench.args.COMMANDS` follows that rule; argparse admits no other); returns its exit code."""
    name = args.bench_command
    return getattr(importlib.import_module(f"kvchat.bench.{name}"), f"cmd_bench_{name}")(args)
