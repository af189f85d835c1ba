"""``kvchat cache …`` and ``kvchat doc …``: the KV snapshot store from the command line."""

from __future__ import annotations

import argparse

from kvchat.progress import print_prefill_progress, print_start_progress
from kvchat.units import size_text

EXIT_DAMAGED = 1  # `cache verify` found (and dropped) corrupt chunks, as fsck and `git fsck` exit non-zero


def printable(text: str) -> str:
    """``text`` with control characters (terminal escape sequences) shown as ``\\x1b``-style escapes."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in text)


def id_width(header: str, ids: list[str]) -> int:
    """Width of an id column: its header or its longest id (chats ``c_…`` and documents ``d_…`` differ)."""
    return max([len(header), *map(len, ids)])


def cached_text(tokens: int) -> str:
    """A CACHED cell: the tokens a resume restores from disk, ``none`` when nothing is stored."""
    return str(tokens) if tokens else "none"


def say_eviction(evicted) -> None:
    """Print :func:`kvchat.engine.disk_budget.eviction_note` on stderr when the budget evicted more than a few chunks."""
    import sys

    from kvchat.engine.disk_budget import eviction_note

    if note := eviction_note(evicted):
        print(f"kvchat: note: {note}", file=sys.stderr)


def cmd_cache(args: argparse.Namespace) -> int:
    """Dispatch ``kvchat cache ls|stats|verify|gc|pin|unpin|purge|explain``; returns the exit code."""
    from kvchat.conversation import cache_admin

    sub = args.cache_command
    if sub == "ls":
        rows = cache_admin.owners()  # before the header: a damaged index prints nothing but its error line
        w = id_width("OWNER", [o.owner for o in rows])
        print(f"{'OWNER':{w}} {'CACHED':>7} {'CHUNKS':>6} {'SIZE':>9}  PIN  TITLE")
        for o in rows:
            print(f"{o.owner:{w}} {cached_text(o.tokens):>7} {o.chunks:>6} {size_text(o.bytes):>9}  "
                  f"{'yes' if o.pinned else '   '}  {printable(o.title[:50])}")
    elif sub == "stats":
        t = cache_admin.store_totals()
        print(f"chunks {t.chunks}, {size_text(t.bytes)} of a {size_text(t.budget_bytes)} budget; "
              f"pinned {t.pinned_chunks} ({size_text(t.pinned_bytes)})")
    elif sub == "verify":  # like fsck: exit 1 when anything was damaged
        dropped, verified = cache_admin.verify()
        for line in dropped:
            print(f"dropped: {line}")
        print(f"database ok (integrity_check); verified {verified} chunks; {len(dropped)} corrupt chunk(s) "
              "dropped (their tokens will be recomputed)")
        return EXIT_DAMAGED if dropped else 0
    elif sub == "gc":
        r = cache_admin.collect_garbage()
        print(f"removed {r.files_removed} stray file(s) ({size_text(r.bytes_freed)}), {r.rows_removed} row(s) without a file, "
              f"evicted {r.evicted.chunks} chunk(s) over budget")
        say_eviction(r.evicted)
    elif sub in ("pin", "unpin"):
        cache_admin.pin_owner(args.owner, sub == "pin")
        print(f"{sub}ned {args.owner}")
    elif sub == "purge":
        print(f"purged {cache_admin.purge(args.all)} chunk(s)")
    elif sub == "explain":
        report = cache_admin.explain_chain(args.chat, args.kv_dtype)
        if args.json:
            import json
            from dataclasses import asdict

            print(json.dumps(asdict(report)))
        else:
            _explain(report)
    return 0


def _explain(r) -> None:
    """Print a :class:`kvchat.conversation.views.ChainReport`: the chunk chain and where (and why) it stops."""
    print(f"chat {r.chat_id}: {r.tokens} tokens, cache fingerprint {r.fingerprint[:12]} ({r.kv_dtype})")
    for link in r.links:
        print(f"  [{link.start:>6}, {link.end:>6})  {'tail' if link.tail else 'chunk':5} {link.key[:12]}  "
              f"{size_text(link.bytes):>9}  on disk")
    rest = " (a resume recomputes the rest)" if r.restorable_tokens < r.tokens else ""
    print(f"restorable from disk: {r.restorable_tokens} of {r.tokens} tokens{rest}")
    if r.stops_at is not None:
        print(f"chain stops at token {r.stops_at}: {r.reason}")
    if r.other_fingerprints:
        print(f"{r.other_fingerprints} chunk(s) belong to other cache fingerprints (another model, KV dtype or scale scheme): "
              "never used here")


def cmd_doc(args: argparse.Namespace) -> int:
    """``kvchat doc add|list|rm``; returns the exit code."""
    from kvchat.conversation import cache_admin
    from kvchat.conversation.listing import list_documents
    from kvchat.index import get_reader

    if args.doc_command == "list":
        rows = list_documents(None, get_reader())  # before the header, as `cache ls`
        w = id_width("ID", [d.id for d in rows])
        print(f"{'ID':{w}} {'TOKENS':>7} {'CACHED':>7}  TITLE")
        for d in rows:
            print(f"{d.id:{w}} {d.tokens:>7} {cached_text(d.cached_tokens):>7}  {printable(d.title)}")
        return 0
    if args.doc_command == "rm":
        for r in cache_admin.remove_document(args.doc):
            print(f"removed {r.id} and {r.chunks_deleted} chunk(s) nobody else uses")
        return 0
    return _doc_add(args)


def _doc_add(args: argparse.Namespace) -> int:
    """``kvchat doc add``: prefill the document once and snapshot it (:meth:`ChatService.cache_document`)."""
    from kvchat.conversation.events import PrefillProgress
    from kvchat.conversation.service import ChatService
    from kvchat.documents import read_document
    from kvchat.paths import db_path
    from kvchat.runtime import load_runtime, set_threads
    from kvchat.store.db import require_writable
    from kvchat.utf8 import require_utf8

    doc = read_document(args.path)
    if args.system is not None:
        require_utf8(args.system, "the system prompt")  # before the model loads (the session checks again)
    require_writable(db_path())  # before the model loads and the document is prefilled
    set_threads(args.threads)
    service = ChatService(load_runtime(args.model, args.kv_dtype, progress=print_start_progress))

    def emit(event) -> None:
        if isinstance(event, PrefillProgress):
            print_prefill_progress(event.done, event.total)

    try:
        did, stats, tokens = service.cache_document(doc, args.system, emit)
    finally:
        evicted = service.close()
    say_eviction(evicted)
    print(f"{did}  {printable(doc.title)}: {tokens} tokens, {stats.reused_tokens} reused, "
          f"{stats.prefilled_tokens} prefilled in {stats.prefill_ms / 1e3:.1f} s; cached for new chats")
    return 0
