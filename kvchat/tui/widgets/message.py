"""One message in the chat pane: user text shown literally; answers as Markdown, streamed then re-rendered."""

from __future__ import annotations

from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from kvchat.conversation.views import ChatMessage
from kvchat.tui.text import literal


def stats_line(ttft_ms: float | None, tokens_per_s: float | None, finish_reason: str = "") -> str:
    """``TTFT 120 ms · 31.2 tok/s`` plus why the answer stopped when it was not the model's choice."""
    parts = []
    if ttft_ms:
        parts.append(f"TTFT {ttft_ms:,.0f} ms")
    if tokens_per_s:
        parts.append(f"{tokens_per_s:.1f} tok/s")
    reasons = {"length": "stopped at max tokens", "context": "stopped at the context limit", "cancelled": "stopped",
               "interrupted": "interrupted: the server stopped sending"}
    if finish_reason in reasons:
        parts.append(reasons[finish_reason])
    return " · ".join(parts)


class MessageBlock(Vertical):
    """A user message, an answer, or a notice (``role`` = ``"notice"``), as a CSS class of that name."""

    def __init__(self, role: str, text: str = "", stats: str = ""):
        super().__init__(classes=f"message {role}")
        self.role = role
        self.text = text
        self._stats = stats
        self._stream: MarkdownStream | None = None

    def compose(self):
        if self.role == "assistant":
            yield Markdown(literal(self.text))
            yield Static(Content(self._stats), classes="stats")
        else:
            yield Static(Content(literal(self.text)), classes="body")

    @classmethod
    def from_message(cls, m: ChatMessage) -> "MessageBlock":
        return cls(m.role, m.text, stats_line(m.ttft_ms, m.tokens_per_s, m.finish_reason) if m.role == "assistant" else "")

    async def append(self, text: str) -> None:
        """Stream a batch of answer text into the Markdown widget (Textual's ``MarkdownStream``)."""
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        self.text += text
        await self._stream.write(literal(text))

    async def finish(self, text: str, stats: str) -> None:
        """End the stream and render the whole answer again (closes code fences and tables properly)."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.text = text
        await self.query_one(Markdown).update(literal(text))
        self.query_one(".stats", Static).update(Content(stats))
