"""Producers of streaming events for backend implementations: token batches and prefill progress with an ETA."""

from __future__ import annotations

import time

from kvchat.conversation.events import Emit, PrefillProgress, TokenBatch
from kvchat.progress import rate_and_eta


class TokenBatcher:
    """Coalesces streamed text pieces into :class:`TokenBatch` events, at most one per ``interval_s``."""

    def __init__(self, emit: Emit, interval_s: float = 0.04):
        self.emit = emit
        self.interval_s = interval_s
        self._pieces: list[str] = []
        self._last = time.perf_counter()

    def add(self, piece: str) -> None:
        """Queue a piece; emit the batch when ``interval_s`` has passed since the last one."""
        self._pieces.append(piece)
        if time.perf_counter() - self._last >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        """Emit what is queued (nothing if empty)."""
        text = "".join(self._pieces)
        self._pieces.clear()
        self._last = time.perf_counter()
        if text:
            self.emit(TokenBatch(text))


class PrefillTimer:
    """Turns the engine's ``progress(done, total)`` callback into :class:`PrefillProgress` with an ETA.

    ETA: :func:`kvchat.progress.rate_and_eta`, the rate counted from this timer's start.
    """

    def __init__(self, emit: Emit):
        self.emit = emit
        self._t0 = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        _, eta = rate_and_eta(done, time.perf_counter() - self._t0, total - done)
        self.emit(PrefillProgress(done, total, eta))
