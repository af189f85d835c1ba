"""``kvchat ask``: one question (optionally about documents, or continuing a stored chat), streamed or as JSON.

Everything is checked before the model loads; the turn runs through
:class:`kvchat.conversation.service.ChatService`, on an engine loop driven by this (main) thread.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from kvchat.progress import print_prefill_progress, print_start_progress

PROGRESS_MIN_TOKENS = 1024  # show prefill progress on stderr for prompts at least this long
NEW_CHAT = "--new-chat "  # the option that takes a continuation's way, as error lines name it


def cmd_ask(args: argparse.Namespace) -> int:
    """``kvchat ask``: validate everything, answer (streamed or as JSON), store the turn.

    Ctrl-C only sets a flag from here on (a ``KeyboardInterrupt`` raised inside
    a finalizer would be swallowed by Python and the turn carried on): before
    the first token the turn is dropped (exit 130), during decode the partial
    answer is kept and stored.
    """
    cancel = threading.Event()
    old = signal.signal(signal.SIGINT, lambda *_: cancel.set())
    try:
        return _ask(args, cancel)
    finally:
        signal.signal(signal.SIGINT, old)


def _ask(args: argparse.Namespace, cancel: threading.Event) -> int:
    """:func:`cmd_ask` with its Ctrl-C flag ``cancel``."""
    from kvchat.cpu_threads import checked_threads
    from kvchat.documents import read_document
    from kvchat.engine.sampling import SamplingParams
    from kvchat.engine.session import EmptyPromptError
    from kvchat.phase_trace import mark
    from kvchat.utf8 import require_utf8

    if not args.prompt.strip():
        raise EmptyPromptError("the prompt is empty")
    require_utf8(args.prompt, "the prompt")  # before the model loads (the session checks again)
    if args.system is not None:
        require_utf8(args.system, "the system prompt")
    params = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed, args.max_tokens)
    params.validate()
    threads = checked_threads(args.threads)
    if args.chat is not None and (args.doc or args.system is not None):
        raise ValueError("--doc and --system set up a new chat; they cannot be used with --chat")
    if args.new_chat is not None and args.chat is None:
        raise ValueError(f"--new-chat {args.new_chat} goes on from a stored chat: give it --chat ID")
    docs = [read_document(p) for p in args.doc]
    conv = _find_chat(args.chat) if args.chat is not None else None
    from kvchat.paths import db_path
    from kvchat.store.db import require_writable

    require_writable(db_path())  # the turn is stored: say so now, not after the answer

    from kvchat.cli.cache import say_eviction
    from kvchat.conversation.events import PrefillProgress, TokenBatch
    from kvchat.conversation.service import ChatService
    from kvchat.conversation.views import ContextFullError
    from kvchat.runtime import load_runtime, set_threads

    set_threads(threads)
    rt = load_runtime(args.model or (conv.model_name if conv else None), args.kv_dtype, progress=print_start_progress)
    service = ChatService(rt, batch_interval_s=0)  # every piece to stdout as it is decoded
    streamed = False

    def emit(event) -> None:
        nonlocal streamed
        if isinstance(event, PrefillProgress):
            if cancel.is_set():  # Ctrl-C during prefill: nothing generated yet, so drop the turn
                raise KeyboardInterrupt
            if not args.json and event.total >= PROGRESS_MIN_TOKENS:
                print_prefill_progress(event.done, event.total)
        elif isinstance(event, TokenBatch):
            if not streamed:
                mark("decoding")
            streamed = True
            if not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()

    try:
        if conv is not None:  # restored in the turn, so its stats say what was reused and why not more
            service.open_chat(conv.id, restore=False)
            if args.new_chat is not None:
                _continue(service, args.new_chat, args.prompt, args.max_tokens)
        else:  # the documents' prefix is prefilled with the first message
            service.start_chat(args.system, docs, emit, prefill_now=False)
        mark("loaded")  # phases for fault-injection runs (KVCHAT_PHASE_TRACE), see kvchat.bench.crash_loop
        if cancel.is_set():  # Ctrl-C while loading: nothing generated yet
            raise KeyboardInterrupt
        try:
            done = service.send(args.prompt, params, cancel, emit)
        except ContextFullError as exc:
            if conv is None or args.new_chat is not None:
                raise
            plan = service.continuation(args.prompt, args.max_tokens)
            raise ContextFullError(f"chat {conv.id} is full: {exc}; {plan.full_hint(NEW_CHAT)}", exc.needed,
                                   exc.limit) from None
        finally:
            if streamed and not args.json:
                print()  # end the answer's line before any note or error
    finally:
        evicted = service.close()
    mark("flushed")
    for err in service.persist.errors[:1]:
        print(f"kvchat: warning: {err}", file=sys.stderr)
    say_eviction(evicted)
    s = done.stats
    if args.json:
        print(json.dumps({
            "text": done.text, "chat_id": done.chat_id, "model": rt.info.name, "kv_dtype": rt.engine.spec.kv_dtype,
            "scale_scheme": rt.engine.scale_scheme, **s.to_json(),
            "context_tokens": done.context_used, "context_limit": done.context_limit,
            "continued_from": conv.id if conv is not None and args.new_chat is not None else None,
            "compute_dtype": str(rt.engine.dtype).removeprefix("torch."), "kv_pool": rt.engine.pool_plan.text,
        }))
    else:
        if s.miss_reason:  # stored history recomputed, or a corrupt chunk dropped: say why
            print(f"kvchat: note: {s.miss_reason}", file=sys.stderr)
        print(f"kvchat: {turn_figures(s)}", file=sys.stderr)
        print(f"[chat {done.chat_id}] continue with: kvchat ask --chat {done.chat_id} \"...\"", file=sys.stderr)
    return 0


def _continue(service, way: str, prompt: str, max_tokens: int) -> None:
    """Open a new chat that goes on from the open one by ``way`` (the prompt is asked there) and say so on
    stderr. It is restored in the turn, so the turn's stats say what came from disk.

    Raises:
        ContextFullError: ``way`` does not fit (the line names the ways that do, as ``--new-chat`` values).
    """
    plan = service.continuation(prompt, max_tokens)
    if not plan.fits(way):
        raise plan.error(way, NEW_CHAT)
    view = service.continue_in_new_chat(way, prompt, max_tokens, restore=False)
    print(f"kvchat: note: chat {plan.chat_id} goes on in new chat {view.id} with {plan.describe(way)}",
          file=sys.stderr)


def turn_figures(s) -> str:
    """One line of a turn's :class:`kvchat.engine.turn.TurnStats`: what was reused (from the pool, from disk
    and how long the read took), what was prefilled, the time to the first token and the decode speed, e.g.
    ``reused 1,472 of 1,490 tokens (1,464 from memory, 8 from disk in 3 ms) · prefilled 18 · TTFT 210 ms ·
    41.3 tok/s`` (no rate after a one-token answer: nothing was decoded to time)."""
    disk = f"{s.from_disk:,} from disk in {s.restore_ms:.0f} ms"
    rate = f" · {s.decode_tokens_per_s:.1f} tok/s" if s.decode_tokens_per_s else ""
    return (f"reused {s.reused_tokens:,} of {s.prompt_tokens:,} tokens ({s.from_memory:,} from memory, {disk}) · "
            f"prefilled {s.prefilled_tokens:,} · TTFT {s.ttft_ms:.0f} ms{rate}")


def _find_chat(chat_id: str):
    """Look a chat up without creating anything in the data dir."""
    from kvchat.index import get_db
    from kvchat.paths import db_path
    from kvchat.store.conversations import get_conversation
    from kvchat.store.errors import ConversationNotFoundError

    if not db_path().exists():
        raise ConversationNotFoundError(f"no conversation with id {chat_id!r}")
    return get_conversation(get_db(), chat_id)
