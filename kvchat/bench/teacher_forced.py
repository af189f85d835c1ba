"""Teacher-forced comparison of engines on a text: the protocol of ``kvchat bench fidelity`` (see its module doc),
shared by the fp8-pool and the int8-weight comparisons."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvchat.engine.inference import inference

SCORE_CHUNK_TOKENS = 512


@dataclass(slots=True)
class FidelityResult:
    """Sums over the scored positions of one text under one scheme (pool them by adding).

    A position is a token whose successor is in the text (``len - 1`` per text).
    """

    text: str
    scheme: str
    positions: int = 0
    nll_ref: float = 0.0
    nll: float = 0.0
    kl: float = 0.0
    top1_same: int = 0

    @property
    def ppl_ref(self) -> float:
        """Perplexity with the bf16 pool."""
        return math.exp(self.nll_ref / self.positions)

    @property
    def ppl(self) -> float:
        """Perplexity with this scheme's pool."""
        return math.exp(self.nll / self.positions)

    @property
    def ppl_delta_pct(self) -> float:
        """Perplexity change vs bf16, percent."""
        return (self.ppl / self.ppl_ref - 1.0) * 100.0

    @property
    def mean_kl(self) -> float:
        """Mean KL(bf16 ‖ scheme) per position, nats."""
        return self.kl / self.positions

    @property
    def top1_agreement(self) -> float:
        """Share of positions with the same argmax token as bf16."""
        return self.top1_same / self.positions

    def add(self, other: FidelityResult) -> None:
        """Accumulate ``other``'s sums (pooling texts)."""
        self.positions += other.positions
        self.nll_ref += other.nll_ref
        self.nll += other.nll
        self.kl += other.kl
        self.top1_same += other.top1_same

    def as_dict(self) -> dict:
        """JSON-ready figures."""
        return {"text": self.text, "scheme": self.scheme, "positions": self.positions,
                "ppl_bf16": round(self.ppl_ref, 4), "ppl": round(self.ppl, 4),
                "ppl_delta_pct": round(self.ppl_delta_pct, 3), "mean_kl": round(self.mean_kl, 5),
                "top1_agreement": round(self.top1_agreement, 4)}


@inference()
def compare_to_reference(
    ref_engine,
    runs: Sequence[tuple[object, object]],
    token_ids: Sequence[int],
    text_name: str = "",
    chunk_tokens: int = SCORE_CHUNK_TOKENS,
) -> list[FidelityResult]:
    """Teacher-forced comparison of fp8 schemes against a 16-bit reference pool.

    The text is scored in chunks of ``chunk_tokens`` (each chunk writes its
    K/V, then attends through the pool to everything before it and to
    itself); reference and schemes advance chunk by chunk, so only one
    chunk's logits (``[chunk_tokens, vocab_size]`` fp32 per engine) are alive.

    Args:
        ref_engine: :class:`kvchat.engine.runner.Engine` with a bf16 (or fp16) pool.
        runs: ``(scheme, engine running it)`` pairs; a scheme has a ``name`` and an ``active()`` context
            (:class:`kvchat.bench.kv_schemes.KVScheme`, :class:`kvchat.bench.weight_fidelity.WeightRun`).
        token_ids: the text, at least 2 ids.
        text_name: label for the results.
    Returns:
        one :class:`FidelityResult` per run, ``len(token_ids) - 1`` positions each.
    Raises:
        ValueError: fewer than 2 tokens; kvchat.engine.block_manager.PoolFullError: a pool too small.
    """
    from kvchat.engine.block_manager import SeqBlocks

    ids, total = list(token_ids), len(token_ids)
    if total < 2:
        raise ValueError("a fidelity text needs at least 2 tokens")
    ref_seq, seqs = SeqBlocks(), [SeqBlocks() for _ in runs]
    results = [FidelityResult(text_name, scheme.name) for scheme, _ in runs]
    try:
        for start in range(0, total, chunk_tokens):
            end = min(start + chunk_tokens, total)
            rows = min(end, total - 1) - start  # the last token predicts nothing
            targets = torch.tensor(ids[start + 1 : start + 1 + rows])
            logp_ref = torch.log_softmax(ref_engine.score(ref_seq, ids[:end])[:rows], dim=-1)
            top_ref = logp_ref.argmax(-1)
            nll_ref = -logp_ref.gather(-1, targets[:, None]).sum().item()
            for (scheme, engine), seq, res in zip(runs, seqs, results):
                with scheme.active():
                    logits = engine.score(seq, ids[:end])[:rows]
                logp = torch.log_softmax(logits, dim=-1)
                res.positions += rows
                res.nll_ref += nll_ref
                res.nll += -logp.gather(-1, targets[:, None]).sum().item()
                res.kl += (logp_ref.exp() * (logp_ref - logp)).sum().item()
                res.top1_same += int((logp.argmax(-1) == top_ref).sum())
    finally:
        ref_engine.release(ref_seq)
        for (_, engine), seq in zip(runs, seqs):
            engine.release(seq)
    return results
