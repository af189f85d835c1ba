"""The decode speed of a server's answer, as the client measures it: the intervals after the first token over
the time from the first text to the last, and not shown for an answer too short or too quick to time."""

from __future__ import annotations

import pytest

from kvchat.remote.client import Reply
from kvchat.remote.figures import MIN_RATE_SPAN_S, MIN_RATE_TOKENS, decode_rate, turn_stats
from kvchat.tui.widgets.message import stats_line


@pytest.mark.parametrize("tokens", [0, 1, 2, 3])
def test_a_short_answer_has_no_rate(tokens):
    # a 3-token answer whose pieces came 0.1 ms apart once read as 20,000 tok/s
    assert decode_rate(tokens, 0.0001) == 0.0
    assert decode_rate(tokens, 10.0) == 0.0


def test_a_long_answer_is_timed_over_its_intervals():
    assert MIN_RATE_TOKENS > 3
    assert decode_rate(101, 2.0) == pytest.approx(50.0)  # 100 intervals in 2 s
    assert decode_rate(MIN_RATE_TOKENS, 1.0) == pytest.approx(MIN_RATE_TOKENS - 1)


def test_a_burst_shorter_than_the_minimum_span_has_no_rate():
    assert decode_rate(200, MIN_RATE_SPAN_S / 2) == 0.0  # buffered writes delivered at once
    assert decode_rate(200, MIN_RATE_SPAN_S) == pytest.approx(199 / MIN_RATE_SPAN_S)


def test_turn_stats_counts_the_servers_tokens_and_shows_no_rate_it_cannot_measure():
    quick = Reply("Half an answer", "stop", 12.0, 0.0001, pieces=3, usage={"completion_tokens": 3})
    stats = turn_stats(quick)
    assert (stats.new_tokens, stats.decode_tokens_per_s) == (3, 0.0)
    assert stats_line(stats.ttft_ms, stats.decode_tokens_per_s) == "TTFT 12 ms"
    long = Reply("x" * 40, "stop", 12.0, 1.5, pieces=40, usage={"completion_tokens": 31})
    assert turn_stats(long).decode_tokens_per_s == pytest.approx(30 / 1.5), "usage's count wins over the pieces"
    no_usage = Reply("x" * 7, "stop", 12.0, 0.5, pieces=7)
    assert turn_stats(no_usage).decode_tokens_per_s == pytest.approx(6 / 0.5)


def test_ask_shows_no_rate_for_a_three_token_answer(kvchat_home, monkeypatch):
    from process_helpers import run_kvchat
    from remote_stub import KEY, StubServer

    monkeypatch.setenv("STUB_KEY", KEY)
    with StubServer() as stub:  # its 3 pieces come in one burst
        proc = run_kvchat(kvchat_home, "ask", "--server", stub.url, "--api-key-env", "STUB_KEY", "Hello?")
    assert proc.returncode == 0, proc.stderr
    figures = proc.stderr.splitlines()[0]
    assert "TTFT" in figures and "tok/s" not in figures, figures
