"""Named crash points for fault-injection tests (issue: reliability).

A test runs kvchat in a subprocess with ``KVCHAT_CRASH_AT=<name>``; when the
code reaches :func:`crash_point` with that name the process SIGKILLs itself,
exactly as ``kill -9`` would, so nothing (no ``finally``, no atexit) runs.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "KVCHAT_CRASH_AT"

CRASH_POINTS = (
    "chunk_mid_write",  # chunk temp file half written
    "chunk_after_fsync",  # temp file complete and fsynced, not yet renamed
    "chunk_after_rename",  # file renamed into place, index row not yet committed
    "message_insert",  # inside the append_turn transaction, messages inserted
    "migration",  # all pending migrations applied, transaction not yet committed
)


def crash_point(name: str) -> None:
    """SIGKILL the current process if ``$KVCHAT_CRASH_AT == name``; otherwise do nothing."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
