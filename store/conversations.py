"""Conversations and their messages in the kvchat index.

The conversation's token id list is the source of truth (history is never
re-tokenized); message text is for display. :func:`append_turn` stores a
turn's new token ids and its messages in one transaction, so text and ids
never diverge. Token ids are a BLOB of little-endian int32 (4 bytes/token).
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from sqlite_utils import Database

from .db import write_transaction
from .errors import ConversationConflictError, ConversationNotFoundError
from .faults import crash_point


@dataclass(slots=True)
class NewMessage:
    """A message to store with a turn. ``token_start``/``token_end`` are offsets into that turn's new token ids;
    ``finish_reason``: how an answer ended (:attr:`kvchat.engine.turn.TurnStats.finish_reason`);
    ``document_tokens``: a user message's pasted-document part, its first tokens (0: none; None: not known)."""

    role: str
    text: str
    token_start: int
    token_end: int
    ttft_ms: float | None = None
    decode_tokens_per_s: float | None = None
    finish_reason: str | None = None
    document_tokens: int | None = None


@dataclass(slots=True)
class Message:
    """A stored message; ``token_start``/``token_end`` index the conversation's token ids (half-open);
    ``finish_reason``: how an answer ended (None for a user message or an answer stored before it was kept);
    ``document_tokens``: as :class:`NewMessage`'s (None for an answer or a message stored before it was kept)."""

    id: int
    conversation_id: str
    idx: int
    role: str
    text: str
    token_start: int
    token_end: int
    ttft_ms: float | None
    decode_tokens_per_s: float | None
    created: float
    finish_reason: str | None
    document_tokens: int | None


@dataclass(slots=True)
class Conversation:
    """A conversation with its full token id list, segments ``(start, end, kind)`` and messages."""

    id: str
    title: str
    model_fingerprint: str | None
    model_name: str | None
    system_prompt: str | None
    settings: dict[str, Any]
    created: float
    updated: float
    pinned: bool
    token_ids: list[int]
    token_ids_version: int
    segments: list[tuple[int, int, str]]
    messages: list[Message] = field(default_factory=list)


@dataclass(slots=True)
class ConversationSummary:
    """One row of :func:`list_conversations` (no token ids, no messages)."""

    id: str
    title: str
    model_name: str | None
    created: float
    updated: float
    pinned: bool
    num_tokens: int
    num_messages: int


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids -> little-endian int32 bytes. Raises OverflowError outside int32."""
    ids = array("i", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def decode_token_ids(blob: bytes) -> list[int]:
    """Inverse of :func:`encode_token_ids`."""
    ids = array("i")
    ids.frombytes(blob)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


def create_conversation(
    db: Database,
    *,
    title: str = "",
    model_fingerprint: str | None = None,
    model_name: str | None = None,
    system_prompt: str | None = None,
    settings: dict[str, Any] | None = None,
) -> Conversation:
    """Insert an empty conversation with a fresh id like ``c_8f3a2b`` (retries on the rare id clash)."""
    now = time.time()
    row = {
        "title": title,
        "model_fingerprint": model_fingerprint,
        "model_name": model_name,
        "system_prompt": system_prompt,
        "settings": json.dumps(settings or {}),
        "created": now,
        "updated": now,
    }
    for _ in range(8):
        row["id"] = "c_" + secrets.token_hex(3)
        try:
            with write_transaction(db):
                db["conversations"].insert(row)
            return get_conversation(db, row["id"])
        except sqlite3.IntegrityError:
            continue
    raise RuntimeError("could not find a free conversation id in 8 tries")


def get_conversation(db: Database, conv_id: str) -> Conversation:
    """The conversation with its token ids and messages (ordered by ``idx``).

    Raises:
        ConversationNotFoundError: no conversation has this id.
    """
    rows = list(db.query("SELECT * FROM conversations WHERE id = ?", [conv_id]))
    if not rows:
        raise ConversationNotFoundError(f"no conversation with id {conv_id!r}")
    r = rows[0]
    cols = ", ".join(f.name for f in fields(Message))
    messages = [Message(**m) for m in db.query(
        f"SELECT {cols} FROM messages WHERE conversation_id = ? ORDER BY idx", [conv_id])]
    return Conversation(
        id=r["id"],
        title=r["title"],
        model_fingerprint=r["model_fingerprint"],
        model_name=r["model_name"],
        system_prompt=r["system_prompt"],
        settings=json.loads(r["settings"] or "{}"),
        created=r["created"],
        updated=r["updated"],
        pinned=bool(r["pinned"]),
        token_ids=decode_token_ids(r["token_ids"]),
        token_ids_version=r["token_ids_version"],
        segments=[(s, e, k) for s, e, k in json.loads(r["segments"])],
        messages=messages,
    )


def append_turn(
    db: Database,
    conv_id: str,
    new_token_ids: Sequence[int],
    messages: Sequence[NewMessage],
    *,
    segment_kind: str = "turn",
    expected_version: int | None = None,
) -> int:
    """Append a turn: the token ids ADDED since the last turn (a delta) plus its messages, atomically.

    The new ids become segment ``(old_len, old_len + len(new_token_ids), segment_kind)``
    (no segment for an empty delta); each message's span is shifted by
    ``old_len``. Returns the new ``token_ids_version`` (old + 1).

    Raises:
        ConversationNotFoundError: unknown ``conv_id``.
        ConversationConflictError: ``expected_version`` given and the stored version
            differs (another writer appended first); nothing is written.
        ValueError: a message span is outside ``[0, len(new_token_ids)]``.
    """
    n_new = len(new_token_ids)
    for m in messages:
        if not 0 <= m.token_start <= m.token_end <= n_new:
            raise ValueError(f"message span [{m.token_start}, {m.token_end}) is outside the turn's {n_new} new tokens")
    delta = encode_token_ids(new_token_ids)
    with write_transaction(db):
        rows = list(db.query(
            "SELECT token_ids, token_ids_version, segments,"
            " (SELECT coalesce(max(idx), -1) FROM messages WHERE conversation_id = c.id) AS last_idx"
            " FROM conversations c WHERE id = ?",
            [conv_id],
        ))
        if not rows:
            raise ConversationNotFoundError(f"no conversation with id {conv_id!r}")
        r = rows[0]
        check_version(conv_id, r["token_ids_version"], expected_version)
        base = len(r["token_ids"]) // 4
        now = time.time()
        for i, m in enumerate(messages):
            db.execute(
                "INSERT INTO messages (conversation_id, idx, role, text, token_start, token_end, ttft_ms,"
                " decode_tokens_per_s, created, finish_reason, document_tokens)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [conv_id, r["last_idx"] + 1 + i, m.role, m.text, base + m.token_start, base + m.token_end,
                 m.ttft_ms, m.decode_tokens_per_s, now, m.finish_reason, m.document_tokens],
            )
        crash_point("message_insert")
        segments = json.loads(r["segments"])
        if n_new:
            segments.append([base, base + n_new, segment_kind])
        version = r["token_ids_version"] + 1
        db.execute(
            "UPDATE conversations SET token_ids = ?, token_ids_version = ?, segments = ?, updated = ? WHERE id = ?",
            [r["token_ids"] + delta, version, json.dumps(segments), now, conv_id],
        )
    return version


def check_version(conv_id: str, stored: int, expected: int | None) -> None:
    """Refuse a write computed on another version of the conversation's history.

    Raises:
        ConversationConflictError: ``expected`` is given and differs from ``stored``.
    """
    if expected is not None and stored != expected:
        raise ConversationConflictError(
            f"chat {conv_id} was changed by another kvchat while this turn was computed (stored version {stored}, "
            f"this turn saw version {expected}); nothing was stored: reopen the chat and ask again"
        )


def rewind_conversation(db: Database, conv_id: str, num_tokens: int, num_messages: int,
                        expected_version: int | None = None) -> int:
    """Cut a stored chat to its first ``num_tokens`` token ids and first ``num_messages`` messages.

    Runs in one write transaction (a savepoint when the caller holds one, so
    rewind and the replacing turn commit together). Returns the new
    ``token_ids_version``.

    Raises:
        ConversationNotFoundError: unknown ``conv_id``.
        ConversationConflictError: ``expected_version`` given and the stored version differs.
    """
    with write_transaction(db):
        rows = list(db.query("SELECT token_ids, token_ids_version, segments FROM conversations WHERE id = ?",
                             [conv_id]))
        if not rows:
            raise ConversationNotFoundError(f"no conversation with id {conv_id!r}")
        r = rows[0]
        check_version(conv_id, r["token_ids_version"], expected_version)
        db.execute("DELETE FROM messages WHERE conversation_id = ? AND idx >= ?", [conv_id, num_messages])
        segments = [[s, min(e, num_tokens), k] for s, e, k in json.loads(r["segments"]) if s < num_tokens]
        version = r["token_ids_version"] + 1
        db.execute(
            "UPDATE conversations SET token_ids = ?, token_ids_version = ?, segments = ?, updated = ? WHERE id = ?",
            [r["token_ids"][: 4 * num_tokens], version, json.dumps(segments), time.time(), conv_id],
        )
    return version


def list_conversations(db: Database, *, limit: int | None = None,
                       fingerprint_prefix: str | None = None) -> list[ConversationSummary]:
    """Conversations, pinned first, then most recently updated first; only those whose model fingerprint
    starts with ``fingerprint_prefix`` when given."""
    where = " WHERE substr(model_fingerprint, 1, ?) = ?" if fingerprint_prefix is not None else ""
    sql = (
        "SELECT id, title, model_name, created, updated, pinned, length(token_ids) / 4 AS num_tokens,"
        " (SELECT count(*) FROM messages m WHERE m.conversation_id = c.id) AS num_messages"
        f" FROM conversations c{where} ORDER BY pinned DESC, updated DESC"
    )
    params: list[Any] = [len(fingerprint_prefix), fingerprint_prefix] if fingerprint_prefix is not None else []
    if limit is not None:
        sql += " LIMIT ?"
        params.append(limit)
    return [ConversationSummary(**{**r, "pinned": bool(r["pinned"])}) for r in db.query(sql, params)]


def histories(db: Database, conv_ids: Sequence[str]) -> dict[str, list[int]]:
    """Per conversation of ``conv_ids`` that exists: its token ids."""
    if not conv_ids:
        return {}
    marks = ",".join("?" * len(conv_ids))
    rows = db.query(f"SELECT id, token_ids FROM conversations WHERE id IN ({marks})", list(conv_ids))
    return {r["id"]: decode_token_ids(r["token_ids"]) for r in rows}


def settings_of(db: Database, conv_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per conversation of ``conv_ids`` that exists: its settings."""
    if not conv_ids:
        return {}
    marks = ",".join("?" * len(conv_ids))
    rows = db.query(f"SELECT id, settings FROM conversations WHERE id IN ({marks})", list(conv_ids))
    return {r["id"]: json.loads(r["settings"] or "{}") for r in rows}


def set_settings(db: Database, conv_id: str, settings: dict[str, Any]) -> None:
    """Replace the conversation's settings (in the caller's transaction when it holds one).

    Raises ConversationNotFoundError."""
    with write_transaction(db):
        _update_one(db, conv_id, "UPDATE conversations SET settings = ? WHERE id = ?", [json.dumps(settings), conv_id])


def set_model(db: Database, conv_id: str, model_fingerprint: str, model_name: str) -> None:
    """Record the model a conversation goes on with (in the caller's transaction when it holds one).

    Raises ConversationNotFoundError."""
    with write_transaction(db):
        _update_one(db, conv_id, "UPDATE conversations SET model_fingerprint = ?, model_name = ? WHERE id = ?",
                    [model_fingerprint, model_name, conv_id])


def conversations_with_prefix(db: Database, token_ids: Sequence[int], model_fingerprint: str, *,
                              exact: bool = False, limit: int = 8) -> list[str]:
    """Ids of ``model_fingerprint``'s conversations whose token ids start with ``token_ids`` and are longer
    (``exact``: equal to them), most recently updated first, at most ``limit`` (negative: all)."""
    blob = encode_token_ids(token_ids)
    length = "length(token_ids) = ?" if exact else "length(token_ids) > ?"
    sql = (f"SELECT id FROM conversations WHERE model_fingerprint = ? AND substr(token_ids, 1, ?) = ? AND {length}"
           " ORDER BY updated DESC LIMIT ?")
    return [r["id"] for r in db.query(sql, [model_fingerprint, len(blob), blob, len(blob), limit])]


def search_conversations(db: Database, fts_query: str) -> set[str]:
    """Ids of conversations whose title or any message matches the FTS5 query ``fts_query`` (migration m003)."""
    sql = (
        "SELECT c.id FROM conversations c JOIN conversations_fts f ON f.rowid = c.rowid"
        " WHERE conversations_fts MATCH :q"
        " UNION SELECT m.conversation_id FROM messages m JOIN messages_fts f ON f.rowid = m.rowid"
        " WHERE messages_fts MATCH :q"
    )
    return {r["id"] for r in db.query(sql, {"q": fts_query})}


def _update_one(db: Database, conv_id: str, sql: str, params: list[Any]) -> None:
    """Run a single-row UPDATE/DELETE on conversation ``conv_id`` (last parameter); raise if it matched nothing."""
    if db.execute(sql, params).rowcount == 0:
        raise ConversationNotFoundError(f"no conversation with id {conv_id!r}")


def rename_conversation(db: Database, conv_id: str, title: str) -> None:
    """Set the title. Raises ConversationNotFoundError."""
    with write_transaction(db):
        _update_one(db, conv_id, "UPDATE conversations SET title = ?, updated = ? WHERE id = ?",
                    [title, time.time(), conv_id])


def pin_conversation(db: Database, conv_id: str, pinned: bool) -> None:
    """Set or clear the conversation's pinned flag. Raises ConversationNotFoundError."""
    with write_transaction(db):
        _update_one(db, conv_id, "UPDATE conversations SET pinned = ? WHERE id = ?", [int(pinned), conv_id])


def delete_conversation(db: Database, conv_id: str) -> None:
    """Delete the conversation and its messages (its KV chunks are the caller's: see ``chunk_index.unref_chunks``).

    Raises ConversationNotFoundError.
    """
    with write_transaction(db):
        db.execute("DELETE FROM messages WHERE conversation_id = ?", [conv_id])
        _update_one(db, conv_id, "DELETE FROM conversations WHERE id = ?", [conv_id])
