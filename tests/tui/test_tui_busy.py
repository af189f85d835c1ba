"""What the chat screen does with each action while engine work runs (an attach, a turn, a chat switch).

The fake backend holds a document's prefill open (``prefill_gate``) or an answer mid-stream (``hold_after``),
so every race is deterministic; the last tests run the reported sequence on the real model and store.
"""

from __future__ import annotations

import threading

import pytest
from textual.widgets import Input

from kvchat.tui.fake_backend import FakeBackend
from kvchat.tui.widgets.chat_input import ChatInput
from kvchat.tui.widgets.status_bar import StatusBar

from test_tui_app import SIZE, Harness, ready, shown, until

pytestmark = [pytest.mark.asyncio, pytest.mark.tui]


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("The heron nests by the mill. " * 20)
    return path


async def attach(pilot, h: Harness, path) -> None:
    """Ctrl+O, the path, Enter: the attach starts (the fake holds its prefill while its gate is closed)."""
    await pilot.press("ctrl+o")
    h.app.screen.query_one(Input).value = str(path)
    await pilot.press("enter")


async def type_and_send(pilot, h: Harness, text: str) -> None:
    await pilot.click(ChatInput)
    h.screen.query_one(ChatInput).text = text
    await pilot.press("enter")


async def test_a_message_sent_during_an_attach_goes_to_the_documents_chat(doc):
    gate = threading.Event()
    h = Harness(FakeBackend(answers=["It nests by the mill."], prefill_gate=gate))
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await attach(pilot, h, doc)
        await type_and_send(pilot, h, "Summarize this.")
        await pilot.pause(0.1)
        gate.set()
        await until(pilot, lambda: h.blocks("assistant") and h.blocks("assistant")[-1].text == "It nests by the mill."
                    and not h.screen.generating)
        [chat] = h.backend.chats.values()
        assert chat.documents == ["notes.txt"]
        assert [m.text for m in chat.messages] == ["Summarize this.", "It nests by the mill."]
        assert [b.text for b in h.blocks("user")] == ["Summarize this."]
