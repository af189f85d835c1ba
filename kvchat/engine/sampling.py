"""Next-token sampling on the logits' device: presence and frequency penalties (the OpenAI API's), greedy,
temperature, top-k, top-p (nucleus, Holtzman et al. 2020).

Every operation runs where the logits are (a GPU's decode never copies its ``[vocab_size]`` row to the
host); the sampled id is the one value read back, one host sync per step, and one for all rows of a
batched step (:func:`sample_rows`). Random draws use a ``torch.Generator`` on the logits' device, seeded
from the sampler's seed, so a seeded run repeats on one device; on a CPU the draws are the ones this
module made when it sampled on the host (same generator, same operations).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvchat.engine.turn import SamplingParams


class Sampler:
    """Stateful sampler for one generation (one sequence of a batch): owns the seeded generator and, with a
    presence or frequency penalty, the count of each token id it has picked so far.

    The penalties are the OpenAI API's (API reference, "Parameter details",
    https://platform.openai.com/docs/api-reference/parameter-details: ``mu[j] -> mu[j] - c[j] *
    alpha_frequency - float(c[j] > 0) * alpha_presence``, ``c[j]`` how often token ``j`` was sampled before
    the current position), applied to the logits before temperature, top-k and top-p; the counts are this
    generation's tokens (the prompt is not counted). Positive values make repeats less likely, negative ones
    more likely.
    """

    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self._counts: torch.Tensor | None = None  # float32 [vocab_size] on the logits' device, once penalized
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def _generator(self, device: torch.device) -> torch.Generator:
        """The generator on ``device``: the CPU one, or one made once per generation on another device and
        seeded with the CPU one's seed."""
        if self.generator.device != device:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.generator.initial_seed())
            self.generator = gen
        return self.generator

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The chosen id of float32 ``logits`` ``[vocab_size]`` as an int64 0-d tensor on their device
        (nothing read back: no host sync); with a penalty, the id is counted for the next picks."""
        p = self.params
        if not (p.presence_penalty or p.frequency_penalty):
            return self._choose(logits)
        if self._counts is None:
            self._counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
        c = self._counts
        chosen = self._choose(logits.float() - c * p.frequency_penalty - (c > 0).float() * p.presence_penalty)
        c.index_add_(0, chosen.view(1), torch.ones(1, dtype=c.dtype, device=c.device))
        return chosen

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        """:meth:`pick` after the penalties: greedy, or temperature, top-k, top-p and one draw."""
        p = self.params
        if p.temperature == 0:
            return torch.argmax(logits)
        logits = logits.float() / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
            sorted_p.masked_fill_(drop, 0)  # not sorted_p[drop] = 0: a boolean index reads the mask back
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return torch.multinomial(probs, 1, generator=self._generator(probs.device))[0]

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick one token id from float32 ``logits`` ``[vocab_size]`` (one host sync: the id)."""
        return int(self.pick(logits).item())


def sample_rows(samplers: Sequence[Sampler], logits: torch.Tensor) -> list[int]:
    """One id per row of float32 ``logits`` ``[len(samplers), vocab_size]``, row ``i`` by ``samplers[i]``;
    all ids come back in one host read."""
    return torch.stack([s.pick(row) for s, row in zip(samplers, logits)]).tolist()
