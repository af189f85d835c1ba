"""Conversations between the session (in memory) and the store (SQLite): create, load, save a turn."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlite_utils import Database

from kvchat.model.chat_format import Segment
from kvchat.model.loader import Runtime
from kvchat.engine.session import Session
from kvchat.store.conversations import Conversation, NewMessage, append_turn, create_conversation, delete_conversation
from kvchat.store.db import write_transaction

TITLE_CHARS = 60


class ChatModelMismatchError(ValueError):
    """A stored chat was made with another model (its token ids mean nothing to this one)."""


def new_settings(documents: list[str]) -> dict:
    """Settings pinned when a chat is created: the template date and the attached documents' titles."""
    return {"date_string": datetime.now().strftime("%d %b %Y"), "template_kwargs": {}, "documents": documents}


def session_from_store(rt: Runtime, conv: Conversation) -> Session:
    """Rebuild a chat's session from its stored token ids and segments.

    Raises:
        ChatModelMismatchError: the chat belongs to a model with another fingerprint.
    """
    if conv.model_fingerprint and conv.model_fingerprint != rt.info.fingerprint:
        raise ChatModelMismatchError(
            f"chat {conv.id} was made with model {conv.model_name!r}; run it with --model {conv.model_name}"
        )
    fmt = rt.chat_format(conv.settings)
    segments = [Segment(kind, start, end) for start, end, kind in conv.segments]
    return Session(rt.engine, fmt, list(conv.token_ids), segments)


@dataclass(slots=True)
class SavedChat:
    """A chat just stored by :func:`save_new_chat`: its id, title and ``token_ids_version``."""

    id: str
    title: str
    version: int


def save_new_chat(db: Database, rt: Runtime, session: Session, system: str, settings: dict,
                  user_text: str) -> SavedChat:
    """Store a just-finished first turn (prefix, user, assistant) in one transaction."""
    with write_transaction(db):
        conv = create_conversation(
            db, title=user_text.strip().splitlines()[0][:TITLE_CHARS], model_fingerprint=rt.info.fingerprint,
            model_name=rt.info.name, system_prompt=system, settings=settings,
        )
        prefix = session.segments[0]
        version = append_turn(db, conv.id, session.token_ids[prefix.start : prefix.end], [], segment_kind="prefix")
        version = _append_last_turn(db, conv.id, session, user_text, prefix.end, version)
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
    version = append_turn(db, conv_id, session.token_ids[u0:u1], [NewMessage("user", user_text, 0, u1 - u0)],
                          segment_kind="user", expected_version=version)
    return append_turn(
        db, conv_id, session.token_ids[a0:a1],
        [NewMessage("assistant", turn.text, 0, a1 - a0, turn.stats.ttft_ms, turn.stats.decode_tokens_per_s)],
        segment_kind="assistant", expected_version=version,
    )


def delete_chat(db: Database, conv_id: str) -> list[str]:
    """Delete a conversation and the KV chunks nobody else uses (they reveal its text); returns deleted chunk keys."""
    from kvchat.engine.persistence import release_owner

    delete_conversation(db, conv_id)
    return release_owner(conv_id)
