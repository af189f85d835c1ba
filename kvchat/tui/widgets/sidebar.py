"""The sidebar: search, conversations (title, last use, tokens, cache state) and documents.

Enter opens the highlighted row, or the first one when none is highlighted
(a fresh list has none); Enter in the search box asks for the search at once
(``SearchChanged.submitted``) and the screen then opens the first match
(:meth:`Sidebar.open_chat`).
"""

from __future__ import annotations

from textual import on
from textual.containers import Vertical
from textual.content import Content
from textual.message import Message
from textual.widgets import Input, Label, ListItem, ListView

from kvchat.conversation.views import ChatSummary, DocumentSummary
from kvchat.engine.cache_identity import BLOCK_SIZE
from kvchat.tui.text import ago, one_line, tokens

CACHE_MARK = {"memory": "● mem", "disk": "◐ disk", "none": "○ none"}
# what each mark means, for the F1 legend (the rule: kvchat.conversation.cache_state.all_in_memory)
CACHE_MARK_MEANING = {
    "memory": f"its KV is in memory (every full {BLOCK_SIZE}-token block of its history; a short chat's may be the "
              "system prompt alone, shared with other chats): its next question starts at once",
    "disk": "its KV is stored on disk: opening it restores the cache where reading beats recomputing",
    "none": "no KV stored under this run's cache identity (model, weights, compute and KV dtype): opening it "
            "recomputes the history",
}
DOCUMENT_MARK = {"memory": "● cached in memory", "disk": "◐ cached on disk", "none": "○ not cached"}


def chat_row(c: ChatSummary) -> str:
    """Two lines: the title (with a pin), then last use · tokens · where its KV cache lives."""
    pin = "📌 " if c.pinned else ""
    title = one_line(c.title) or "(untitled)"
    return f"{pin}{title}\n{ago(c.updated)} · {tokens(c.num_tokens)} tok · {CACHE_MARK[c.cache_state]}"


def document_row(d: DocumentSummary) -> str:
    """Two lines: the title, then tokens · whether its prefix is cached (in memory, on disk) or not."""
    return f"{one_line(d.title)}\n{tokens(d.tokens)} tok · {DOCUMENT_MARK[d.cache_state]}"


class RowList(ListView):
    """A ListView whose Enter selects the first row when none is highlighted."""

    def action_select_cursor(self) -> None:
        if self.index is None and self.children:
            self.index = 0
        super().action_select_cursor()


class Sidebar(Vertical):
    """Lists set by the screen (attributes down); choices and searches posted as messages (messages up)."""

    class ChatChosen(Message):
        def __init__(self, chat_id: str):
            super().__init__()
            self.chat_id = chat_id

    class DocumentChosen(Message):
        def __init__(self, path: str):
            super().__init__()
            self.path = path

    class SearchChanged(Message):
        """The search text changed; ``submitted`` when Enter was pressed in it."""

        def __init__(self, query: str, submitted: bool = False):
            super().__init__()
            self.query = query
            self.submitted = submitted

    _current_id: str | None = None  # the open chat when the rows were last set

    def compose(self):
        yield Input(placeholder="Search chats (Ctrl+F)", id="search")
        yield RowList(id="chats")
        yield Label("Documents", classes="heading")
        yield RowList(id="documents")

    @property
    def query_text(self) -> str:
        return self.query_one("#search", Input).value

    async def set_chats(self, chats: list[ChatSummary], current_id: str | None) -> None:
        """Show ``chats``; the highlight follows the open chat ``current_id`` when it changes.

        While the open chat stays the same, the highlight stays on the row the
        user moved to (when it is still listed): a background refresh must not
        move it between the user's key presses.
        """
        view = self.query_one("#chats", ListView)
        moved = view.highlighted_child.name if view.highlighted_child is not None else None
        keep = moved if current_id == self._current_id else current_id
        self._current_id = current_id
        await _set_rows(view, [(c.id, chat_row(c)) for c in chats])
        ids = [c.id for c in chats]
        keep = keep if keep in ids else current_id
        view.index = ids.index(keep) if keep in ids else None

    async def set_documents(self, docs: list[DocumentSummary]) -> None:
        # a document pasted into a message names no file: nothing to start a chat on (`kvchat doc list` shows it)
        await _set_rows(self.query_one("#documents", ListView), [(d.path, document_row(d)) for d in docs if d.path])

    @on(Input.Changed, "#search")
    def _search(self, event: Input.Changed) -> None:
        event.stop()
        self.post_message(self.SearchChanged(event.value))

    def open_chat(self) -> None:
        """Choose the highlighted chat, or the first listed (as Enter on the list does)."""
        self.query_one("#chats", RowList).action_select_cursor()

    @on(Input.Submitted, "#search")
    def _search_now(self, event: Input.Submitted) -> None:
        event.stop()
        self.post_message(self.SearchChanged(event.value, submitted=True))

    @on(ListView.Selected, "#chats")
    def _chat(self, event: ListView.Selected) -> None:
        event.stop()
        self.post_message(self.ChatChosen(event.item.name))

    @on(ListView.Selected, "#documents")
    def _document(self, event: ListView.Selected) -> None:
        event.stop()
        self.post_message(self.DocumentChosen(event.item.name))


async def _set_rows(view: ListView, rows: list[tuple[str, str]]) -> None:
    """Show ``(name, text)`` rows in ``view``.

    When the names are unchanged (a refresh of the same chats) the labels are
    updated in place: no flicker, and the highlight and an Enter pressed
    meanwhile keep their row. Otherwise the rows are rebuilt.
    """
    if [item.name for item in view.children] == [name for name, _ in rows]:
        for item, (_, text) in zip(view.children, rows):
            item.query_one(Label).update(Content(text))
        return
    await view.clear()
    await view.extend(ListItem(Label(Content(text)), name=name) for name, text in rows)
