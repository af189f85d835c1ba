"""The conversation service's prefill progress events and the CLI's progress lines tell one rate and time left
(:func:`kvchat.progress.rate_and_eta`)."""

from __future__ import annotations

import io
from types import SimpleNamespace

from kvchat import progress
from kvchat.conversation import streaming
from kvchat.conversation.events import PrefillProgress
from kvchat.conversation.streaming import PrefillTimer
from kvchat.progress import print_prefill_progress, rate_and_eta


def test_the_rate_and_time_left_are_tokens_over_seconds_and_what_is_left_over_that():
    assert rate_and_eta(1024, 4.0, 3072) == (256.0, 12.0)
    assert rate_and_eta(0, 4.0, 3072) == (None, None)  # nothing computed yet
    assert rate_and_eta(512, 0.0, 512) == (None, None)  # no time counted yet
    assert rate_and_eta(4096, 2.0, 0) == (2048.0, 0.0)


def test_the_events_and_the_cli_lines_say_the_same_time_left(monkeypatch):
    now = [50.0]
    clock = SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(streaming, "time", clock)
    monkeypatch.setattr(progress, "time", clock)
    monkeypatch.setattr(progress, "_current", None)
    events: list[PrefillProgress] = []
    timer = PrefillTimer(events.append)  # its rate counts from its start
    log = io.StringIO()
    print_prefill_progress(0, 8192, log)  # the CLI's counts from its first report: the same instant here
    now[0] += 16.0
    timer(2048, 8192)
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)  # a line at every report
    print_prefill_progress(2048, 8192, log)
    assert events == [PrefillProgress(2048, 8192, 48.0)]
    assert log.getvalue().splitlines()[-1] == "prefill 2048/8192 tokens, 128 tok/s, about 48 s left"
