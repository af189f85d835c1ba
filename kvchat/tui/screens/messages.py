"""Messages the chat screen's worker threads post to it (``post_message`` is thread-safe)."""

from __future__ import annotations

from textual.message import Message

from kvchat.conversation.events import BackendEvent


class BackendEventPosted(Message):
    """A backend event, posted from a worker thread."""

    def __init__(self, event: BackendEvent):
        super().__init__()
        self.event = event


class TurnFailed(Message):
    """A turn (``op``: send, edit, regenerate) raised before or while generating; ``text`` goes back into the
    input."""

    def __init__(self, text: str, error: Exception, op: str = "send"):
        super().__init__()
        self.text, self.error, self.op = text, error, op


class CannotRun(Message):
    """The data dir or its database cannot be used (:class:`kvchat.tui.backend.StoreUnavailableError`)."""

    def __init__(self, reason: str):
        super().__init__()
        self.reason = reason
