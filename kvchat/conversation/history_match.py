"""Stored chats looked up by token ids, for a front-end that is given a whole history (``kvchat serve``).

An API client resends the conversation every turn. Two questions about it go to
the store: which stored chat holds exactly these ids (the request continues
it), and which ids kvchat generated right after a given prefix for an answer
whose text the client resent (so the history is rebuilt token-exactly, see
:mod:`kvchat.server.prefix`). Both answer with plain values; the SQL stays in
:mod:`kvchat.store.conversations`.
"""

from __future__ import annotations

from kvchat.index import get_db
from kvchat.store.conversations import conversations_with_prefix, get_conversation

THINK_END = "</think>"
ALL = -1  # conversations_with_prefix: SQLite's LIMIT -1 has no upper bound


def strip_think(text: str) -> str:
    """``text`` as reasoning-dropping templates resend it: what follows the last ``</think>``, leading newlines
    removed (Qwen3's ``content.split('</think>')[-1].lstrip('\\n')``); ``text`` itself without a think block."""
    return text.rsplit(THINK_END, 1)[-1].lstrip("\n") if THINK_END in text else text


def chat_with_ids(token_ids: list[int], model_fingerprint: str) -> str | None:
    """Id of the most recently updated stored chat of this model whose ids equal ``token_ids``; None if none."""
    found = conversations_with_prefix(get_db(), token_ids, model_fingerprint, exact=True, limit=1)
    return found[0] if found else None


def generated_answer(token_ids: list[int], text: str, model_fingerprint: str) -> list[int] | None:
    """The ids of an assistant segment that starts right after ``token_ids`` in a stored chat of this model and
    whose stored text equals ``text`` (or, stripped of its think block, equals it); None if there is none.

    Every chat sharing the prefix is searched (many may: the same first question asked again), newest first.
    """
    db, start = get_db(), len(token_ids)
    for conv_id in conversations_with_prefix(db, token_ids, model_fingerprint, limit=ALL):
        conv = get_conversation(db, conv_id)
        seg = next((s for s in conv.segments if s[0] == start), None)
        if seg is None or seg[2] != "assistant":
            continue
        msg = next((m for m in conv.messages if m.role == "assistant" and m.token_start == start), None)
        if msg is not None and text in (msg.text, strip_think(msg.text)):
            return conv.token_ids[seg[0]:seg[1]]
    return None
