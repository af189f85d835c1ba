"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus, Holtzman et al. 2020)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` means greedy (argmax).

    Attributes:
        temperature: softmax temperature (> 0 samples).
        top_p: keep the smallest set of tokens whose probability mass ≥ top_p.
        top_k: keep the k most likely tokens (0 = all).
        seed: seeds a private ``torch.Generator`` so runs are reproducible.
        max_tokens: new tokens at most.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 512

    def validate(self) -> None:
        """Raise ``ValueError`` with a one-line message on out-of-range values."""
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max tokens must be >= 1, got {self.max_tokens}")


class Sampler:
    """Stateful sampler (owns the seeded generator for one generation)."""

    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick one token id from float32 ``logits`` ``[vocab_size]``."""
        p = self.params
        if p.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits.float().cpu() / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
            sorted_p[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))
