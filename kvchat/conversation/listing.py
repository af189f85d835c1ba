"""Store-side operations of the real backend (SQLite through ``kvchat.store``), run on its store thread or the engine loop.

Each function takes the loaded :class:`kvchat.conversation.service.ChatService` (None
before the model is loaded: nothing is in memory then, and a snapshot under
any cache fingerprint counts as "on disk", since the engine's is not known yet).
Listings first wait for queued snapshot writes, so a chat or document shows
"disk" as soon as its snapshot is indexed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlite_utils import Database

from kvchat.conversation import records
from kvchat.conversation.cache_admin import set_pinned
from kvchat.conversation.cache_state import all_in_memory, disk_bytes, state
from kvchat.conversation.search import search_conversation_ids
from kvchat.conversation.views import CacheReport, CacheRow, ChatSummary, DocumentSummary
from kvchat.engine.disk_budget import budget_bytes
from kvchat.engine.persistence import document_tokens, release_owner, restorable_tokens
from kvchat.index import get_db
from kvchat.store.chunk_index import totals
from kvchat.store.conversations import (
    histories,
    list_conversations,
    rename_conversation,
)
from kvchat.store.documents import list_documents as stored_documents

if TYPE_CHECKING:
    from kvchat.conversation.service import ChatService


def _facts(chats: ChatService | None, db: Database, history: dict[str, list[int]]):
    """(tokens in the pool's prefix cache per chat, memory flag per chat, restorable disk bytes per owner).

    ``history``: the chats' token ids (none needed before load: nothing is in the pool then).
    """
    if chats is not None:
        chats.persist.flush()  # queued snapshot writes count: "disk" as soon as they are indexed
    cached = {i: chats.cached_tokens(ids) for i, ids in history.items()} if chats is not None else {}
    bs = chats.block_size if chats is not None else 1
    memory = {i: all_in_memory(c, len(history[i]), bs) for i, c in cached.items()}
    disk = disk_bytes(db, chats.persist.fingerprint if chats is not None else None)
    return cached, memory, disk


def list_chats(chats: ChatService | None, query: str) -> list[ChatSummary]:
    """Stored chats (pinned, then most recent first), filtered by an FTS search when ``query`` is not blank."""
    db = get_db()
    rows = list_conversations(db)
    if query.strip():
        hits = search_conversation_ids(db, query)
        rows = [r for r in rows if r.id in hits]
    cached, memory, disk = _facts(chats, db, histories(db, [r.id for r in rows]) if chats is not None else {})
    return [ChatSummary(r.id, r.title, r.updated, r.num_tokens, r.num_messages, r.pinned,
                        state(memory.get(r.id, False), disk.get(r.id, 0)), cached.get(r.id, 0)) for r in rows]


def list_documents(chats: ChatService | None, db: Database | None = None) -> list[DocumentSummary]:
    """Rows of the ``documents`` table, newest first: ``memory`` when its prefix is in the pool (documents
    prefilled by this process), ``disk`` when a snapshot this engine can restore is indexed.

    ``cached_tokens``: all of the prefix in the pool, else what a resume restores from disk
    (:func:`kvchat.engine.persistence.document_tokens`, as ``kvchat cache ls`` shows it).
    ``db``: the connection to read (the CLI passes a read-only one); default this thread's :func:`get_db`.
    """
    if chats is not None:
        chats.persist.flush()
    db = db or get_db()
    in_pool = chats.cached_documents() if chats is not None else set()
    fingerprint = chats.persist.fingerprint if chats is not None else None
    rows = []
    for d in stored_documents(db, newest_first=True):
        on_disk = document_tokens(db, d.id, d.token_count, fingerprint)
        cached = d.token_count if d.id in in_pool else on_disk
        rows.append(DocumentSummary(d.id, d.title, d.path, d.token_count, state(d.id in in_pool, on_disk), cached))
    return rows


def rename_chat(chats: ChatService | None, chat_id: str, title: str) -> None:
    """Set the title in the store and in the open chat. Raises ConversationNotFoundError."""
    rename_conversation(get_db(), chat_id, title)
    if chats is not None:
        chats.renamed(chat_id, title)


def pin_chat(chats: ChatService | None, chat_id: str, pinned: bool) -> None:
    """Set the chat's pinned flag and re-derive chunk pins (:func:`kvchat.conversation.cache_admin.set_pinned`).

    Raises ConversationNotFoundError.
    """
    set_pinned(get_db(), chat_id, pinned)


def purge_cache(chats: ChatService | None, chat_id: str) -> int:
    """Drop the chat's snapshot references; returns the chunk files deleted (those no one else uses)."""
    return len(release_owner(chat_id))


def delete_chat(chats: ChatService | None, chat_id: str) -> None:
    """Close the chat if open (its blocks go back to the pool), delete it and its unshared snapshot chunks.

    Raises ConversationNotFoundError.
    """
    if chats is not None:
        chats.forget(chat_id)
    records.delete_chat(get_db(), chat_id)


def cache_report(chats: ChatService | None) -> CacheReport:
    """Per-chat rows and totals.

    ``cached_tokens``: what a resume reuses, the pool's cached prefix or the
    chain on disk under this engine's cache fingerprint (any, before load;
    :func:`kvchat.engine.persistence.restorable_tokens`), whichever is longer (the
    pool's never the last token); memory bytes = tokens in the pool × KV bytes per token;
    disk bytes: all the chat's snapshot bytes.

    ``miss_reason``: for the open chat, what its opening found; for a chat
    that is neither in memory nor restorable from disk, why (e.g. saved with
    another KV dtype).
    """
    db = get_db()
    rows = list_conversations(db)
    history = histories(db, [r.id for r in rows])
    cached, memory, restorable = _facts(chats, db, history)
    on_disk = disk_bytes(db)
    per_token = chats.bytes_per_token if chats is not None else 0
    fingerprint = chats.persist.fingerprint if chats is not None else None
    report = CacheReport()
    for r in rows:
        st = state(memory.get(r.id, False), restorable.get(r.id, 0))
        in_pool, ids = cached.get(r.id, 0), history.get(r.id, [])
        reused = max(min(in_pool, len(ids) - 1), restorable_tokens(db, r.id, ids, fingerprint))
        report.rows.append(CacheRow(r.id, r.title, r.num_tokens, st, reused, in_pool * per_token,
                                    on_disk.get(r.id, 0), r.pinned, _miss(chats, db, r.id, st)))
    report.disk_bytes = totals(db).bytes
    report.disk_budget_bytes = budget_bytes(db)
    return report


def _miss(chats: ChatService | None, db: Database, chat_id: str, st: str) -> str:
    if chats is None:
        return ""
    open_chat = chats.chat
    if open_chat is not None and open_chat.chat_id == chat_id:
        return (open_chat.resume.miss_reason or "") if open_chat.resume else ""
    return chats.explain_miss(db, chat_id) if st == "none" else ""
