"""F5: where each chat's KV cache lives, its size, pins, and totals vs the pool and the disk budget.

Table cells holding user text are ``rich.text.Text`` (a plain ``str`` cell would be parsed as markup).
"""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from kvchat.conversation.views import CacheReport, CacheRow
from kvchat.tui.backend import Backend
from kvchat.tui.text import one_line, tokens
from kvchat.units import size_text


def totals_line(r: CacheReport) -> str:
    """Pool use and disk use against the budget."""
    budget = f" of {size_text(r.disk_budget_bytes)} budget" if r.disk_budget_bytes else ""
    return (f"pool: {r.pool_blocks_used}/{r.pool_blocks_total} blocks ({size_text(r.pool_bytes)} allocated) · "
            f"disk: {size_text(r.disk_bytes)}{budget}")


class CacheScreen(ModalScreen[None]):
    """A table of chats; ``p`` pins/unpins the selected one, ``d`` purges its disk cache, ``r`` refreshes."""

    BINDINGS = [("escape,f5,q", "close", "Close"), ("p", "pin", "Pin/unpin"), ("d", "purge", "Purge disk cache"),
                ("r", "refresh", "Refresh")]

    def __init__(self, backend: Backend):
        super().__init__()
        self.backend = backend
        self.report = CacheReport()

    def compose(self):
        with Vertical(classes="dialog wide"):
            yield Static("Cache — p pin/unpin · d purge disk cache · r refresh · Esc close", classes="question")
            table = DataTable(id="cache-table", cursor_type="row", zebra_stripes=True)
            table.add_columns("Chat", "Tokens", "Cache", "Cached", "In memory", "On disk", "Pinned", "Why missed")
            yield table
            yield Static("", id="cache-totals")

    def on_mount(self) -> None:
        self.action_refresh()

    @work(thread=True, exclusive=True, group="cache")
    def action_refresh(self) -> None:
        report = self.backend.cache_report()
        self.app.call_from_thread(self._show, report)

    def _show(self, report: CacheReport) -> None:
        self.report = report
        table = self.query_one(DataTable)
        table.clear()
        for r in report.rows:
            table.add_row(Text(one_line(r.title)[:40]), tokens(r.num_tokens), r.cache_state, tokens(r.cached_tokens),
                          size_text(r.memory_bytes), size_text(r.disk_bytes), "yes" if r.pinned else "",
                          Text(one_line(r.miss_reason)), key=r.chat_id)
        self.query_one("#cache-totals", Static).update(Content(totals_line(report)))

    def _selected(self) -> CacheRow | None:
        row = self.query_one(DataTable).cursor_row
        return self.report.rows[row] if 0 <= row < len(self.report.rows) else None

    def action_pin(self) -> None:
        chat = self._selected()
        if chat is not None:
            self._pin(chat.chat_id, not chat.pinned)

    def action_purge(self) -> None:
        chat = self._selected()
        if chat is not None:
            self._purge(chat.chat_id)

    @work(thread=True, group="cache")
    def _purge(self, chat_id: str) -> None:
        files = self.backend.purge_cache(chat_id)
        self.app.notify(f"deleted {files} snapshot file(s); chunks shared with other chats stay")
        self.app.call_from_thread(self.action_refresh)

    @work(thread=True, group="cache")
    def _pin(self, chat_id: str, pinned: bool) -> None:
        self.backend.pin_chat(chat_id, pinned)
        self.app.call_from_thread(self.action_refresh)

    def action_close(self) -> None:
        self.dismiss(None)
