"""A chat filled to its context limit in the TUI: the dialog names what a new chat carries, each way on is
taken and the message that did not fit is answered there (the fake backend for the flows, the real model for
one way on)."""

from __future__ import annotations

import pytest
from test_tui_app import SIZE, Harness, ready, shown, until

from kvchat.engine.turn import SamplingParams
from kvchat.tui.fake_backend import FakeBackend
from kvchat.tui.screens.choice import ChoiceScreen
from kvchat.tui.screens.confirm import ConfirmScreen
from kvchat.tui.widgets.chat_input import ChatInput

pytestmark = [pytest.mark.asyncio, pytest.mark.tui]
MORE = "more?"  # 6 fake tokens


async def send(pilot, h: Harness, text: str) -> None:
    await pilot.click(ChatInput)
    h.screen.query_one(ChatInput).text = text
    await pilot.press("enter")


async def answered(pilot, h: Harness, text: str) -> None:
    """Wait until the open chat's last turn is ``text`` and its answer is shown."""
    await until(pilot, lambda: not h.screen.generating and h.backend.current().messages
                and h.backend.current().messages[-2].text == text and h.blocks("assistant")
                and h.blocks("assistant")[-1].text == h.backend.current().messages[-1].text)


def question(h: Harness) -> str:
    return shown(h.app.screen.query_one(".question"))


async def test_a_full_chat_goes_on_with_as_many_last_turns_as_fit():
    # system prompt 10 fake tokens, three turns of 99: 307 of 310; "more?" needs 314
    h = Harness(FakeBackend(answers=["word " * 90] * 3, context_limit=310))
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        for text in ("first", "second", "third"):
            await send(pilot, h, text)
            await answered(pilot, h, text)
        old = h.backend.current()
        assert old.num_tokens == 307
        h.screen.settings = SamplingParams(max_tokens=20)  # room: the message (6) and an answer of 20
        await send(pilot, h, MORE)
        await until(pilot, lambda: isinstance(h.app.screen, ConfirmScreen))
        text = question(h)
        assert "This chat is full: this turn needs 314 tokens; the context limit is 310 tokens." in text
        assert ("Continue in a new chat with the system prompt and the last 2 turns: 208 of 310 tokens, leaving room "
                "for the message (6 tokens) and an answer of 20?") in text
        await pilot.press("y")
        await answered(pilot, h, MORE)
        new = h.backend.current()
        assert new.id != old.id and new.title == "first (continued)"
        assert [m.text for m in new.messages] == ["second", old.messages[3].text, "third", old.messages[5].text,
                                                  MORE, "You said: more?"]
        assert new.num_tokens <= 310 and h.screen.query_one(ChatInput).text == ""
        assert "continued in a new chat with 2 turns" in h.notes
        assert [m.text for m in h.backend.chats[old.id].messages] == [m.text for m in old.messages]


async def test_documents_that_leave_no_room_offer_the_turns_alone_or_the_documents_alone(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("word " * 250)  # prefix: 264 fake tokens; one turn of 39: 303 of 308; "more?" needs 310
    h = Harness(FakeBackend(answers=["word " * 30], context_limit=308))
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        h.screen.run_engine(h.backend.new_chat, None, [str(doc)], h.screen.emit, then=h.screen.opened)
        await until(pilot, lambda: h.backend.current() is not None and h.backend.current().documents)
        await send(pilot, h, "first")
        await answered(pilot, h, "first")
        old = h.backend.current()
        h.screen.settings = SamplingParams(max_tokens=20)

        async def full_dialog() -> None:
            await send(pilot, h, MORE)
            await until(pilot, lambda: isinstance(h.app.screen, ChoiceScreen))
            assert ("The system prompt and documents are 264 of 308 tokens: the last turn (39 tokens) does not fit "
                    "beside them with room for the message (6 tokens) and an answer of 20.") in question(h)
            labels = [shown(b) for b in h.app.screen.query(".choice")]
            assert labels == ["1. the last turn, without the documents: 49 of 308 tokens",
                              "2. the documents alone: 264 of 308 tokens"]

        await full_dialog()
        await pilot.press("n")  # stay: nothing stored, the message back in the input
        await until(pilot, lambda: not isinstance(h.app.screen, ChoiceScreen))
        await pilot.pause()
        assert h.screen.query_one(ChatInput).text == MORE and list(h.backend.chats) == [old.id]
        h.screen.query_one(ChatInput).clear()

        await full_dialog()
        await pilot.press("1")
        await answered(pilot, h, MORE)
        turns = h.backend.current()
        assert turns.documents == [] and turns.id != old.id
        assert [m.text for m in turns.messages] == ["first", old.messages[1].text, MORE, "You said: more?"]

        h.screen.run_engine(h.backend.open_chat, old.id, then=h.screen.opened)
        await until(pilot, lambda: h.backend.current().id == old.id)
        await full_dialog()
        await pilot.press("2")
        await answered(pilot, h, MORE)
        docs = h.backend.current()
        assert docs.documents == ["doc.txt"] and docs.id not in (old.id, turns.id)
        assert [m.text for m in docs.messages] == [MORE, "You said: more?"] and docs.num_tokens <= 308
        assert [m.text for m in h.backend.chats[old.id].messages] == [m.text for m in old.messages]


@pytest.mark.model
async def test_real_model_a_full_document_chat_goes_on_on_the_documents_alone(smol_info, tmp_path):
    """A 256-token context (3 MiB pool): a document chat full after one turn goes on on the document alone; the
    message is answered there, on the document's cached prefix."""
    doc = tmp_path / "mill.txt"
    doc.write_text("The heron nests by the old mill, where the river runs past the stones. " * 9)
    import torch

    from kvchat.tui.real_backend import RealBackend

    torch.set_num_threads(1)
    h = Harness(RealBackend(str(smol_info.path), "fp8", pool_bytes=3 * 2**20, threads=1))
    backend, app = h.backend, h.app
    message = ("Tell me more about the heron, the mill, the river and the stones, and what the children do there "
               "in summer, in as much detail as you can.")
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: h.screen.ready, timeout=120)
        h.screen.settings = SamplingParams(max_tokens=8)
        h.screen.run_engine(backend.new_chat, None, [str(doc)], h.screen.emit, then=h.screen.opened)
        await until(pilot, lambda: backend.current() is not None and backend.current().documents, timeout=120)
        prefix = backend.current().num_tokens
        await send(pilot, h, "Where does the heron nest?")
        await until(pilot, lambda: not h.screen.generating and len(backend.current().messages) == 2, timeout=120)
        old = backend.current()
        assert old.context_limit == 256 and old.num_tokens + 40 > 256
        await send(pilot, h, message)
        await until(pilot, lambda: isinstance(app.screen, ChoiceScreen), timeout=60)
        assert f"documents are {prefix:,} of 256 tokens" in question(h)
        await pilot.press("2")
        await until(pilot, lambda: backend.current().id != old.id and not h.screen.generating
                    and len(backend.current().messages) == 2 and backend.current().messages[1].text, timeout=120)
        new = backend.current()
        assert new.documents == ["mill.txt"] and new.messages[0].text == message
        assert new.title == f"{old.title} (continued)" and prefix < new.num_tokens <= 256
        stats = backend._chats.last
        assert stats.reused_tokens >= prefix - 16 and stats.new_tokens >= 1  # on the cached document
        assert h.blocks("assistant")[-1].text == new.messages[1].text


async def test_an_answer_cut_at_the_context_limit_offers_the_ways_that_fit(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("word " * 200)  # prefix 214 fake tokens; the second answer runs into the 600-token limit
    h = Harness(FakeBackend(answers=["word " * 10, "word " * 400], context_limit=600))
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        h.screen.run_engine(h.backend.new_chat, None, [str(doc)], h.screen.emit, then=h.screen.opened)
        await until(pilot, lambda: h.backend.current() is not None and h.backend.current().documents)
        for text in ("first", "second"):
            await send(pilot, h, text)
            await answered(pilot, h, text)
        old = h.backend.current()
        assert old.num_tokens == 600
        await until(pilot, lambda: isinstance(h.app.screen, ChoiceScreen))
        assert question(h).startswith("The answer stopped at the context limit (600/600 tokens).\nThe system prompt "
                                      "and documents are 214 of 600 tokens: the last turn (367 tokens) does not fit "
                                      "beside them with room for an answer of 256.")
        assert [shown(b) for b in h.app.screen.query(".choice")] == ["1. the documents alone: 214 of 600 tokens"]
        await pilot.press("1")
        await until(pilot, lambda: h.backend.current().id != old.id)
        await pilot.pause()
        new = h.backend.current()
        assert new.documents == ["doc.txt"] and new.messages == [] and not h.screen.generating
        assert any(n == "continued in a new chat with doc.txt" for n in h.notes)
