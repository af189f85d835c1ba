"""Per-sequence additions to :class:`kvchat.engine.turn.SamplingParams` that an OpenAI request brings: logit
bias, a grammar, and the log-probabilities to report. Plain data between the server and the sampler
(:class:`kvchat.engine.sampling.Sampler` applies and fills them).

Torch-free, so the server's protocol layer can build it before anything is queued.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvchat.engine.grammar import Constraint

MAX_TOP_LOGPROBS = 20  # alternatives per token at most (as the OpenAI API)


@dataclass(slots=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely alternatives at its position.

    Attributes:
        token_id: the id picked.
        logprob: its natural log-probability (float, <= 0).
        top: ``(id, logprob)`` of the ``top_logprobs`` most likely ids, most likely first.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class TokenRules:
    """What one sequence's sampler does beyond :class:`SamplingParams`.

    Attributes:
        logit_bias: token id -> value added to its logit before sampling, in [-100, 100] (the OpenAI API's
            ``logit_bias``: -100 bans the id, 100 all but forces it).
        constraint: the grammar state that masks each step's logits (None: unconstrained).
        top_logprobs: record each picked id's log-probability with this many alternatives (0 to
            :data:`MAX_TOP_LOGPROBS`); None: record nothing.
        logprobs: filled by the sampler, one entry per picked id, in order.
    """

    logit_bias: dict[int, float] = field(default_factory=dict)
    constraint: "Constraint | None" = None
    top_logprobs: int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
