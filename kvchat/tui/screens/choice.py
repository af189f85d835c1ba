"""A dialog of several choices, one button each, and a way out; dismisses with the chosen key or None."""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from kvchat.tui.text import literal


class ChoiceScreen(ModalScreen[str | None]):
    """Shows ``question`` (literally), then ``choices`` ``(key, label)`` as buttons numbered from 1 (the digit
    chooses) and a ``no`` button (``n``/Esc); the focus starts on ``no``, so Enter alone changes nothing."""

    BINDINGS = [Binding("n,escape", "choose(None)", "No")]

    def __init__(self, question: str, choices: list[tuple[str, str]], no: str = "Cancel"):
        super().__init__(classes="dialog-screen")
        self.question, self.choices, self.no = question, choices, no

    def compose(self):
        with Vertical(classes="dialog"):
            yield Static(Content(literal(self.question)), classes="question")
            for i, (key, label) in enumerate(self.choices, 1):
                yield Button(Content(literal(f"{i}. {label}")), id=f"choice-{key}", classes="choice")
            yield Button(self.no, id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_key(self, event) -> None:
        if event.character and event.character.isdigit() and 1 <= int(event.character) <= len(self.choices):
            event.stop()
            self.dismiss(self.choices[int(event.character) - 1][0])

    def on_button_pressed(self, event: Button.Pressed) -> None:
        key = event.button.id or ""
        self.dismiss(key.removeprefix("choice-") if key.startswith("choice-") else None)

    def action_choose(self, key: str | None) -> None:
        self.dismiss(key)
