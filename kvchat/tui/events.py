"""Events a backend emits while it works (model load, prefill, streamed answer, finished turn)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(slots=True)
class TurnMetrics:
    """Counters of one turn (mirrors ``kvchat.session.TurnStats`` field for field; tokens, ms, bytes)."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    from_memory: int = 0
    from_disk: int = 0
    restore_ms: float = 0.0
    bytes_read: int = 0
    miss_reason: str | None = None
    prefilled_tokens: int = 0
    new_tokens: int = 0
    ttft_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    finish_reason: str = ""


@dataclass(slots=True)
class LoadProgress:
    """A step of startup (importing the default model, loading weights), as a line of text."""

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
    """The answer is complete (``stats.finish_reason`` says why); the turn is stored under ``chat_id``."""

    chat_id: str
    text: str
    stats: TurnMetrics
    context_used: int
    context_limit: int


BackendEvent = LoadProgress | PrefillProgress | TokenBatch | TurnDone
Emit = Callable[[BackendEvent], None]
