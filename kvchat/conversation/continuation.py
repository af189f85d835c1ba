"""How a full chat goes on in a new chat: what each way carries, whether it fits, and the lines that say so.

Torch-free arithmetic on token counts, shared by every front-end and by the fake backend. A new chat holds a
prefix (the old chat's system prompt, with or without its documents), then whole turns from the end of the old
chat (copied as ids), and keeps :attr:`Continuation.room` tokens free: the message waiting to be sent plus an
answer of :func:`answer_room` tokens. All counts are on the engine's real context limit
(:attr:`kvchat.engine.runner.Engine.max_context`).

The ways (:data:`WAYS`):

- ``all``: the system prompt, the documents and as many last turns as fit (at least one);
- ``turns``: the system prompt and as many last turns as fit, without the documents (a chat with documents);
- ``documents``: the system prompt and the documents, no turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvchat.conversation.views import ContextFullError

CarryWay = Literal["all", "turns", "documents"]
WAYS: tuple[CarryWay, ...] = ("all", "turns", "documents")
ANSWER_ROOM_TOKENS = 256  # tokens kept free for the answer in a new chat (the generation's max_tokens if fewer)


def answer_room(max_tokens: int) -> int:
    """Tokens a new chat keeps free for the answer: ``max_tokens``, at most :data:`ANSWER_ROOM_TOKENS` (a full
    ``max_tokens`` of 512 would rule out a new chat on documents that leave a few hundred tokens)."""
    return min(max_tokens, ANSWER_ROOM_TOKENS)


def _turns(n: int) -> str:
    return "the last turn" if n == 1 else f"the last {n:,} turns"


@dataclass(frozen=True, slots=True)
class Continuation:
    """A full chat's numbers, in tokens: ``prefix`` (system prompt + documents), ``bare_prefix`` (the system
    prompt alone), ``turns`` (each stored turn, oldest first), ``message`` (the message waiting, 0 if none),
    ``answer`` (room for its answer), ``limit`` (the context). ``documents``: how many the chat has."""

    chat_id: str
    limit: int
    prefix: int
    bare_prefix: int
    documents: int
    turns: tuple[int, ...]
    message: int
    answer: int

    @property
    def room(self) -> int:
        """Tokens a new chat keeps free: the message and its answer."""
        return self.message + self.answer

    def _base(self, way: CarryWay) -> int:
        return self.bare_prefix if way == "turns" else self.prefix

    def carried_turns(self, way: CarryWay) -> int:
        """How many last turns ``way`` carries: as many as fit after its prefix with :attr:`room` left (0 for
        ``documents``)."""
        if way == "documents":
            return 0
        total, n = self._base(way) + self.room, 0
        for t in reversed(self.turns):
            if total + t > self.limit:
                break
            total, n = total + t, n + 1
        return n

    def tokens(self, way: CarryWay) -> int:
        """The new chat's length before the message: its prefix plus the turns it carries."""
        n = self.carried_turns(way)
        return self._base(way) + sum(self.turns[len(self.turns) - n:])

    def fits(self, way: CarryWay) -> bool:
        """Whether ``way`` exists here: ``all`` and ``turns`` carry at least one turn (``turns`` only for a chat
        with documents), ``documents`` leaves :attr:`room` after the prefix."""
        if way == "documents":
            return self.prefix + self.room <= self.limit
        if way == "turns" and not self.documents:
            return False
        return self.carried_turns(way) > 0

    def offered(self) -> list[CarryWay]:
        """The ways a front-end offers: ``all`` when it fits, else those of ``turns`` and ``documents`` that do."""
        if self.fits("all"):
            return ["all"]
        return [w for w in ("turns", "documents") if self.fits(w)]

    def describe(self, way: CarryWay) -> str:
        """What ``way`` carries, e.g. ``the documents and the last 2 turns`` (its real count)."""
        n = self.carried_turns(way)
        if way == "all":
            return f"the documents and {_turns(n)}" if self.documents else f"the system prompt and {_turns(n)}"
        if way == "turns":
            return f"{_turns(n)}, without the documents"
        return "the documents alone" if self.documents else "the system prompt alone"

    def room_text(self) -> str:
        """E.g. ``room for the message (5 tokens) and an answer of 256``."""
        message = f"the message ({self.message:,} tokens) and " if self.message else ""
        return f"room for {message}an answer of {self.answer:,}"

    def no_room_line(self) -> str:
        """Why ``all`` carries nothing, with the numbers (one line, no final period)."""
        what = "system prompt and documents are" if self.documents else "system prompt is"
        line = f"the {what} {self.prefix:,} of {self.limit:,} tokens"
        if self.prefix + self.room > self.limit:
            return f"{line}: no {self.room_text()} even without the turns"
        last = self.turns[-1] if self.turns else 0
        them = "them" if self.documents else "it"
        return f"{line}: the last turn ({last:,} tokens) does not fit beside {them} with {self.room_text()}"

    def choice_text(self, way: CarryWay) -> str:
        """A way as offered: what it carries and its length, e.g. ``the last turn, without the documents:
        412 of 8,192 tokens``."""
        return f"{self.describe(way)}: {self.tokens(way):,} of {self.limit:,} tokens"

    def why_not(self, way: CarryWay) -> str:
        """Why ``way`` does not fit, with the numbers (one line, no final period)."""
        if way == "turns" and not self.documents:
            return "the chat has no documents to leave out"
        if way == "turns":
            last = self.turns[-1] if self.turns else 0
            return (f"the system prompt alone is {self.bare_prefix:,} of {self.limit:,} tokens: the last turn "
                    f"({last:,} tokens) does not fit beside it with {self.room_text()}")
        return self.no_room_line()

    def ways_text(self, option: str = "") -> str:
        """The offered ways, each named ``option`` + its name, e.g. ``--new-chat turns (the last turn, without the
        documents: 412 of 8,192 tokens) or --new-chat documents (…)``; "" when none fits."""
        return " or ".join(f"{option}{w} ({self.choice_text(w)})" for w in self.offered())

    def full_hint(self, option: str = "") -> str:
        """What a full chat's error line adds: the ways on (named as in :meth:`ways_text`), after why ``all`` does
        not fit when it does not."""
        ways = self.offered()
        if ways == ["all"]:
            return f"continue in a new chat with {self.ways_text(option)}"
        why = self.no_room_line()
        return f"{why}; continue in a new chat with {self.ways_text(option)}" if ways else f"{why}; no new chat fits"

    def error(self, way: CarryWay, option: str = "") -> ContextFullError:
        """The error for choosing ``way`` where it does not fit: why, then the ways that do (one line)."""
        ways = self.ways_text(option)
        tail = f"; the ways that fit: {ways}" if ways else "; no new chat fits"
        needed = self._base(way) + (self.turns[-1] if way != "documents" and self.turns else 0) + self.room
        name = f"{option}{way}" if option else f"a new chat with {self.describe(way)}"
        return ContextFullError(f"{name} does not fit: {self.why_not(way)}{tail}", needed, self.limit)
