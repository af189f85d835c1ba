"""The message input: multi-line; Enter sends, Ctrl+J inserts a newline."""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("ctrl+j", "shift+enter", "alt+enter")


class ChatInput(TextArea):
    """A TextArea where Enter posts :class:`ChatInput.Submitted` and a key of ``NEWLINE_KEYS`` inserts ``\\n``.

    Ctrl+J works in every terminal (it is the line-feed byte); Shift+Enter and
    Alt+Enter only where the terminal reports them as distinct keys.
    """

    class Submitted(Message):
        """The user pressed Enter; ``text`` is the whole input (the screen decides whether to clear it)."""

        def __init__(self, text: str):
            super().__init__()
            self.text = text

    def __init__(self, **kwargs):
        super().__init__(soft_wrap=True, tab_behavior="focus", show_line_numbers=False, highlight_cursor_line=False,
                         placeholder="Message — Enter sends, Ctrl+J new line, F1 help", **kwargs)

    def load(self, text: str) -> None:
        """Replace the whole input with ``text``, the cursor at its end (where typing goes on from it)."""
        self.text = text
        self.move_cursor(self.document.end)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)
