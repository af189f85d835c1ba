"""F4 (edit the last message) over a half-typed message: the draft comes back to the input when the edit is
cancelled (Esc), sent (Enter) or left for another chat; nothing typed is dropped,
and typing goes on at the end of the text put in the input."""

from __future__ import annotations

import pytest
from test_tui_app import SIZE, Harness, ready, until

from kvchat.tui.fake_backend import FakeBackend
from kvchat.tui.widgets.chat_input import ChatInput

pytestmark = [pytest.mark.asyncio, pytest.mark.tui]
DRAFT = "a half-typed\nsecond question"


def harness() -> Harness:
    return Harness(FakeBackend(answers=["First answer", "Edited answer"]))


async def start_editing(pilot, h: Harness) -> ChatInput:
    await ready(pilot, h)
    await h.send(pilot, "question")
    box = h.screen.query_one(ChatInput)
    box.text = DRAFT
    await pilot.press("f4")
    assert box.text == "question" and h.screen.editing
    return box


async def test_esc_after_f4_gives_the_draft_back():
    h = harness()
    async with h.app.run_test(size=SIZE) as pilot:
        box = await start_editing(pilot, h)
        await pilot.press("f4")  # again: the draft is still the one from before the first
        await pilot.press("escape")
        assert box.text == DRAFT and not h.screen.editing
        assert h.notes[-1] == "edit cancelled; the input holds what you had typed before it"
        assert [m.text for m in h.backend.current().messages] == ["question", "First answer"]


async def test_an_edit_sent_gives_the_draft_back():
    h = harness()
    async with h.app.run_test(size=SIZE) as pilot:
        box = await start_editing(pilot, h)
        box.text = "better question"
        await pilot.press("enter")
        await until(pilot, lambda: not h.screen.generating
                    and [m.text for m in h.backend.current().messages] == ["better question", "Edited answer"])
        assert box.text == DRAFT


async def test_a_chat_opened_while_editing_gives_the_draft_back():
    h = harness()
    async with h.app.run_test(size=SIZE) as pilot:
        box = await start_editing(pilot, h)
        await pilot.press("ctrl+n")
        await until(pilot, lambda: h.backend.current().id is None and h.screen.job is None)
        assert box.text == DRAFT and not h.screen.editing


async def test_typing_after_f4_goes_on_from_the_end_of_the_message():
    h = Harness(FakeBackend(answers=["First answer", "Edited answer"]))
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await h.send(pilot, "question")
        box = h.screen.query_one(ChatInput)
        await pilot.press("f4")
        await pilot.press("X", "Y")
        assert box.text == "questionXY"


async def test_the_draft_given_back_by_esc_is_typed_on_at_its_end():
    h = harness()
    async with h.app.run_test(size=SIZE) as pilot:
        box = await start_editing(pilot, h)
        await pilot.press("escape")
        await pilot.press("X")
        assert box.text == DRAFT + "X"
