"""Prefill progress on stderr for the CLI: a line rewritten in place on a terminal, one final line elsewhere."""

from __future__ import annotations

import sys
from typing import TextIO


def print_prefill_progress(done: int, total: int, stream: TextIO | None = None) -> None:
    """Report ``done`` of ``total`` prefilled tokens.

    On a terminal the line is redrawn with ``\\r`` after every chunk and ended
    when ``done == total``; on a pipe or log file (``isatty()`` false) only the
    final line is written, so logs get no carriage returns.
    """
    stream = stream or sys.stderr
    line = f"prefill {done}/{total} tokens"
    if stream.isatty():
        print(f"\r{line}", end="\n" if done == total else "", file=stream, flush=True)
    elif done == total:
        print(line, file=stream, flush=True)
