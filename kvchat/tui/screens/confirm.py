"""A yes/no dialog; dismisses with True or False."""

from __future__ import annotations

from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from kvchat.tui.text import literal


class ConfirmScreen(ModalScreen[bool]):
    """Shows ``question`` (literally) and which keys answer it: ``y``/Enter on Yes confirms, ``n``/Esc/Enter on
    the focused No cancels (No has the focus, so a stray Enter loses nothing)."""

    BINDINGS = [("y", "answer(True)", "Yes"), ("n,escape", "answer(False)", "No")]

    def __init__(self, question: str, yes: str = "Yes", no: str = "Cancel"):
        super().__init__(classes="dialog-screen")
        self.question, self.yes, self.no = question, yes, no

    def compose(self):
        with Vertical(classes="dialog"):
            yield Static(Content(literal(self.question)), classes="question")
            with Horizontal(classes="buttons"):
                yield Button(self.yes, variant="error", id="yes")
                yield Button(self.no, id="no")
            yield Static(Content(literal(hint(self.yes, self.no))), classes="hint")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, value: bool) -> None:
        self.dismiss(value)


def hint(yes: str, no: str) -> str:
    """The dialog's key line, e.g. ``y: Delete · n, Esc or Enter: Cancel``."""
    return f"y: {yes} · n, Esc or Enter: {no}"
