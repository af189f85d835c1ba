"""A sequence: token ids, segments and block table together, plus the steps a turn asks the engine for.

A turn is a generator (:meth:`kvchat.engine.session.Session.turn`) that yields
text pieces and two kinds of step: :class:`PrefillChunk` after each prefill
chunk (the engine loop may run other sequences' decode steps there) and
:class:`DecodeStep` when it needs the logits of its last token. The engine
loop (:class:`kvchat.engine.loop.EngineLoop`) gathers the ``DecodeStep`` of
every running sequence and answers them with one forward
(:meth:`kvchat.engine.runner.Engine.decode_batch`), a lone one as a batch of one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvchat.engine.block_manager import SeqBlocks
from kvchat.engine.dense_kv import DenseKV
from kvchat.model.chat_format import Segment

if TYPE_CHECKING:
    from kvchat.engine.sampling import Sampler


@dataclass(slots=True)
class Sequence:
    """One conversation's state in the engine.

    Attributes:
        token_ids: the whole conversation, ids (the source of truth).
        segments: prefix, then one user and one assistant segment per turn.
        blocks: its block table in the engine's pool.
        dense: its own contiguous K/V copy (CPU read path) when several
            sequences run at once; None: the engine's shared copy.
        document_ends: token offsets where a pasted document's part of a user message ends
            (:meth:`kvchat.model.chat_format.ChatFormat.user_turn`): prefill chunk edges and snapshot tails.
    """

    token_ids: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    blocks: SeqBlocks = field(default_factory=SeqBlocks)
    dense: DenseKV | None = None
    document_ends: list[int] = field(default_factory=list)


@dataclass(slots=True)
class DecodeStep:
    """A turn waiting for the logits of the last id of ``token_ids`` (every earlier id is in the pool).

    The caller sends back the logits (float32 ``[vocab_size]``) or, having sampled them with ``sampler``
    itself (a batch's ids in one host read, :func:`kvchat.engine.sampling.sample_rows`), the next id.

    Attributes:
        sequence: whose blocks (and dense copy) the step writes.
        token_ids: the sequence's ids so far, generated ones included.
        sampler: the turn's sampler, or None.
    """

    sequence: Sequence
    token_ids: list[int]
    sampler: "Sampler | None" = None


@dataclass(slots=True)
class PrefillChunk:
    """A turn's prefill has computed ``done`` of its ``total`` tokens, ``tokens`` of them in this chunk.

    ``settle``: the chunk recomputes an answer already streamed (:meth:`kvchat.engine.session.Session.turn`),
    so it is no prefill progress to show; a scheduler runs it between other sequences' decode steps too.
    """

    done: int
    total: int
    tokens: int
    settle: bool = False

