"""The chat pane: messages in a scrollable column, anchored to the bottom, older ones mounted on demand."""

from __future__ import annotations

from textual import on
from textual.containers import VerticalScroll
from textual.widgets import Button

from kvchat.conversation.views import ChatMessage
from kvchat.tui.widgets.message import MessageBlock

PAGE = 40


class MessageView(VerticalScroll):
    """Shows a chat. Only the last :data:`PAGE` messages are mounted at first; a button mounts the next page up.

    Keyboard scrolling (up/down, PgUp/PgDn, Home/End) works when it has focus.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._hidden: list[ChatMessage] = []

    async def show(self, messages: list[ChatMessage], notices: list[str]) -> None:
        """Replace the content: ``notices`` (e.g. attached documents) then the last page of ``messages``."""
        await self.remove_children()
        self._hidden = list(messages[:-PAGE] if len(messages) > PAGE else [])
        blocks = [MessageBlock("notice", n) for n in notices]
        blocks += [MessageBlock.from_message(m) for m in messages[len(self._hidden):]]
        if self._hidden:
            blocks.insert(0, self._earlier_button())
        await self.mount_all(blocks)
        self.anchor()
        self.scroll_end(animate=False)

    def _earlier_button(self) -> Button:
        return Button(self._earlier_label(), id="earlier", classes="earlier")

    def _earlier_label(self) -> str:
        return f"▲ {len(self._hidden)} earlier messages"

    @on(Button.Pressed, "#earlier")
    async def mount_earlier(self) -> None:
        """Mount the next page of older messages above the oldest one shown."""
        button = self.query_one("#earlier", Button)
        page, self._hidden = self._hidden[-PAGE:], self._hidden[:-PAGE]
        if self._hidden:
            button.label = self._earlier_label()
        await self.mount_all([MessageBlock.from_message(m) for m in page], after=button)
        if not self._hidden:
            await button.remove()

    async def add(self, role: str, text: str = "", stats: str = "") -> MessageBlock:
        """Append a message (an empty ``assistant`` block is then fed with :meth:`MessageBlock.append`)."""
        block = MessageBlock(role, text, stats)
        await self.mount(block)
        self.anchor()
        return block

    def blocks(self, role: str | None = None) -> list[MessageBlock]:
        """Mounted message blocks, oldest first (only ``role`` if given)."""
        return [b for b in self.query(MessageBlock) if role is None or b.role == role]
