"""The CLI's prefill progress (kvchat.progress): a tqdm bar on a terminal, plain lines without ``\\r`` elsewhere."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from kvchat import progress
from kvchat.progress import print_prefill_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    """Seconds seen by kvchat.progress, set by the test; no prefill left over from another test."""
    now = [100.0]
    monkeypatch.setattr(progress, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(progress, "_current", None)
    return now


def test_off_a_terminal_a_line_now_and_then_and_a_final_one_without_carriage_returns(clock):
    log = io.StringIO()
    for done in (512, 1024, 1536):  # 0.5 s apart: too soon for a line
        print_prefill_progress(done, 8192, log)
        clock[0] += 0.5
    assert log.getvalue() == ""
    clock[0] += 10.0
    print_prefill_progress(2048, 8192, log)  # 1536 tokens 11.5 s after the first report
    clock[0] += 1.0
    print_prefill_progress(8192, 8192, log)
    assert log.getvalue().splitlines() == [
        "prefill 2048/8192 tokens, 134 tok/s, about 46 s left",
        "prefill 8192/8192 tokens, 614 tok/s",
    ]
    assert "\r" not in log.getvalue()


def test_a_one_chunk_prefill_off_a_terminal_is_one_plain_line():
    log = io.StringIO()
    print_prefill_progress(300, 300, log)
    assert log.getvalue() == "prefill 300/300 tokens\n"


def test_on_a_terminal_a_bar_with_rate_and_time_left_ended_by_a_newline():
    tty = Terminal()
    for done in range(512, 4097, 512):
        print_prefill_progress(done, 4096, tty)
    out = tty.getvalue()
    assert "\r" in out and out.endswith("\n") and out.count("\n") == 1
    last = out[:-1].split("\r")[-1]
    assert last.startswith("prefill: 100%") and "4096/4096" in last and "tok/s" in last and "<" in last


def test_another_prefill_ends_an_unfinished_one_and_starts_its_own():
    tty = Terminal()
    print_prefill_progress(512, 8192, tty)  # never finished (e.g. the prompt was cut short)
    print_prefill_progress(512, 1024, tty)
    print_prefill_progress(1024, 1024, tty)
    lines = [line.split("\r")[-1] for line in tty.getvalue().split("\n")[:-1]]  # each line as last drawn
    assert [line.split("|")[-1].split(" [")[0].strip() for line in lines] == ["512/8192", "1024/1024"]
    assert progress._current is None


# ---- the steps of a slow start (kvchat.progress.print_start_progress)

@pytest.fixture
def no_step(monkeypatch):
    monkeypatch.setattr(progress, "_step", None)


def test_a_slow_start_step_off_a_terminal_shows_after_a_while_then_its_end(clock, no_step):
    assert progress.SHOW_STEP_AFTER_S == 5.0
    log = io.StringIO()
    for done, dt in ((10, 0.5), (50, 4.5), (60, 1.0), (70, 1.0)):  # 60 % at 5.0 s: shown; 70 % at 6 s: too soon
        progress.print_start_progress("loading weights", done, 100, log)
        clock[0] += dt
    progress.print_start_progress("loading weights", 100, 100, log)
    assert log.getvalue().splitlines() == ["kvchat: loading weights: 60%", "kvchat: loading weights: done in 7.0 s"]
    for done in (1, 2, 3):  # a fast step: nothing
        progress.print_start_progress("preparing 3 Triton kernel variants", done, 3, log)
        clock[0] += 0.1
    assert len(log.getvalue().splitlines()) == 2 and progress._step is None


def test_a_step_without_an_end_is_ended_by_the_next(clock, no_step):
    log = io.StringIO()
    progress.print_start_progress("calibrating fp8 K centring", 0, 1, log)
    clock[0] += 6.0
    progress.print_start_progress("preparing 20 Triton kernel variants", 1, 20, log)
    assert log.getvalue() == "kvchat: calibrating fp8 K centring: done in 6.0 s\n"


def test_a_fast_start_draws_nothing_on_a_terminal(no_step):
    tty = Terminal()
    for done in range(0, 101, 10):
        progress.print_start_progress("loading weights", done, 100, tty)
    assert tty.getvalue() == "" and progress._step is None
