"""Presence and frequency penalties: each sequence of a batch is penalized by its own generated tokens,
and the sampled distribution is the softmax of ``logits - count * frequency - (count > 0) * presence``."""

from __future__ import annotations

import math

import torch

from kvchat.engine.sampling import Sampler, sample_rows
from kvchat.engine.turn import SamplingParams

VOCAB = 4
ROWS = 3000  # per kind: a frequency's standard error is at most 0.5 / sqrt(ROWS) ~ 0.009


def _forced(token: int) -> torch.Tensor:
    logits = torch.zeros(VOCAB)
    logits[token] = 100.0  # picked whatever the penalty (at most 2 * 2 + 2 here)
    return logits


def _with_history(params: SamplingParams, history: list[int]) -> Sampler:
    s = Sampler(params)
    for token in history:
        assert int(s.pick(_forced(token))) == token
    return s


def _frequencies(ids: list[int]) -> list[float]:
    return [ids.count(t) / len(ids) for t in range(VOCAB)]


def test_penalties_shift_each_rows_distribution_by_its_own_counts():
    presence, frequency = 0.5, 0.4
    history = [0, 0, 1]  # counts 2, 1, 0, 0
    penalized = [_with_history(SamplingParams(temperature=1.0, seed=i, presence_penalty=presence,
                                              frequency_penalty=frequency), history) for i in range(ROWS)]
    plain = [_with_history(SamplingParams(temperature=1.0, seed=ROWS + i), history) for i in range(ROWS)]
    ids = sample_rows(penalized + plain, torch.zeros(2 * ROWS, VOCAB))  # one batch, rows interleaved by kind
    counts = [2, 1, 0, 0]
    shifted = [-(c * frequency + (c > 0) * presence) for c in counts]
    expected = [math.exp(x) / sum(math.exp(y) for y in shifted) for x in shifted]
    for got, want in zip(_frequencies(ids[:ROWS]), expected):
        assert abs(got - want) < 0.03, (_frequencies(ids[:ROWS]), expected)
    for got in _frequencies(ids[ROWS:]):
        assert abs(got - 1 / VOCAB) < 0.03  # no penalty: the history changes nothing
    assert _frequencies(ids[:ROWS])[0] < 0.17  # 0.25 unpenalized


def test_greedy_frequency_penalty_moves_off_a_repeated_token_after_enough_repeats():
    logits = torch.tensor([2.0, 1.5, 0.0, 0.0])
    s = Sampler(SamplingParams(temperature=0, frequency_penalty=0.2))
    # token 0 leads by 0.5: after three picks its logit is 2.0 - 0.6 = 1.4 < 1.5
    assert [int(s.pick(logits)) for _ in range(4)] == [0, 0, 0, 1]
    negative = Sampler(SamplingParams(temperature=0, presence_penalty=-2.0))
    assert [int(negative.pick(torch.tensor([1.0, 1.5, 0.0, 0.0]) if i else _forced(0))) for i in range(3)] == [0, 0, 0]
