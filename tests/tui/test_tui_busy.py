"""What the chat screen does with each action while engine work runs (an attach, a turn, a chat switch).

The fake backend holds a document's prefill open (``prefill_gate``) or an answer mid-stream (``hold_after``),
so every race is deterministic; the last tests run the reported sequence on the real model and store.
"""

from __future__ import annotations

import threading

import pytest
from test_tui_app import SIZE, Harness, ready, shown, until
from textual.widgets import Input

from kvchat.conversation.events import PrefillProgress
from kvchat.engine.turn import SamplingParams
from kvchat.tui.fake_backend import FakeBackend
from kvchat.tui.screens.busy import Act, Job, Verdict, decide
from kvchat.tui.widgets.chat_input import ChatInput
from kvchat.tui.widgets.status_bar import StatusBar

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


def status(h: Harness) -> str:
    return shown(h.screen.query_one(StatusBar))


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


async def test_the_status_bar_names_the_attach_from_its_first_moment_and_esc_cancels_it(doc):
    gate = threading.Event()
    h = Harness(FakeBackend(prefill_gate=gate))
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await h.send(pilot, "hello")
        before = (h.backend.current(), list(h.backend.chats), h.backend.list_documents())
        await attach(pilot, h, doc)
        assert "attaching notes.txt" in status(h), "shown before the worker reports anything"
        await until(pilot, lambda: "prefilling 0 / " in status(h))  # the fake holds the prefill here
        await type_and_send(pilot, h, "Summarize this.")
        await until(pilot, lambda: "1 message waits" in status(h))
        await pilot.press("escape")
        await until(pilot, lambda: h.screen.job is None)
        assert any("attach cancelled; nothing was stored" in n for n in h.notes)
        assert (h.backend.current(), list(h.backend.chats), h.backend.list_documents()) == before
        assert h.screen.query_one(ChatInput).text == "Summarize this.", "the queued message is given back"
        assert [b.text for b in h.blocks("user")] == ["hello"] and "attaching" not in status(h)


ACTION_KEYS = {  # every action that needs the engine or changes the open chat, by its key
    "new chat": ("ctrl+n",), "attach": ("ctrl+o",), "regenerate": ("ctrl+r",), "edit": ("f4",),
    "delete": ("f8",), "system prompt": ("f3",),
}


async def try_each_action(pilot, h: Harness, reason: str) -> None:
    """Each action of :data:`ACTION_KEYS`, a sidebar open, and (for a turn) a send: refused with ``reason``,
    no dialog opened, the input and the open chat unchanged."""
    for name, keys in ACTION_KEYS.items():
        h.notes.clear()
        await pilot.press(*keys)
        await pilot.pause()
        assert h.notes == [reason] and h.app.screen is h.screen, name
    h.notes.clear()
    h.screen.query_one(ChatInput).text = ""
    h.screen.on_sidebar_chat_chosen(type("Chosen", (), {"chat_id": "c_another"})())
    assert h.notes == [reason], "open a chat from the sidebar"


async def test_every_action_during_an_attach_is_queued_refused_or_cancels(doc):
    gate = threading.Event()
    h = Harness(FakeBackend(answers=["First.", "From the notes."], prefill_gate=gate))
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await h.send(pilot, "hello")
        first = h.backend.current().id
        await attach(pilot, h, doc)
        await until(pilot, lambda: "prefilling 0 / " in status(h))
        await try_each_action(pilot, h, "a document is being attached (Esc cancels it)")
        await type_and_send(pilot, h, "Summarize this.")
        await pilot.press("f2")  # a rename touches neither the engine nor the open chat: allowed, the attach goes on
        h.app.screen.query_one(Input).value = "Greetings"
        await pilot.press("enter")
        await until(pilot, lambda: h.backend.chats[first].title == "Greetings")
        await pilot.pause(0.1)
        assert h.screen.job is Job.ATTACH and "attaching notes.txt: prefilling 0 / " in status(h)
        assert "1 message waits" in status(h)
        h.notes.clear()
        await type_and_send(pilot, h, "And another?")
        assert h.notes == ["a message is already waiting for the document; it is sent once the document is ready"]
        assert h.screen.query_one(ChatInput).text == "And another?"
        gate.set()
        await until(pilot, lambda: h.screen.job is None and len(h.backend.chats) == 2)
        doc_chat = next(c for c in h.backend.chats.values() if c.id != first)
        assert doc_chat.documents == ["notes.txt"] and doc_chat.messages[0].text == "Summarize this."
        assert [m.text for m in h.backend.chats[first].messages] == ["hello", "First."]


async def test_every_action_during_an_answer_is_refused_or_cancels():
    h = Harness(FakeBackend(answers=["one", "two three four five"], hold_after=2))
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        h.backend.hold_after = None
        await h.send(pilot, "hello")
        h.backend.hold_after = 2
        await type_and_send(pilot, h, "more")
        await until(pilot, lambda: h.blocks("assistant")[-1].text == "two three ")
        await try_each_action(pilot, h, "an answer is being generated (Esc stops it)")
        h.notes.clear()
        await type_and_send(pilot, h, "typed meanwhile")
        assert h.notes == ["an answer is being generated (Esc stops it)"]
        assert h.screen.query_one(ChatInput).text == "typed meanwhile"
        await pilot.press("escape")
        await until(pilot, lambda: h.screen.job is None)
        assert [m.text for m in h.backend.current().messages] == ["hello", "one", "more", "two three "]


@pytest.mark.parametrize("during", ["attach", "answer"])
async def test_quit_cancels_the_running_job_and_exits(doc, during):
    gate = threading.Event()
    h = Harness(FakeBackend(answers=["one two three four"], hold_after=2, prefill_gate=gate))
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        if during == "attach":
            await attach(pilot, h, doc)
            await until(pilot, lambda: "prefilling 0 / " in status(h))
        else:
            await type_and_send(pilot, h, "count")
            await until(pilot, lambda: h.blocks("assistant") and h.blocks("assistant")[-1].text == "one two ")
        await pilot.press("ctrl+q")
        await until(pilot, lambda: h.backend.shutdown_called)
    assert h.app.return_code == 0
    if during == "attach":
        assert h.backend.list_documents() == [] and h.backend.chats == {}
    else:
        [chat] = h.backend.chats.values()
        assert [m.text for m in chat.messages] == ["count", "one two "], "the stopped answer is kept"


@pytest.mark.parametrize("act, job, verdict", [
    (Act.SEND, Job.CALL, Verdict.REFUSE), (Act.CHANGE_CHAT, Job.CALL, Verdict.REFUSE),
    (Act.CANCEL, Job.CALL, Verdict.ALLOW), (Act.QUIT, Job.CALL, Verdict.ALLOW),
    (Act.SEND, None, Verdict.ALLOW), (Act.CANCEL, Job.ATTACH, Verdict.CANCEL),
])
async def test_a_short_call_refuses_what_would_race_it(act, job, verdict):
    """Opening, creating or deleting a chat cannot be held open by the fake: the table is checked directly."""
    assert decide(act, job).verdict is verdict
    assert decide(Act.SEND, None, not_ready="the model is still loading").reason == "the model is still loading"


def hold_prefills(backend) -> threading.Event:
    """Hold every document prefill of the real ``backend`` after each chunk's progress event until the returned
    gate is set (or the attach is cancelled), so a key typed during an attach lands during it on any machine."""
    gate, new_chat = threading.Event(), backend.new_chat

    def held_new_chat(system, paths, emit, cancel=None):
        def held(event):
            emit(event)
            if isinstance(event, PrefillProgress):
                while not gate.wait(timeout=0.01) and not (cancel is not None and cancel.is_set()):
                    pass

        return new_chat(system, paths, held, cancel)

    backend.new_chat = held_new_chat
    return gate


def stored():
    """(conversations with their documents and messages, document titles) as the SQLite store holds them."""
    from kvchat.index import get_db
    from kvchat.store.conversations import get_conversation, list_conversations
    from kvchat.store.documents import list_documents

    db = get_db()
    convs = [get_conversation(db, c.id) for c in list_conversations(db)]
    return ([(c.settings.get("documents"), [(m.role, m.text) for m in c.messages]) for c in convs],
            [d.title for d in list_documents(db)])


async def test_real_model_message_sent_while_a_document_prefills_then_esc_and_quit_during_a_prefill(smol_info, tmp_path):
    """The reported sequence on the real engine and store: attach an uncached document and send a question at
    once: it waits for the document's chat, is stored there and answered. Then Esc, and quit, during another
    document's prefill: nothing of it is stored."""
    import torch

    from kvchat.tui.real_backend import RealBackend

    torch.set_num_threads(1)
    # a ~6,800-token pool holds the first chat and the second document beside it; each document is several
    # 512-token chunks, so Esc or quit land between chunks
    h = Harness(RealBackend(str(smol_info.path), "fp8", pool_bytes=80 * 2**20, threads=1))
    backend, app = h.backend, h.app
    gate = hold_prefills(backend)
    notes = tmp_path / "heron.txt"
    notes.write_text("Field notes. The grey heron nests in the alders by the old mill. " * 160)
    other = tmp_path / "otter.txt"
    other.write_text("Survey. The otter holt lies under the willow roots by the weir. " * 150)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: h.screen.ready, timeout=120)
        h.screen.settings = SamplingParams(max_tokens=8)
        await attach(pilot, h, notes)
        assert "attaching heron.txt" in status(h)
        await type_and_send(pilot, h, "Summarize this.")
        assert h.screen.job is Job.ATTACH and "1 message waits" in status(h), "sent while the document prefills"
        gate.set()
        await until(pilot, lambda: h.screen.job is None and backend.current().id is not None, timeout=180)
        [(docs, messages)], titles = stored()
        assert docs == ["heron.txt"] and titles == ["heron.txt"]
        assert messages[0] == ("user", "Summarize this.") and messages[1][0] == "assistant" and messages[1][1]
        assert h.blocks("assistant")[-1].text == messages[1][1]

        gate.clear()
        await attach(pilot, h, other)
        await until(pilot, lambda: "prefilling" in status(h), timeout=60)
        await pilot.press("escape")
        await until(pilot, lambda: h.screen.job is None, timeout=120)
        assert any("attach cancelled; nothing was stored" in n for n in h.notes), (h.notes, stored())
        assert stored() == ([(docs, messages)], titles), "no document row, no chat for the cancelled attach"
        assert [r.title for r in backend.list_documents()] == ["heron.txt"]
        await attach(pilot, h, other)
        await until(pilot, lambda: "prefilling" in status(h), timeout=60)
        await pilot.press("ctrl+q")  # quit during a prefill: it stops, then the cache is flushed
        await until(pilot, lambda: app.return_code is not None, timeout=60)  # shut down and flushed
    assert app.return_code == 0 and stored() == ([(docs, messages)], titles)
