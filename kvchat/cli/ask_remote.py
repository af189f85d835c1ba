"""``kvchat ask --server URL``: one question to a model served elsewhere, the chat kept in the local store.

Checked before the server is asked anything, as the local ``ask`` is; the turn runs through
:class:`kvchat.remote.chats.RemoteChats`. Ctrl-C before the question is sent drops it (exit 130); once
it is sent, Ctrl-C stops the stream and what was answered so far is stored (as Esc in the app); so is the
part of an answer a server stopped sending (then one error line, exit 2).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

NEW_CHAT_REFUSED = "--new-chat carries a chat by its token counts, which a server's chat does not have here"


def cmd_ask_remote(args: argparse.Namespace, server: str) -> int:
    """``kvchat ask --server``: validate, ask ``server``, print the answer (streamed or as JSON), store the turn.

    Raises:
        ValueError: bad input (empty prompt, bad sampling values, options that do not go together, a bad
            key setting, a bad document); nothing was sent.
        kvchat.remote.client.AnswerCut: the server stopped mid-answer; the question and the part that came are
            stored (finish reason ``interrupted``, as a Ctrl-C keeps a local one), the line names the chat.
        kvchat.remote.client.ServerError: the server failed before answering (one line); nothing was stored.
    """
    cancel = threading.Event()
    old = signal.signal(signal.SIGINT, lambda *_: cancel.set())
    try:
        return _ask(args, server, cancel)
    finally:
        signal.signal(signal.SIGINT, old)


def _ask(args: argparse.Namespace, server: str, cancel: threading.Event) -> int:
    from kvchat.cli.remote import server_key
    from kvchat.conversation.events import TokenBatch
    from kvchat.documents import read_document
    from kvchat.engine.turn import SamplingParams
    from kvchat.index import get_db
    from kvchat.paths import db_path
    from kvchat.remote.chats import RemoteChats, require_remote
    from kvchat.remote.client import AnswerCut, ServerClient, context_limit, pick_model
    from kvchat.server_address import plain_http_warning
    from kvchat.store.conversations import get_conversation
    from kvchat.store.db import require_writable
    from kvchat.utf8 import require_utf8

    if not args.prompt.strip():
        raise ValueError("the prompt is empty")
    require_utf8(args.prompt, "the prompt")
    if args.system is not None:
        require_utf8(args.system, "the system prompt")
    params = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed, args.max_tokens)
    params.validate()
    if args.chat is not None and (args.doc or args.system is not None):
        raise ValueError("--doc and --system set up a new chat; they cannot be used with --chat")
    if args.new_chat is not None:
        raise ValueError(NEW_CHAT_REFUSED)
    docs = [read_document(p) for p in args.doc]
    key = server_key(server, args)
    require_writable(db_path())  # the turn is stored: say so now, not after the answer
    stored = require_remote(get_conversation(get_db(), args.chat)) if args.chat is not None else None
    warning = plain_http_warning(server)
    if warning:
        print(f"kvchat: warning: {warning}", file=sys.stderr)

    client = ServerClient(server, key)
    try:
        models = client.models()
        ids = [m.id for m in models]
        kept = stored.model_name if stored is not None and stored.model_name in ids else None  # else the first
        model = pick_model(ids, args.model or kept, server)
        limit = context_limit(models, model, client.counters())
        chats = RemoteChats(client, model, limit, batch_interval_s=0)
        if args.chat is not None:
            chats.open_chat(args.chat)
        else:
            chats.new_chat(args.system, docs)
        streamed = False

        def emit(event) -> None:
            nonlocal streamed
            if isinstance(event, TokenBatch) and not args.json:
                streamed = True
                sys.stdout.write(event.text)
                sys.stdout.flush()

        if cancel.is_set():
            raise KeyboardInterrupt
        try:
            done = chats.send(args.prompt, params, cancel, emit)
        except AnswerCut as exc:  # the line says which chat holds the question and the part that came
            raise AnswerCut(f"{exc} (chat {exc.chat_id})", exc.reply, exc.chat_id) from None
        finally:
            if streamed:
                print()  # end the answer's line before any note or error
    finally:
        client.close()
    s = done.stats
    if args.json:
        print(json.dumps({
            "text": done.text, "chat_id": done.chat_id, "model": model, "server": server,
            **s.to_json(chats.last_keys),
            "context_tokens": done.context_used, "context_limit": done.context_limit, "server_reuse": chats.last_line,
        }))
    else:
        figures = [chats.last_line or f"the answer ended: {s.finish_reason}", f"TTFT {s.ttft_ms:.0f} ms"]
        figures += [f"{s.decode_tokens_per_s:.1f} tok/s"] if s.decode_tokens_per_s else []  # 0: too short to time
        print(f"kvchat: {' · '.join(figures)}", file=sys.stderr)
        print(f"[chat {done.chat_id}] continue with: kvchat ask --server {server} --chat {done.chat_id} \"...\"",
              file=sys.stderr)
    return 0
