"""An API request's messages as a conversation's token ids, mapped back to the ids kvchat generated.

Clients resend the whole history every turn, the assistant's answers as text.
Re-tokenizing that text need not give the ids the model produced (". " +
"\\n\\n" vs ".\\n\\n"), and some templates drop reasoning from history (Qwen3
strips ``<think>…</think>``), so rendering the messages again would miss the
cached prefix. Instead the history is built append-only, as a chat is
(:mod:`kvchat.model.chat_format`): the system prompt as the prefix segment,
each user message as a user turn, and each assistant message — when its text
equals one kvchat generated right after the same ids in a stored chat (or that
text with its think block stripped, as such templates resend it) — as exactly
the ids kvchat produced. Only an answer kvchat never generated there is
tokenized from its text, and :attr:`Rendered.drift` says where.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvchat.model.chat_format import ChatFormat, Segment, UserTurn, append_segment


@dataclass(slots=True)
class Rendered:
    """A request's conversation before its last user message.

    Attributes:
        history: per earlier turn ``(user text, assistant text, assistant ids)``.
        token_ids: prefix + history ids (the final user turn not included).
        drift: where the history stops matching what kvchat generated, or None.
        user_turns: the earlier user messages as rendered (:meth:`ChatFormat.user_turn`), one per turn.
    """

    history: list[tuple[str, str, list[int]]]
    token_ids: list[int]
    drift: str | None = None
    user_turns: list[UserTurn] = field(default_factory=list)


def render(fmt: ChatFormat, system: str, turns: Sequence[tuple[str, str]],
           generated: Callable[[list[int], str], list[int] | None], roles: Sequence[str] = ()) -> Rendered:
    """Build the ids of ``system`` + ``turns`` ``(user, assistant)`` append-only; ``roles``: the role each
    turn's user-side message renders as (:meth:`ChatFormat.user_turn`'s; default ``"user"`` for all).

    ``generated(ids, text)`` gives the ids kvchat generated right after ``ids`` whose text is ``text``
    (None if none): see :func:`kvchat.conversation.history_match.generated_answer`.
    """
    ids: list[int] = []
    segments: list[Segment] = []
    append_segment(ids, segments, "prefix", fmt.prefix_ids(system, []))
    history, drift, user_turns = [], None, []
    for k, (user, answer) in enumerate(turns, 1):
        user_turns.append(fmt.user_turn(user, roles[k - 1] if roles else "user"))
        append_segment(ids, segments, "user", user_turns[-1].ids)
        found = generated(ids, answer)
        if found is None:
            found = fmt.assistant_text_ids(answer)
            if drift is None:
                drift = (f"assistant message {k} (token {len(ids)}) is not an answer kvchat generated after this "
                         "history: its text was tokenized, so cached K/V stop there")
        append_segment(ids, segments, "assistant", found)
        history.append((user, answer, found))
    return Rendered(history, ids, drift, user_turns)
