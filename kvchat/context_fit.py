"""Whether a token count fits a context, and the one error every layer raises when it does not.

Torch-free, below both the engine and the conversation layer (and the front ends, which catch the error):
the engine's :meth:`kvchat.engine.runner.Engine.check_fits` (its own limit), a session's turn, the
conversation service's documents prefix and the server's request sizing all call :func:`check_fits`.
"""

from __future__ import annotations

from typing import Callable


class ContextFullError(ValueError):
    """A sequence does not fit the context: ``needed`` tokens > ``limit`` tokens; the message says what."""

    def __init__(self, message: str, needed: int, limit: int):
        super().__init__(message)
        self.needed = needed
        self.limit = limit


def fits(needed: int, limit: int) -> bool:
    """``needed`` tokens fit a context of ``limit`` tokens (``needed <= limit``)."""
    return needed <= limit


def check_fits(needed: int, limit: int, message: Callable[[], str]) -> None:
    """Raise :class:`ContextFullError` (text ``message()``, built only then) unless ``needed`` tokens fit
    ``limit`` (:func:`fits`).

    Raises:
        ContextFullError: ``needed > limit``.
    """
    if not fits(needed, limit):
        raise ContextFullError(message(), needed, limit)
