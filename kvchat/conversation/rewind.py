"""A chat's turns from its segments (for regenerate and edit) and carrying its last turns into a new chat.

Cutting the session is :meth:`kvchat.engine.session.Session.truncate`; cutting the
stored chat is :func:`kvchat.store.conversations.rewind_conversation`.

A chat's layout is ``[prefix][user 1][assistant 1]...`` (``kvchat.model.chat_format``),
with messages stored as user/assistant pairs, turn ``i`` owning messages
``2i`` and ``2i + 1``. Token ids stay the source of truth: carried turns are
copied as ids, never re-rendered.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlite_utils import Database

from kvchat.model.chat_format import Segment
from kvchat.store.conversations import (
    Conversation,
    NewMessage,
    append_turn,
    create_conversation,
)
from kvchat.store.db import write_transaction


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


def carry_over(db: Database, conv: Conversation, keep_turns: int, max_tokens: int,
               prefix_ids: list[int] | None = None, settings: dict | None = None) -> tuple[str, int]:
    """Store a new chat = ``conv``'s prefix + its last ``keep_turns`` turns, fewer if they exceed ``max_tokens``.

    Ids and message texts are copied (no re-tokenization), so the copied
    prefix is a prefix hit in the pool. ``prefix_ids`` and ``settings``: the
    new chat's own prefix (e.g. the system prompt without the documents) and
    settings, in place of ``conv``'s; a user turn's ids do not depend on the
    prefix before it (``kvchat.model.chat_format``), so the turns are copied
    as they are. Returns ``(new chat id, turns kept)``.

    Raises:
        ValueError: the prefix alone exceeds ``max_tokens``.
    """
    segments = [Segment(k, s, e) for s, e, k in conv.segments]
    prefix = segments[0] if segments and segments[0].kind == "prefix" else Segment("prefix", 0, 0)
    ids = conv.token_ids
    new_prefix = ids[prefix.start:prefix.end] if prefix_ids is None else prefix_ids
    if len(new_prefix) > max_tokens:
        raise ValueError(f"the chat's system prompt and documents are {len(new_prefix):,} tokens; "
                         f"a new chat can hold {max_tokens:,} beside the next message and its answer")
    turns = turn_spans(segments)
    kept = turns[max(0, len(turns) - keep_turns):]
    while kept and len(new_prefix) + sum(t.end - t.start for t in kept) > max_tokens:
        kept = kept[1:]
    with write_transaction(db):
        new = create_conversation(db, title=f"{conv.title} (continued)", model_fingerprint=conv.model_fingerprint,
                                  model_name=conv.model_name, system_prompt=conv.system_prompt,
                                  settings=conv.settings if settings is None else settings)
        append_turn(db, new.id, new_prefix, [], segment_kind="prefix")
        for turn in kept:
            user, answer = conv.messages[2 * turn.index], conv.messages[2 * turn.index + 1]
            split = answer.token_start
            append_turn(db, new.id, ids[turn.start:split], [NewMessage("user", user.text, 0, split - turn.start,
                                                                     document_tokens=user.document_tokens)],
                        segment_kind="user")
            append_turn(db, new.id, ids[split:turn.end],
                        [NewMessage("assistant", answer.text, 0, turn.end - split, answer.ttft_ms,
                                    answer.decode_tokens_per_s, answer.finish_reason)],
                        segment_kind="assistant")
    return new.id, len(kept)
