"""The ``kvchat bench`` sub-commands and their options, for the CLI and for ``bench all``.

:mod:`kvchat.cli.main` hangs this tree under ``kvchat bench``; ``kvchat bench all``
parses it for each benchmark's defaults (:func:`bench_defaults`), so no
benchmark imports the CLI.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvchat.bench.grammar import add_grammar_args
from kvchat.bench.load import add_load_args
from kvchat.bench.memory import add_memory_args
from kvchat.bench.peers import add_peers_args
from kvchat.bench.resume import add_resume_args
from kvchat.bench.serve import add_serve_bench_args
from kvchat.bench.startup import add_startup_args

BENCHES = ("memory", "engine", "fidelity", "resume", "startup", "serve", "peers")
"""What ``kvchat bench all`` runs, in this order."""


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The ``kvchat bench engine`` options."""
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 4096], help="context lengths, tokens")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def add_fidelity_args(p: argparse.ArgumentParser) -> None:
    """The ``kvchat bench fidelity`` options."""
    p.add_argument("--text", action="append", default=[], metavar="PATH", help="evaluation text (repeatable; default: stdlib docstrings)")
    p.add_argument("--tokens", type=int, default=2048, help="evaluation tokens per text")
    p.add_argument("--retrieval-tokens", type=int, default=4096, help="document tokens of the retrieval probe (0: skip it)")
    p.add_argument("--depths", type=float, nargs="+", help="where the probe's fact sits, shares of the document (default 0.1 0.5 0.9)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def add_all_args(p: argparse.ArgumentParser) -> None:
    """The ``kvchat bench all`` options."""
    p.add_argument("--out", default="bench-results", metavar="DIR", help="folder for the JSON and PNG files (default ./bench-results)")
    p.add_argument("--quick", action="store_true", help="small lengths and repeats: a few minutes on 2 cores, figures not for quoting")
    p.add_argument("--only", action="append", choices=BENCHES, metavar="NAME",
                   help=f"run only this benchmark (repeatable; one of {', '.join(BENCHES)})")
    p.add_argument("--skip", action="append", choices=BENCHES, default=[], metavar="NAME", help="leave this benchmark out (repeatable)")
    p.add_argument("--text", action="append", default=[], metavar="PATH",
                   help="evaluation text for fidelity and the retrieval probe (repeatable; default: stdlib docstrings)")
    p.add_argument("--replot", action="store_true", help="only redraw the plots from the JSON files in --out")


COMMANDS: tuple[tuple[str, str, Callable[[argparse.ArgumentParser], None]], ...] = (
    ("engine", "prefill/decode tokens/s vs transformers, model load time", add_engine_args),
    ("fidelity", "fp8 vs bf16 pool, teacher-forced: perplexity delta, KL, top-1, per scheme", add_fidelity_args),
    ("resume", "reopen an N-token chat from its disk snapshot vs cold prefill (fresh processes)", add_resume_args),
    ("startup", "time to first frame and to ready, in fresh processes", add_startup_args),
    ("load", "peak RSS and time of loading a random checkpoint; fingerprint hash speed", add_load_args),
    ("serve", "kvchat serve through HTTP: TTFT of turn N cold/warm/after restart, tok/s at 1-8 streams", add_serve_bench_args),
    ("grammar", "response_format json_schema: llguidance mask cost per token, decode tok/s with and without", add_grammar_args),
    ("memory", "KV bytes/token per dtype (allocated tensors), chats that fit, paged waste", add_memory_args),
    ("peers", "llama.cpp (llama-cpp-python) vs kvchat: tok/s and resume TTFT, same GGUF and threads", add_peers_args),
    ("all", "every benchmark on the default model: one JSON each plus PNG plots in --out", add_all_args),
)
"""``(name, help, adds its options)`` of each ``kvchat bench`` sub-command, in ``--help`` order."""


def add_bench_commands(bsub: argparse._SubParsersAction,
                       model_args: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """Add every ``kvchat bench`` sub-command to ``bsub`` (what ``add_subparsers`` returned).

    Args:
        model_args: adds ``--model``/``--kv-dtype``/``--threads`` to a sub-command (the CLI passes
            its own); None leaves them out.
    """
    for name, help_text, add_args in COMMANDS:
        p = bsub.add_parser(name, help=help_text)
        add_args(p)
        if model_args is not None:
            model_args(p)


def bench_defaults(name: str) -> argparse.Namespace:
    """The options ``kvchat bench NAME`` gets by default (without ``--model``/``--kv-dtype``/``--threads``)."""
    parser = argparse.ArgumentParser(prog="kvchat bench", add_help=False)
    add_bench_commands(parser.add_subparsers(dest="bench_command", required=True))
    return parser.parse_args([name])
