"""Editing a chat's system prompt (multi-line); dismisses with the text or None."""

from __future__ import annotations

from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static, TextArea


class SystemPromptScreen(ModalScreen[str | None]):
    """Ctrl+S saves, Esc cancels. The system prompt starts the cached prefix, so it is set before the first message."""

    BINDINGS = [("ctrl+s", "save", "Save"), ("escape", "cancel", "Cancel")]

    def __init__(self, text: str):
        super().__init__(classes="dialog-screen")
        self.text = text

    def compose(self):
        with Vertical(classes="dialog"):
            yield Static("System prompt — Ctrl+S saves, Esc cancels", classes="question")
            yield TextArea(self.text, id="system-text")

    def action_save(self) -> None:
        self.dismiss(self.query_one(TextArea).text)

    def action_cancel(self) -> None:
        self.dismiss(None)
