"""Events a backend emits while it works (model load, prefill, streamed answer, finished turn)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvchat.engine.turn import TurnStats


@dataclass(slots=True)
class LoadProgress:
    """A step of startup (importing the default model, loading weights), as a line of text.

    ``total`` > 0 for a step of a longer job (the first-run import): ``done``
    of ``total`` steps are finished, so the UI can show a progress bar.
    """

    message: str
    done: int = 0
    total: int = 0


@dataclass(slots=True)
class AttachStep:
    """A step of a document attach before its prefill (reading the files, tokenizing them), as a line of text."""

    message: str


@dataclass(slots=True)
class PrefillProgress:
    """Prefill of a document or a long message: ``done`` of ``total`` tokens; ``eta_s`` seconds left (None at first)."""

    done: int
    total: int
    eta_s: float | None


@dataclass(slots=True)
class TokenBatch:
    """Answer text generated since the previous batch."""

    text: str


@dataclass(slots=True)
class TurnDone:
    """The answer is complete (``stats.finish_reason`` says why); the turn is stored under ``chat_id`` (None
    when the service does not store). Emitted before the answer's recompute and snapshot
    (``stats.settle_ms`` is filled in afterwards)."""

    chat_id: str | None
    text: str
    stats: TurnStats
    context_used: int
    context_limit: int


BackendEvent = LoadProgress | AttachStep | PrefillProgress | TokenBatch | TurnDone
Emit = Callable[[BackendEvent], None]
