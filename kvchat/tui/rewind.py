"""Cutting a chat back to an earlier turn (regenerate, edit) and carrying its last turns into a new chat.

A chat's layout is ``[prefix][user 1][assistant 1]...`` (``kvchat.chat_format``),
with messages stored as user/assistant pairs, turn ``i`` owning messages
``2i`` and ``2i + 1``. Token ids stay the source of truth: carried turns are
copied as ids, never re-rendered.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from sqlite_utils import Database

from kvchat.chat_format import Segment
from kvchat.session import Session
from kvchat.store.conversations import (
    Conversation,
    NewMessage,
    append_turn,
    create_conversation,
)
from kvchat.store.db import write_transaction
from kvchat.store.errors import ConversationNotFoundError


@dataclass(slots=True)
class TurnSpan:
    """Turn ``index`` (0-based): its user segment starts at token ``start``; it ends at ``end``."""

    index: int
    start: int
    end: int


def turn_spans(segments: list[Segment]) -> list[TurnSpan]:
    """The chat's turns, from its segments (a turn = a user segment and the assistant one after it)."""
    spans: list[TurnSpan] = []
    for seg in segments:
        if seg.kind == "user":
            spans.append(TurnSpan(len(spans), seg.start, seg.end))
        elif seg.kind == "assistant" and spans:
            spans[-1].end = seg.end
    return spans


def truncate_session(session: Session, num_tokens: int) -> None:
    """Cut ``session`` to its first ``num_tokens`` tokens, keeping their KV.

    The block manager forks the sequence at ``num_tokens`` (the kept blocks'
    ref counts go up), then the old sequence is released, so only the cut-off
    tail returns to the pool; a shared or cached block is copied on write
    when the next turn appends into it. Segments are cut at ``num_tokens``.
    """
    engine = session.engine
    child = engine.blocks.fork(session.seq, num_tokens)
    engine.release(session.seq)
    session.seq = child
    del session.token_ids[num_tokens:]
    session.segments = [Segment(s.kind, s.start, min(s.end, num_tokens))
                        for s in session.segments if s.start < num_tokens]
    session.last_turn = None


def rewind_store(db: Database, conv_id: str, num_tokens: int, num_messages: int) -> int:
    """Cut a stored chat to its first ``num_tokens`` token ids and first ``num_messages`` messages.

    Runs in one write transaction (a savepoint when the caller holds one, so
    rewind and the replacing turn commit together). Returns the new
    ``token_ids_version``.

    Raises:
        ConversationNotFoundError: unknown ``conv_id``.
    """
    with write_transaction(db):
        rows = list(db.query("SELECT token_ids, token_ids_version, segments FROM conversations WHERE id = ?",
                             [conv_id]))
        if not rows:
            raise ConversationNotFoundError(f"no conversation with id {conv_id!r}")
        r = rows[0]
        db.execute("DELETE FROM messages WHERE conversation_id = ? AND idx >= ?", [conv_id, num_messages])
        segments = [[s, min(e, num_tokens), k] for s, e, k in json.loads(r["segments"]) if s < num_tokens]
        version = r["token_ids_version"] + 1
        db.execute(
            "UPDATE conversations SET token_ids = ?, token_ids_version = ?, segments = ?, updated = ? WHERE id = ?",
            [r["token_ids"][: 4 * num_tokens], version, json.dumps(segments), time.time(), conv_id],
        )
    return version


def carry_over(db: Database, conv: Conversation, keep_turns: int, max_tokens: int) -> tuple[str, int]:
    """Store a new chat = ``conv``'s prefix + its last ``keep_turns`` turns, fewer if they exceed ``max_tokens``.

    Ids and message texts are copied (no re-tokenization), so the copied
    prefix is a prefix hit in the pool. Returns ``(new chat id, turns kept)``.

    Raises:
        ValueError: the prefix alone exceeds ``max_tokens``.
    """
    segments = [Segment(k, s, e) for s, e, k in conv.segments]
    prefix = segments[0] if segments and segments[0].kind == "prefix" else Segment("prefix", 0, 0)
    if prefix.end > max_tokens:
        raise ValueError(f"the chat's system prompt and documents are {prefix.end:,} tokens; "
                         f"a new chat can hold {max_tokens:,}")
    turns = turn_spans(segments)
    kept = turns[max(0, len(turns) - keep_turns):]
    while kept and prefix.end + sum(t.end - t.start for t in kept) > max_tokens:
        kept = kept[1:]
    ids = conv.token_ids
    with write_transaction(db):
        new = create_conversation(db, title=f"{conv.title} (continued)", model_fingerprint=conv.model_fingerprint,
                                  model_name=conv.model_name, system_prompt=conv.system_prompt, settings=conv.settings)
        append_turn(db, new.id, ids[prefix.start:prefix.end], [], segment_kind="prefix")
        for turn in kept:
            user, answer = conv.messages[2 * turn.index], conv.messages[2 * turn.index + 1]
            split = answer.token_start
            append_turn(db, new.id, ids[turn.start:split], [NewMessage("user", user.text, 0, split - turn.start)],
                        segment_kind="user")
            append_turn(db, new.id, ids[split:turn.end],
                        [NewMessage("assistant", answer.text, 0, turn.end - split, answer.ttft_ms,
                                    answer.decode_tokens_per_s)],
                        segment_kind="assistant")
    return new.id, len(kept)
