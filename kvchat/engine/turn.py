"""Plain data between the engine and its callers (CLI, TUI): sampling settings and turn counters.

Torch-free, so the UI can import it before the model is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` means greedy (argmax).

    Attributes:
        temperature: softmax temperature (> 0 samples).
        top_p: keep the smallest set of tokens whose probability mass ≥ top_p.
        top_k: keep the k most likely tokens (0 = all).
        seed: seeds a private ``torch.Generator`` so runs are reproducible.
        max_tokens: new tokens at most.
        presence_penalty: subtracted once from the logit of every token already generated, in [-2, 2].
        frequency_penalty: subtracted from a token's logit once per time it was generated, in [-2, 2]
            (both as the OpenAI API's chat completions; see :class:`kvchat.engine.sampling.Sampler`).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 512
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def validate(self) -> None:
        """Raise ``ValueError`` with a one-line message on out-of-range values (the ranges of :data:`LIMITS`)."""
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= LIMITS.temperature):
            raise ValueError(f"temperature must be in [0, {LIMITS.temperature:g}], got {self.temperature}")
        if self.seed is not None and not 0 <= self.seed <= LIMITS.seed:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= LIMITS.count:
            raise ValueError(f"top_k must be in [0, {LIMITS.count}], got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -LIMITS.penalty <= value <= LIMITS.penalty):
                raise ValueError(f"{name} must be in [-{LIMITS.penalty:g}, {LIMITS.penalty:g}], got {value}")
        if not 1 <= self.max_tokens <= LIMITS.count:
            raise ValueError(f"max tokens must be in [1, {LIMITS.count}], got {self.max_tokens}")


@dataclass(frozen=True, slots=True)
class SamplingLimits:
    """The ranges of the sampling settings, the OpenAI API's: the server takes what an OpenAI client may send,
    and the TUI's dialog and ``kvchat ask`` take the same, so a setting made locally works on a server too."""

    temperature: float = 2.0
    penalty: float = 2.0  # presence and frequency penalties, +-
    count: int = 2**31 - 1  # max_tokens, top_k
    seed: int = 2**63 - 1


LIMITS = SamplingLimits()


@dataclass(slots=True)
class TurnStats:
    """Counters of one turn (tokens, ms).

    Attributes:
        prompt_tokens: conversation length before generation.
        reused_tokens: tokens whose K/V came from a cache instead of the model.
        prefilled_tokens: tokens run through the model before the first new token.
        new_tokens: tokens generated.
        ttft_ms: time from the request to the first new token.
        prefill_ms: time spent in prefill.
        decode_tokens_per_s: generated tokens after the first ÷ their decode time (0.0: too short to time, an
            answer of one token or none, or a remote one too short for :func:`kvchat.remote.figures.decode_rate`;
            ``null`` in :meth:`to_json`).
        finish_reason: ``stop`` | ``length`` | ``context`` | ``cancelled``.
        from_memory: reused tokens found in the pool (prefix hit).
        from_disk: reused tokens read from snapshot files.
        restore_ms: time to look up, read, verify and copy them, ms.
        bytes_read: snapshot bytes read.
        miss_reason: why stored K/V could not be used, if any.
        settle_ms: after the answer, time to recompute it as prefill chunks (canonical K/V), ms.
    """

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
    settle_ms: float = 0.0
    finish_reason: str = ""

    def to_json(self, keys: tuple[str, ...] | None = None) -> dict:
        """The counters as JSON values, ms and rates rounded to 0.01, for ``kvchat ask --json`` and the server's
        ``kvchat`` block: ``keys`` in their order, by default :data:`TURN_REPORT_KEYS`; a decode rate too short
        to time is ``None``, not a rate of 0."""
        out = {}
        for key in TURN_REPORT_KEYS if keys is None else keys:
            value = getattr(self, key)
            out[key] = round(value, 2) if key in _ROUNDED else value
        if out.get("decode_tokens_per_s") == 0:
            out["decode_tokens_per_s"] = None
        return out


# a turn's report: every counter but settle_ms, the recompute after the answer was delivered (not the turn's cost)
TURN_REPORT_KEYS = ("prompt_tokens", "reused_tokens", "from_memory", "from_disk", "restore_ms", "bytes_read",
                    "miss_reason", "prefilled_tokens", "new_tokens", "ttft_ms", "prefill_ms", "decode_tokens_per_s",
                    "finish_reason")
_ROUNDED = {"restore_ms", "ttft_ms", "prefill_ms", "decode_tokens_per_s", "settle_ms"}
