"""Conversations between the session (in memory) and the store (SQLite): create, load, save a turn."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Sequence

from sqlite_utils import Database

from kvchat.conversation.titles import ChatModelMismatchError, chat_title
from kvchat.documents import PASTED_PATH, prefix_doc_id
from kvchat.engine.session import Session
from kvchat.model.chat_format import PASTED_DOCUMENT_TOKENS, Segment
from kvchat.runtime import Runtime
from kvchat.server_address import server_of
from kvchat.store.conversations import (
    Conversation,
    NewMessage,
    append_turn,
    create_conversation,
    delete_conversation,
    histories,
    list_conversations,
)
from kvchat.store.db import write_transaction
from kvchat.store.documents import delete_document, list_documents


def new_settings(documents: list[str]) -> dict:
    """Settings pinned when a chat is created: the template date and the attached documents' titles."""
    return {"date_string": datetime.now().strftime("%d %b %Y"), "template_kwargs": {}, "documents": documents}


def session_from_store(rt: Runtime, conv: Conversation) -> Session:
    """Rebuild a chat's session from its stored token ids and segments.

    Raises:
        ChatModelMismatchError: the chat belongs to a model with another fingerprint, or is held with a server
            (its history is text only).
    """
    server = server_of(conv.model_fingerprint)
    if server is not None:
        raise ChatModelMismatchError(f"chat {conv.id} is held with the server {server}; open it with "
                                     f"kvchat --server {server}")
    if conv.model_fingerprint and conv.model_fingerprint != rt.info.fingerprint:
        raise ChatModelMismatchError(
            f"chat {conv.id} was made with model {conv.model_name!r}; run it with --model {conv.model_name}"
        )
    fmt = rt.chat_format(conv.settings)
    segments = [Segment(kind, start, end) for start, end, kind in conv.segments]
    session = Session(rt.engine, fmt, list(conv.token_ids), segments)
    # pasted documents' ends: the chunk edges the turns were computed with, as stored with each user message.
    # A message stored before they were (document_tokens NULL) is tokenized again to find its end; that misses
    # where a chat predates pasted documents or the rule's threshold moved since (the turn was computed
    # without the edge), so a recompute after its chain stops mid-turn may differ in the last bits there
    for m in conv.messages:
        if m.role != "user":
            continue
        if m.document_tokens is not None:
            if m.document_tokens:
                session.sequence.document_ends.append(m.token_start + m.document_tokens)
        elif m.token_end - m.token_start >= PASTED_DOCUMENT_TOKENS:
            turn = fmt.user_turn(m.text)
            if turn.document_end is not None and turn.ids == conv.token_ids[m.token_start:m.token_end]:
                session.sequence.document_ends.append(m.token_start + turn.document_end)
    return session


def document_tokens(session: Session, start: int, end: int) -> int:
    """The pasted-document part of the user message at tokens ``[start, end)`` of ``session``: its first
    tokens up to the document's end (:attr:`kvchat.engine.sequence.Sequence.document_ends`), 0 if it has none."""
    return next((e - start for e in session.sequence.document_ends if start < e <= end), 0)


@dataclass(slots=True)
class SavedChat:
    """A chat just stored by :func:`save_new_chat`: its id, title and ``token_ids_version``."""

    id: str
    title: str
    version: int


def save_new_chat(db: Database, rt: Runtime, session: Session, system: str, settings: dict,
                  user_text: str, history: Sequence[tuple[str, str]] = ()) -> SavedChat:
    """Store a just-finished first turn (prefix, user, assistant) in one transaction.

    ``history``: (user, assistant) texts of turns before it that the chat was given (an API client's
    earlier messages), one per user/assistant segment pair after the prefix.
    """
    first = history[0][0] if history else user_text
    with write_transaction(db):
        conv = create_conversation(
            db, title=chat_title(first), model_fingerprint=rt.info.fingerprint,
            model_name=rt.info.name, system_prompt=system, settings=settings,
        )
        prefix = session.segments[0]
        version = append_turn(db, conv.id, session.token_ids[prefix.start : prefix.end], [], segment_kind="prefix")
        given = session.segments[1 : 1 + 2 * len(history)]
        for (user, answer), seg_u, seg_a in zip(history, given[::2], given[1::2]):
            for seg, role, text in ((seg_u, "user", user), (seg_a, "assistant", answer)):
                n = seg.end - seg.start
                doc = document_tokens(session, seg.start, seg.end) if role == "user" else None
                version = append_turn(db, conv.id, session.token_ids[seg.start : seg.end],
                                      [NewMessage(role, text, 0, n, document_tokens=doc)],
                                      segment_kind=seg.kind, expected_version=version)
        base = given[-1].end if given else prefix.end
        version = _append_last_turn(db, conv.id, session, user_text, base, version)
    return SavedChat(conv.id, conv.title, version)


def save_turn(db: Database, conv_id: str, session: Session, user_text: str, stored_len: int, version: int) -> int:
    """Store the session's last turn (ids after ``stored_len``) and its two messages atomically.

    ``version`` is the ``token_ids_version`` of the history the turn was
    computed on: the turn commits only onto that history, never merged after
    a turn it did not see. Returns the new version.

    Raises:
        ConversationConflictError: another writer changed the chat since ``version``; nothing was stored.
    """
    with write_transaction(db):
        return _append_last_turn(db, conv_id, session, user_text, stored_len, version)


def _append_last_turn(db: Database, conv_id: str, session: Session, user_text: str, base: int, version: int) -> int:
    turn = session.last_turn
    assert turn is not None and turn.user_span[0] == base, "session and store disagree on the conversation length"
    (u0, u1), (a0, a1) = turn.user_span, turn.assistant_span
    version = append_turn(db, conv_id, session.token_ids[u0:u1],
                          [NewMessage("user", user_text, 0, u1 - u0, document_tokens=document_tokens(session, u0, u1))],
                          segment_kind="user", expected_version=version)
    return append_turn(
        db, conv_id, session.token_ids[a0:a1],
        [NewMessage("assistant", turn.text, 0, a1 - a0, turn.stats.ttft_ms, turn.stats.decode_tokens_per_s,
                    turn.stats.finish_reason or None)],
        segment_kind="assistant", expected_version=version,
    )


def delete_chat(db: Database, conv_id: str) -> list[str]:
    """Delete a conversation and the KV chunks nobody else uses (they reveal its text); returns deleted chunk keys.

    A document pasted into it (:mod:`kvchat.conversation.pasted`) that no other chat contains goes too, row
    and unshared chunks, unless it is pinned (README, F8: "deletes its unshared cache").

    Raises:
        ConversationNotFoundError: no chat has this id.
    """
    from kvchat.engine.persistence import release_owner

    ids = histories(db, [conv_id]).get(conv_id, [])
    delete_conversation(db, conv_id)
    return release_owner(conv_id) + drop_orphaned_documents(db, ids)


def drop_orphaned_documents(db: Database, token_ids: list[int]) -> list[str]:
    """Delete the rows of :func:`orphaned_documents` and release their chunks; returns the chunk keys deleted
    (after a chat of ``token_ids`` was deleted, or edited into another history)."""
    from kvchat.engine.persistence import release_owner

    deleted = []
    for did in orphaned_documents(db, token_ids):
        delete_document(db, did)
        deleted += release_owner(did)
    return deleted


def orphaned_documents(db: Database, token_ids: list[int]) -> list[str]:
    """Pasted documents (not pinned) that a chat of ``token_ids`` contained and no stored chat contains
    (call it after deleting that chat): their row and chunks would outlive every chat that pasted them."""
    mine = [d for d in list_documents(db) if d.path == PASTED_PATH and not d.pinned
            and d.token_count <= len(token_ids) and prefix_doc_id(token_ids[:d.token_count]) == d.id]
    if not mine:
        return []
    others = histories(db, [c.id for c in list_conversations(db)]).values()
    return [d.id for d in mine if not any(ids[:d.token_count] == token_ids[:d.token_count] for ids in others)]
