"""``on_own_thread``: a model is loaded on a thread that ends (PyTorch's OpenMP pool of the loading thread goes with it)."""

from __future__ import annotations

import threading

import pytest

from kvchat.cpu_threads import on_own_thread


def test_runs_on_another_thread_that_ends_and_returns_the_result():
    seen = []

    def work(a, b=0):
        seen.append(threading.current_thread())
        return a + b

    assert on_own_thread(work, 2, b=3) == 5
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()


def test_its_exception_is_raised_on_the_caller():
    def fail():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        on_own_thread(fail)
