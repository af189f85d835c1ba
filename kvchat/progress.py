"""Progress on stderr for the CLI: prefill (a tqdm bar with tokens/s and the time left on a terminal, plain lines
elsewhere) and the steps of a slow start (loading weights, calibrating, compiling kernels: the same, shown only
once a step has run for :data:`SHOW_STEP_AFTER_S`, so a fast start prints nothing)."""

from __future__ import annotations

import atexit
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from tqdm import tqdm

LOG_EVERY_S = 10.0  # off a terminal: a plain line at most this often, then the final one
SHOW_STEP_AFTER_S = 5.0  # a start step shows once it has run this long (a small model's start stays quiet)


@dataclass(slots=True)
class _Prefill:
    """The prefill being reported: where, its size, its first report (tokens, time), the bar or last line's time."""

    stream: TextIO
    total: int
    done: int
    first_done: int
    first_t: float
    last_line_t: float
    bar: tqdm | None


_current: _Prefill | None = None


def print_prefill_progress(done: int, total: int, stream: TextIO | None = None) -> None:
    """Report ``done`` of ``total`` prefilled tokens (called after each prefill chunk).

    On a terminal a tqdm bar shows tokens/s and the time left, and is ended when
    ``done == total``. On a pipe or log file (``isatty()`` false) nothing is
    redrawn, so logs get no carriage returns: a plain line at most every
    :data:`LOG_EVERY_S` seconds, and a final one with the rate. A report with
    another ``total`` or stream, or fewer tokens, starts a new prefill; rates
    count from its first report (the end of its first chunk).
    """
    global _current
    stream = stream or sys.stderr
    now = time.perf_counter()
    cur = _current
    if cur is None or cur.stream is not stream or cur.total != total or done < cur.done:
        if cur is not None and cur.bar is not None:
            cur.bar.close()  # a prefill that never finished (its bar stays on screen)
        bar = None
        if stream.isatty():
            bar = tqdm(total=total, initial=done, desc="prefill", unit="tok", file=stream, leave=True,
                       dynamic_ncols=True, smoothing=0)
        cur = _current = _Prefill(stream, total, done, done, now, now, bar)
    if cur.bar is not None:
        cur.bar.update(done - cur.bar.n)
    elif done == total or now - cur.last_line_t >= LOG_EVERY_S:
        print(_plain_line(cur, done, total, now), file=stream, flush=True)
        cur.last_line_t = now
    cur.done = done
    if done == total:
        if cur.bar is not None:
            cur.bar.close()
        _current = None


@atexit.register
def _drop_unfinished() -> None:
    """A bar left unfinished (Ctrl-C during prefill) is not drawn again at exit, below the CLI's last line."""
    if _current is not None and _current.bar is not None:
        _current.bar.disable = True


def rate_and_eta(tokens: int, seconds: float, left: int) -> tuple[float | None, float | None]:
    """A prefill's rate and time left, for every progress report (this module's lines, the conversation
    service's :class:`~kvchat.conversation.events.PrefillProgress`): ``tokens`` computed in ``seconds`` since
    the rate's start, ``left`` tokens to go.

    Returns:
        ``(tokens/s, seconds left)``: the rate so far and ``left`` ÷ it; ``(None, None)`` before any token or
        time was counted.
    """
    if tokens <= 0 or seconds <= 0:
        return None, None
    rate = tokens / seconds
    return rate, left / rate


def _plain_line(cur: _Prefill, done: int, total: int, now: float) -> str:
    """``prefill DONE/TOTAL tokens`` with the rate since the prefill's first report and, before the end, the time
    left (neither before a second report)."""
    line = f"prefill {done}/{total} tokens"
    rate, eta = rate_and_eta(done - cur.first_done, now - cur.first_t, total - done)
    if rate is None:
        return line
    line += f", {rate:.0f} tok/s"
    return line if done == total else f"{line}, about {eta:.0f} s left"


@dataclass(slots=True)
class _Step:
    """The start step being reported: where, its text and size, when it began, its last line's time (None:
    nothing printed yet), the bar on a terminal."""

    stream: TextIO
    text: str
    total: int
    t0: float
    last_line_t: float | None
    bar: tqdm | None


_step: _Step | None = None


def print_start_progress(text: str, done: int, total: int, stream: TextIO | None = None) -> None:
    """Report ``done`` of ``total`` units of a start step named ``text`` (the ``progress`` of
    :func:`kvchat.runtime.load_runtime`: weight bytes loaded, kernels compiled).

    Nothing shows for a step's first :data:`SHOW_STEP_AFTER_S` seconds. Then, on a terminal, a tqdm bar
    named ``text``; on a pipe or log file, ``kvchat: TEXT: P%`` at most every :data:`LOG_EVERY_S` and
    ``kvchat: TEXT: done in S s`` at its end. A step ends when ``done >= total`` or another one starts.
    """
    global _step
    stream = stream or sys.stderr
    now = time.perf_counter()
    cur = _step
    if cur is None or cur.text != text or cur.stream is not stream:
        _end_step(now)
        bar = None
        if stream.isatty():
            bar = tqdm(total=total, desc=text, file=stream, leave=True, dynamic_ncols=True, delay=SHOW_STEP_AFTER_S,
                       unit_scale=total >= 10_000, smoothing=0)
        cur = _step = _Step(stream, text, total, now, None, bar)
    if cur.bar is not None:
        cur.bar.update(done - cur.bar.n)
    elif done < total and now - cur.t0 >= SHOW_STEP_AFTER_S and (
            cur.last_line_t is None or now - cur.last_line_t >= LOG_EVERY_S):
        print(f"kvchat: {text}: {100 * done // max(total, 1)}%", file=stream, flush=True)
        cur.last_line_t = now
    if done >= total:
        _end_step(now)


def _end_step(now: float) -> None:
    """End the current start step: its bar closed, or off a terminal its final line if it showed at all."""
    global _step
    cur, _step = _step, None
    if cur is None:
        return
    if cur.bar is not None:
        cur.bar.close()
    elif cur.last_line_t is not None or now - cur.t0 >= SHOW_STEP_AFTER_S:
        print(f"kvchat: {cur.text}: done in {now - cur.t0:.1f} s", file=cur.stream, flush=True)
