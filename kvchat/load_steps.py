"""Steps of getting a model ready (weights, calibration, int8 quantization, kernel builds), told as they start.

Whoever starts a load on a thread listens with :func:`listening` (the TUI's
status bar); a step told on a thread nobody listens on goes to stderr as
``kvchat: <step> …`` when it is a first-time step (once per model or per
machine: the slow ones a first start waits for), else nowhere, so a CLI run
stays quiet after the first.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

_local = threading.local()


@contextmanager
def listening(say: Callable[[str], None]) -> Iterator[None]:
    """Send this thread's steps to ``say(text)`` inside the block (instead of stderr)."""
    before = getattr(_local, "say", None)
    _local.say = say
    try:
        yield
    finally:
        _local.say = before


def step(text: str, first_time: bool = False) -> None:
    """Tell that ``text`` starts (e.g. ``loading weights``). ``first_time``: done once per model or per machine
    and slow, so said on stderr where nobody listens."""
    say = getattr(_local, "say", None)
    if say is not None:
        say(text)
    elif first_time:
        print(f"kvchat: {text} …", file=sys.stderr, flush=True)
