"""A turn's counters as JSON: the one serialization ``kvchat ask --json`` and the server's ``kvchat`` block use."""

from __future__ import annotations

import json

from kvchat.engine.turn import TurnStats


def test_a_turns_report_has_every_counter_but_the_recompute_rounded_to_hundredths():
    s = TurnStats(prompt_tokens=40, reused_tokens=32, from_memory=16, from_disk=16, restore_ms=1.23456, bytes_read=4096,
                  miss_reason="a chunk was corrupt", prefilled_tokens=8, new_tokens=5, ttft_ms=12.345678,
                  prefill_ms=7.891, decode_tokens_per_s=33.333333, settle_ms=9.5, finish_reason="stop")
    assert s.to_json() == {
        "prompt_tokens": 40, "reused_tokens": 32, "from_memory": 16, "from_disk": 16, "restore_ms": 1.23,
        "bytes_read": 4096, "miss_reason": "a chunk was corrupt", "prefilled_tokens": 8, "new_tokens": 5,
        "ttft_ms": 12.35, "prefill_ms": 7.89, "decode_tokens_per_s": 33.33, "finish_reason": "stop",
    }
    assert list(s.to_json())[:3] == ["prompt_tokens", "reused_tokens", "from_memory"]  # the order ask prints
    assert json.loads(json.dumps(s.to_json())) == s.to_json()


def test_a_report_of_some_counters_keeps_the_order_asked_for():
    s = TurnStats(from_memory=3, from_disk=2, prefilled_tokens=1, restore_ms=0.005)
    assert s.to_json(("from_memory", "from_disk", "prefilled_tokens", "restore_ms")) == {
        "from_memory": 3, "from_disk": 2, "prefilled_tokens": 1, "restore_ms": 0.01}
    assert list(s.to_json(("restore_ms", "from_disk"))) == ["restore_ms", "from_disk"]


def test_a_one_token_answer_has_no_decode_rate_rather_than_a_rate_of_zero():
    from kvchat.cli.ask import turn_figures

    one = TurnStats(prompt_tokens=20, prefilled_tokens=20, new_tokens=1, ttft_ms=50.0)
    assert one.to_json()["decode_tokens_per_s"] is None
    assert turn_figures(one).endswith("TTFT 50 ms")
    two = TurnStats(prompt_tokens=20, prefilled_tokens=20, new_tokens=2, ttft_ms=50.0, decode_tokens_per_s=40.0)
    assert two.to_json()["decode_tokens_per_s"] == 40.0 and turn_figures(two).endswith("TTFT 50 ms · 40.0 tok/s")
