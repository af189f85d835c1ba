"""``kvchat cache …`` and ``kvchat doc …``: the KV snapshot store from the command line."""

from __future__ import annotations

import argparse

from kvchat.store.chunk_index import gc, list_chunks, totals, verify_chunks
from kvchat.progress import print_prefill_progress
from kvchat.index import get_db
from kvchat.store.db import write_transaction
from kvchat.store.documents import delete_document, find_documents, list_documents

EXIT_DAMAGED = 1  # `cache verify` found (and dropped) corrupt chunks, as fsck and `git fsck` exit non-zero


def printable(text: str) -> str:
    """``text`` with control characters (terminal escape sequences) shown as ``\\x1b``-style escapes."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in text)


def human(n: float) -> str:
    """Bytes as a short human-readable size (decimal units)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _tokens(db, owner) -> int:
    """``cache ls`` TOKENS of a :class:`kvchat.store.chunk_refs.OwnerUsage`: of a chat, what a resume restores
    from disk; of a document, its chunks' tokens (a document references exactly its prefix's chain)."""
    from kvchat.engine.persistence import restorable_tokens

    if owner.token_ids is None:
        return owner.tokens
    return restorable_tokens(db, owner.owner, owner.token_ids)


def say_eviction(evicted) -> None:
    """Print :func:`kvchat.engine.disk_budget.eviction_note` on stderr when the budget evicted more than a few chunks."""
    import sys

    from kvchat.engine.disk_budget import eviction_note

    if note := eviction_note(evicted):
        print(f"kvchat: note: {note}", file=sys.stderr)


def cmd_cache(args: argparse.Namespace) -> int:
    """Dispatch ``kvchat cache ls|stats|verify|gc|pin|unpin|purge|explain``; returns the exit code."""
    from kvchat.engine.disk_budget import budget_bytes, enforce, refresh_pins
    from kvchat.store.chunk_refs import list_owners

    db = get_db()
    sub = args.cache_command
    if sub == "ls":
        print(f"{'OWNER':10} {'TOKENS':>7} {'CHUNKS':>6} {'SIZE':>9}  PIN  TITLE")
        for o in list_owners(db):
            print(f"{o.owner:10} {_tokens(db, o):>7} {o.chunks:>6} {human(o.bytes):>9}  {'yes' if o.pinned else '   '}  {printable(o.title[:50])}")
    elif sub == "stats":
        t = totals(db)
        print(f"chunks {t.count}, {human(t.bytes)} of a {human(budget_bytes(db))} budget; pinned {t.pinned_count} ({human(t.pinned_bytes)})")
    elif sub == "verify":  # like fsck: exit 1 when anything was damaged
        from kvchat.paths import db_path
        from kvchat.store.db import check_database

        check_database(db, db_path(), full=True)
        bad = verify_chunks(db, drop=True)
        for exc in bad:
            print(f"dropped: {exc}")
        print(f"database ok (integrity_check); verified {totals(db).count} chunks; {len(bad)} corrupt chunk(s) "
              "dropped (their tokens will be recomputed)")
        return EXIT_DAMAGED if bad else 0
    elif sub == "gc":
        r = gc(db)
        evicted = enforce(db)
        print(f"removed {r.files_removed} stray file(s) ({human(r.bytes_freed)}), {r.rows_removed} row(s) without a file, "
              f"evicted {evicted.chunks} chunk(s) over budget")
        say_eviction(evicted)
    elif sub in ("pin", "unpin"):
        from kvchat.store.conversations import pin_conversation
        from kvchat.store.documents import pin_document

        pin = pin_conversation if args.owner.startswith("c_") else pin_document
        try:
            with write_transaction(db):
                pin(db, args.owner, sub == "pin")
                refresh_pins(db)
        except LookupError:  # ConversationNotFoundError, DocumentNotFoundError
            raise LookupError(f"no chat or document with id {args.owner!r}") from None
        print(f"{sub}ned {args.owner}")
    elif sub == "purge":
        from kvchat.store.chunk_index import delete_chunk
        from kvchat.store.chunk_refs import drop_dangling_refs

        keys = [r.key for r in list_chunks(db) if args.all or not r.pinned]
        for key in keys:
            delete_chunk(db, key)
        drop_dangling_refs(db)
        print(f"purged {len(keys)} chunk(s)")
    elif sub == "explain":
        return _explain(db, args.chat, args.kv_dtype)
    return 0


def _explain(db, chat_id: str, kv_dtype: str) -> int:
    """Print the chat's chunk chain and where (and why) it stops."""
    from kvchat.engine.cache_identity import expected_cache_fingerprint
    from kvchat.engine.persistence import CHUNK_TOKENS, find_chain, restorable_tokens
    from kvchat.store.chunk_index import count_other_fingerprints
    from kvchat.store.conversations import get_conversation

    conv = get_conversation(db, chat_id)
    fp = expected_cache_fingerprint(conv.model_fingerprint or "", kv_dtype)
    rows = find_chain(db, fp, conv.token_ids)
    print(f"chat {conv.id}: {len(conv.token_ids)} tokens, cache fingerprint {fp[:12]} ({kv_dtype})")
    start = 0
    for row in rows:
        kind = "tail" if row.token_count < CHUNK_TOKENS else "chunk"
        print(f"  [{start:>6}, {start + row.token_count:>6})  {kind:5} {row.key[:12]}  {human(row.bytes):>9}  on disk")
        start += row.token_count
    print(f"restorable from disk: {restorable_tokens(db, conv.id, conv.token_ids, fp)} of {len(conv.token_ids)} tokens "
          f"(a resume always recomputes the last token and what the previous answer never ran through the model)")
    if start + CHUNK_TOKENS <= len(conv.token_ids) - 1 or not rows:
        print(f"chain stops at token {start}: the next chunk is not on disk (never written, evicted LRU, or dropped as corrupt)")
    n_other = count_other_fingerprints(db, fp)
    if n_other:
        print(f"{n_other} chunk(s) belong to other cache fingerprints (another model, KV dtype or scale scheme): never used here")
    return 0


def cmd_doc(args: argparse.Namespace) -> int:
    """``kvchat doc add|list|rm``; returns the exit code."""
    db = get_db()
    if args.doc_command == "list":
        print(f"{'ID':12} {'TOKENS':>7}  TITLE")
        for d in list_documents(db):
            print(f"{d.id:12} {d.token_count:>7}  {printable(d.title)}")
        return 0
    if args.doc_command == "rm":
        from pathlib import Path

        from kvchat.engine.persistence import release_owner

        path = str(Path(args.doc).expanduser().resolve())  # doc add stores the resolved path
        rows = find_documents(db, args.doc, path)
        if not rows:
            raise LookupError(f"no document {args.doc!r} (see kvchat doc list)")
        for r in rows:
            deleted = release_owner(r.id)
            delete_document(db, r.id)
            print(f"removed {r.id} and {len(deleted)} chunk(s) nobody else uses")
        return 0
    return _doc_add(args)


def _doc_add(args: argparse.Namespace) -> int:
    """``kvchat doc add``: prefill the document once and snapshot it (:meth:`ChatService.cache_document`)."""
    from kvchat.conversation.events import PrefillProgress
    from kvchat.conversation.service import ChatService
    from kvchat.documents import read_document
    from kvchat.model.loader import load_runtime, set_threads
    from kvchat.paths import db_path
    from kvchat.store.db import require_writable

    doc = read_document(args.path)
    require_writable(db_path())  # before the model loads and the document is prefilled
    set_threads(args.threads)
    service = ChatService(load_runtime(args.model, args.kv_dtype))

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
