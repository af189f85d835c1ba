"""A remote turn's counters: what the server reports it reused (kvchat serve's ``kvchat`` object, else
``usage.prompt_tokens_details.cached_tokens``) beside the times measured here, and the status line."""

from __future__ import annotations

from kvchat.engine.turn import TURN_REPORT_KEYS, TurnStats
from kvchat.remote.client import Reply

MIN_RATE_TOKENS = 5  # 4 intervals at least: fewer say more about the network's writes than the model's pace
MIN_RATE_SPAN_S = 0.05  # a shorter span is within a burst of buffered writes (or timer noise), not decoding


def decode_rate(tokens: int, span_s: float) -> float:
    """The answer's decode speed in tokens/s as measured by the client: the ``tokens - 1`` intervals after the
    first token over ``span_s``, the seconds from the first text to the last (as the local engine measures
    its own: the first token's time is the TTFT's). 0 (not measured, not shown) for fewer than
    :data:`MIN_RATE_TOKENS` tokens or a span under :data:`MIN_RATE_SPAN_S`: a short answer comes in one or
    two network writes, and the microseconds between them gave rates like 23,000 tok/s for 3 tokens."""
    if tokens < MIN_RATE_TOKENS or span_s < MIN_RATE_SPAN_S:
        return 0.0
    return (tokens - 1) / span_s


def _int(mapping: dict | None, key: str) -> int:
    value = (mapping or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def cached_tokens(reply: Reply) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` when the server sent it, else None."""
    details = reply.usage.get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# the counters turn_stats knows of any server: a server reports no bytes read and no prefill time, and only
# kvchat serve's own block says where the reused tokens came from (REUSE_KEYS)
REPORTED_KEYS = tuple(k for k in TURN_REPORT_KEYS if k not in ("bytes_read", "prefill_ms"))
REUSE_KEYS = ("from_memory", "from_disk", "restore_ms", "miss_reason")


def reported_keys(reply: Reply) -> tuple[str, ...]:
    """The :class:`TurnStats` keys ``reply`` gave figures for (``ask --server --json`` prints those): without a
    ``kvchat`` block, none of :data:`REUSE_KEYS` (zeros there would look measured)."""
    return REPORTED_KEYS if reply.kvchat is not None else tuple(k for k in REPORTED_KEYS if k not in REUSE_KEYS)


def turn_stats(reply: Reply) -> TurnStats:
    """The turn's :class:`TurnStats`: token counts from the server's ``usage`` (without it: the prompt 0, the
    answer its streamed pieces, one token each on these servers),
    reuse from its ``kvchat`` object or ``cached_tokens``, TTFT as measured by the client, decode speed by
    :func:`decode_rate`."""
    k, usage = reply.kvchat, reply.usage
    prompt = _int(usage, "prompt_tokens")
    if k is not None:
        memory, disk = _int(k, "from_memory"), _int(k, "from_disk")
        reused, prefilled = memory + disk, _int(k, "prefilled_tokens")
        restore = k.get("restore_ms") if isinstance(k.get("restore_ms"), (int, float)) else 0.0
        miss = k.get("miss_reason") if isinstance(k.get("miss_reason"), str) else None
    else:
        memory = disk = 0
        reused, restore, miss = cached_tokens(reply) or 0, 0.0, None
        prefilled = max(prompt - reused, 0)
    new = _int(usage, "completion_tokens") or reply.pieces
    return TurnStats(prompt_tokens=prompt, reused_tokens=reused, from_memory=memory, from_disk=disk,
                     restore_ms=float(restore), miss_reason=miss, prefilled_tokens=prefilled, new_tokens=new,
                     ttft_ms=reply.ttft_ms, decode_tokens_per_s=decode_rate(new, reply.decode_span_s),
                     finish_reason=reply.finish_reason)


def reuse_line(reply: Reply) -> str:
    """What the server reused for this turn, e.g. ``resumed 5,790 tokens from the server's disk in 56 ms``
    (kvchat serve), ``the server reused 1,024 cached tokens of 1,090`` (``cached_tokens``), or that the
    server does not say."""
    k = reply.kvchat
    if k is None:
        cached = cached_tokens(reply)
        if cached is None:
            return "the server does not say which tokens it reused"
        return f"the server reused {cached:,} cached tokens of {_int(reply.usage, 'prompt_tokens'):,}"
    s = turn_stats(reply)
    if not s.reused_tokens:
        line = f"the server prefilled all {s.prefilled_tokens:,} tokens"
    elif s.from_disk and s.from_memory:
        line = (f"resumed {s.reused_tokens:,} tokens on the server ({s.from_memory:,} from memory, "
                f"{s.from_disk:,} from disk in {s.restore_ms:.0f} ms)")
    elif s.from_disk:
        line = f"resumed {s.reused_tokens:,} tokens from the server's disk in {s.restore_ms:.0f} ms"
    else:
        line = f"resumed {s.reused_tokens:,} tokens from the server's memory"
    if s.reused_tokens and s.prefilled_tokens:
        line += f"; prefilled {s.prefilled_tokens:,}"
    return line + (f" ({s.miss_reason})" if s.miss_reason else "")
