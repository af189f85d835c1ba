"""F1: every key binding, built from :data:`kvchat.tui.actions.ACTIONS` (so it cannot go stale), and the
sidebar's cache marks, from :data:`kvchat.tui.widgets.sidebar.CACHE_MARK`."""

from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from kvchat.tui.actions import ACTIONS, INPUT_KEYS
from kvchat.tui.widgets.sidebar import CACHE_MARK, CACHE_MARK_MEANING

HEADERS = ("Key", "Action", "What it does")
MIN_TEXT_WIDTH = 12  # the last column wraps at the table's width, never below this many cells


def help_rows() -> list[tuple[str, str, str]]:
    """``(key, action, what it does)`` for every action, then the input and navigation keys, then the
    sidebar's cache marks (``(mark, "chat's cache", what it means)``)."""
    rows = [(a.key, a.title, a.help) for a in ACTIONS]
    marks = [(CACHE_MARK[state], "chat's cache", CACHE_MARK_MEANING[state]) for state in CACHE_MARK]
    return rows + [(key, "", text) for key, text in INPUT_KEYS] + marks


class HelpScreen(ModalScreen[None]):
    """The bindings table; Esc, F1 or q closes it. Its last column wraps to the table's width (a 120-column
    terminal showed it cut off at the right), so every line is read without scrolling sideways."""

    BINDINGS = [("escape,f1,q", "close", "Close")]

    def compose(self):
        with Vertical(classes="dialog wide"):
            yield Static("kvchat keys and the sidebar's marks — Esc closes", classes="question")
            yield DataTable(id="help-table", cursor_type="row", zebra_stripes=True)

    def on_resize(self) -> None:
        self._fill()

    def _fill(self) -> None:
        """The rows again at the table's current width: the first two columns as wide as their longest
        cell, the last one the rest (each cell has ``cell_padding`` on both sides; 2 more for the scrollbar)."""
        table = self.query_one("#help-table", DataTable)
        rows = help_rows()
        widths = [max(cell_len(h), *(cell_len(r[i]) for r in rows)) for i, h in enumerate(HEADERS[:2])]  # terminal cells, not characters
        rest = table.size.width - sum(widths) - 2 * table.cell_padding * len(HEADERS) - 2
        table.clear(columns=True)
        for header, width in zip(HEADERS, [*widths, max(MIN_TEXT_WIDTH, rest)]):
            table.add_column(header, width=width)
        for row in rows:
            table.add_row(*(Text(cell) for cell in row), height=None)

    def action_close(self) -> None:
        self.dismiss(None)
