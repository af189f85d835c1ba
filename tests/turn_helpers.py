"""Test helpers: a bare :class:`kvchat.engine.session.Session`'s turn, or an engine's prefill, run on an
engine loop of its own (the engine runs only on an engine loop's thread)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Callable

from kvchat.engine.block_manager import SeqBlocks
from kvchat.engine.dense_kv import DenseKV
from kvchat.engine.loop import run_alone
from kvchat.engine.runner import Engine, PrefillResult
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.session import Session, Turn
from kvchat.engine.turn import TurnStats


def run_turn(session: Session, text: str, params: SamplingParams, cancel: threading.Event | None = None,
             progress: Callable[[int, int], None] | None = None) -> Turn:
    """Answer ``text`` in ``session`` (:meth:`Session.turn`) on a new engine loop over its engine, stopped
    after; returns :attr:`Session.last_turn`, after checking that the streamed pieces add up to its text.
    ``progress(done, total)``: after each prefill chunk of the prompt. Raises what the turn raises."""
    pieces: list[str] = []
    run_alone(session.engine, session.turn(text, params, cancel), progress, pieces.append)
    assert "".join(pieces) == session.last_turn.text, "the streamed pieces add up to the final text"
    return session.last_turn


def run_prefix(session: Session) -> TurnStats:
    """:meth:`Session.prefix_steps` on a new engine loop over its engine, stopped after; its ``TurnStats``."""
    return run_alone(session.engine, session.prefix_steps())


def prefill(engine: Engine, seq: SeqBlocks, token_ids: Sequence[int], boundaries: Sequence[int] = (),
            dense_kv: DenseKV | None = None) -> PrefillResult:
    """:meth:`Engine.prefill_steps` to their end on a new engine loop over ``engine``, stopped after: the
    tokens of ``token_ids`` not yet in ``seq``'s blocks computed in the cold chunk plan of ``boundaries``;
    returns the :class:`PrefillResult` (float32 last-token logits ``[vocab_size]``). Raises what the prefill
    raises (ContextFullError, PoolFullError)."""
    return run_alone(engine, engine.prefill_steps(seq, token_ids, boundaries, dense_kv))
