"""Progress of a prefill (a new document, a long message): a bar, tokens done, and the engine's ETA.

The same bar shows the steps of the first-run model import (:meth:`PrefillBar.steps`).
"""

from __future__ import annotations

from textual.containers import Horizontal
from textual.content import Content
from textual.widgets import Label, ProgressBar


class PrefillBar(Horizontal):
    """Hidden until :meth:`progress` is called; :meth:`done` hides it again."""

    def compose(self):
        yield Label("prefill", id="prefill-label")
        yield ProgressBar(show_eta=False, id="prefill-progress")
        yield Label("", id="prefill-eta")

    def progress(self, done: int, total: int, eta_s: float | None) -> None:
        """Show ``done`` of ``total`` tokens and ``eta_s`` seconds left (``…`` while unknown)."""
        eta = "…" if eta_s is None else f"{eta_s:.1f} s left"
        self._show("prefill", done, total, f"{done:,}/{total:,} tokens · {eta}")

    def steps(self, label: str, done: int, total: int) -> None:
        """Show ``done`` of ``total`` steps of a job called ``label`` (e.g. ``import``)."""
        self._show(label, done, total, f"step {min(done + 1, total)} of {total}")

    def _show(self, label: str, done: int, total: int, text: str) -> None:
        self.display = True
        self.query_one("#prefill-label", Label).update(Content(label))
        self.query_one(ProgressBar).update(total=total, progress=done)
        self.query_one("#prefill-eta", Label).update(Content(text))

    def done(self) -> None:
        self.display = False
