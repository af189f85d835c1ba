"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus, Holtzman et al. 2020)."""

from __future__ import annotations

import torch

from kvchat.engine.turn import SamplingParams


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
