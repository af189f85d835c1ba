"""F1: every key binding, built from :data:`kvchat.tui.actions.ACTIONS` (so it cannot go stale)."""

from __future__ import annotations

from rich.text import Text
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from kvchat.tui.actions import ACTIONS, INPUT_KEYS


def help_rows() -> list[tuple[str, str, str]]:
    """``(key, action, what it does)`` for every action, then the input and navigation keys."""
    rows = [(a.key, a.title, a.help) for a in ACTIONS]
    return rows + [(key, "", text) for key, text in INPUT_KEYS]


class HelpScreen(ModalScreen[None]):
    """The bindings table; Esc, F1 or q closes it."""

    BINDINGS = [("escape,f1,q", "close", "Close")]

    def compose(self):
        with Vertical(classes="dialog wide"):
            yield Static("kvchat keys — Esc closes", classes="question")
            table = DataTable(id="help-table", cursor_type="row", zebra_stripes=True)
            table.add_columns("Key", "Action", "What it does")
            table.add_rows([tuple(Text(cell) for cell in row) for row in help_rows()])
            yield table

    def action_close(self) -> None:
        self.dismiss(None)
