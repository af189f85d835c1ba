"""The TUI driven with Pilot: the scripted FakeBackend for the flows, one short run on the real model.

The fake obeys the same contract as the real engine (tests/tui/test_tui_backend_contract.py).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from textual.widgets import Button, DataTable, Input, ListView, Markdown

from kvchat.conversation.views import ChatMessage, DocumentSummary
from kvchat.engine.turn import SamplingParams
from kvchat.tui.actions import ACTIONS, INPUT_KEYS
from kvchat.tui.app import KvchatApp
from kvchat.tui.fake_backend import FakeBackend
from kvchat.tui.screens.chat import ChatScreen
from kvchat.tui.screens.confirm import ConfirmScreen
from kvchat.tui.screens.help import HelpScreen
from kvchat.tui.screens.prompt import PromptScreen, split_paths
from kvchat.tui.widgets.chat_input import ChatInput
from kvchat.tui.widgets.message_view import PAGE, MessageView
from kvchat.tui.widgets.sidebar import CACHE_MARK, CACHE_MARK_MEANING
from kvchat.tui.widgets.status_bar import StatusBar

SIZE = (120, 40)
pytestmark = [pytest.mark.asyncio, pytest.mark.tui]


async def until(pilot, condition, timeout=10.0):
    """Let the app run until ``condition()`` is true (fails after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await pilot.pause(0.02)


def shown(widget) -> str:
    """The text a widget displays."""
    return str(widget.render())


class Harness:
    """An app on a FakeBackend, with the notifications it showed."""

    def __init__(self, backend: FakeBackend):
        self.backend = backend
        self.app = KvchatApp(self.backend)
        self.notes: list[str] = []
        notify = self.app.notify

        def record(message, **kwargs):
            self.notes.append(message)
            notify(message, **kwargs)

        self.app.notify = record

    @property
    def screen(self) -> ChatScreen:
        return self.app.screen_stack[0]

    def blocks(self, role=None):
        return self.screen.query_one(MessageView).blocks(role)

    def sidebar_titles(self) -> list[str]:
        """Titles of the chat rows; a row still being mounted (no Label yet) is not shown yet."""
        items = self.screen.query_one("#chats", ListView).children
        return [shown(labels.first()).split("\n")[0] for item in items if (labels := item.query("Label"))]

    async def send(self, pilot, text: str) -> None:
        await pilot.click(ChatInput)
        self.screen.query_one(ChatInput).text = text
        await pilot.press("enter")
        await until(pilot, lambda: not self.screen.generating and self.backend.current() is not None
                    and self.backend.current().messages and self.blocks("assistant")
                    and self.blocks("assistant")[-1].text == self.backend.current().messages[-1].text)


@pytest.fixture
def harness():
    return Harness(FakeBackend(answers=["Hello **world**", "Second answer", "Third answer"]))


async def ready(pilot, h: Harness) -> None:
    await until(pilot, lambda: h.screen.ready)
    await pilot.pause()


async def test_send_streams_the_answer_and_updates_status(harness):
    h = harness
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await h.send(pilot, "hi there")
        [user], [answer] = h.blocks("user"), h.blocks("assistant")
        assert user.text == "hi there" and answer.text == "Hello **world**"
        assert answer.query_one(Markdown).source == "Hello **world**"
        assert h.screen.query_one(ChatInput).text == ""
        status = shown(h.screen.query_one(StatusBar))
        assert "fake-model" in status and "KV fp8" in status and "TTFT 12 ms" in status and "100.0 tok/s" in status
        await until(pilot, lambda: h.sidebar_titles() == ["hi there"])


async def test_a_status_line_longer_than_the_terminal_wraps_instead_of_being_cut():
    name = "Meta-Llama-3.1-8B-Instruct-abliterated-GGUF-Q4_K_M-imported-from-a-very-long-path"
    h = Harness(FakeBackend(answers=["Hello"], model_names=(name,)))
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await h.send(pilot, "hi there")
        bar = h.screen.query_one(StatusBar)
        await until(pilot, lambda: "tok/s" in shown(bar))
        first = shown(bar).split("\n")[0]
        assert len(first) > bar.content_region.width  # the counters do not fit on one line here
        assert bar.content_region.height >= 3  # so they take two, and the second line still shows
        rendered = " ".join(bar.render_line(y).text.strip() for y in range(bar.region.height))
        assert name in rendered and "100.0 tok/s" in rendered and "loading" not in rendered  # nothing cut off


async def test_ctrl_j_inserts_a_newline_and_enter_sends(harness):
    h = harness
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await pilot.click(ChatInput)
        await pilot.press("a", "ctrl+j", "b")
        assert h.screen.query_one(ChatInput).text == "a\nb" and h.blocks() == []
        await pilot.press("enter")
        await until(pilot, lambda: [b.text for b in h.blocks("user")] == ["a\nb"])


async def test_escape_cancels_generation():
    h = Harness(FakeBackend(answers=["one two three four five"], hold_after=2))
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await pilot.click(ChatInput)
        await pilot.press("q", "enter")
        await until(pilot, lambda: h.blocks("assistant") and h.blocks("assistant")[0].text == "one two ")
        assert h.screen.generating
        await pilot.press("escape")
        await until(pilot, lambda: not h.screen.generating)
        answer = h.blocks("assistant")[0]
        marked = shown(answer.query_one(".stats"))
        assert answer.text == "one two " and "stopped" in marked
        await pilot.press("ctrl+n")
        await until(pilot, lambda: h.blocks() == [])
        await open_first_chat(pilot, h.screen)
        await until(pilot, lambda: len(h.blocks("assistant")) == 1)
        assert shown(h.blocks("assistant")[0].query_one(".stats")) == marked  # the reopened chat marks it too


async def test_typing_before_the_model_is_ready_keeps_the_text():
    gate = threading.Event()

    class SlowFake(FakeBackend):
        def load(self, emit):
            gate.wait(10)
            return super().load(emit)

    h = Harness(SlowFake())
    async with h.app.run_test(size=SIZE) as pilot:
        await pilot.click(ChatInput)
        await pilot.press("h", "i", "enter")
        assert h.screen.query_one(ChatInput).text == "hi" and h.blocks() == []
        assert "loading" in shown(h.screen.query_one(StatusBar))
        gate.set()
        await until(pilot, lambda: h.screen.ready)


async def test_new_chat_rename_and_delete_with_confirmation(harness):
    h = harness
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await h.send(pilot, "first chat")
        await pilot.press("f2")
        assert isinstance(h.app.screen, PromptScreen)
        h.app.screen.query_one(Input).value = "Renamed [bold]x[/]"
        await pilot.press("enter")
        await until(pilot, lambda: h.sidebar_titles() == ["Renamed [bold]x[/]"])
        await pilot.press("f8")
        assert isinstance(h.app.screen, ConfirmScreen)
        # the focused button is Cancel, so the dialog says which key deletes
        assert shown(h.app.screen.query_one(".hint")) == "y: Delete · n, Esc or Enter: Cancel"
        assert h.app.screen.focused.id == "no"
        await pilot.press("n")
        assert list(h.backend.chats) and not isinstance(h.app.screen, ConfirmScreen)
        await pilot.press("f8", "y")
        await until(pilot, lambda: h.sidebar_titles() == [] and h.blocks() == [])
        assert h.backend.chats == {}
        await h.send(pilot, "second chat")
        await pilot.press("ctrl+n")
        await until(pilot, lambda: h.blocks() == [] and h.backend.current().id is None)


async def two_chats(pilot, h: Harness) -> None:
    """Once ready, write a chat about zebras, then one about owls (left open)."""
    await ready(pilot, h)
    await h.send(pilot, "tell me about zebras")
    await pilot.press("ctrl+n")
    await h.send(pilot, "tell me about owls")
    await until(pilot, lambda: len(h.sidebar_titles()) == 2)


async def test_search_filters_the_sidebar(harness):
    h = harness
    async with h.app.run_test(size=SIZE) as pilot:
        await two_chats(pilot, h)
        await pilot.press("ctrl+f", *"zebr")
        await until(pilot, lambda: h.sidebar_titles() == ["tell me about zebras"])
        await pilot.click("#chats")
        await pilot.press("enter")
        await until(pilot, lambda: [b.text for b in h.blocks("user")] == ["tell me about zebras"])


async def test_a_sidebar_refresh_keeps_the_row_the_user_moved_to(harness):
    h = harness
    async with h.app.run_test(size=SIZE) as pilot:
        await two_chats(pilot, h)
        chats = h.screen.query_one("#chats", ListView)
        open_id = h.backend.current().id
        assert chats.highlighted_child.name == open_id, "unfocused, the highlight follows the open chat"
        chats.index = 1 - chats.index  # moved before the list has focus: a refresh landing now must keep it
        moved = chats.highlighted_child.name
        h.screen.refresh_lists()
        chats.focus()
        await until(pilot, lambda: not h.screen.workers)
        await pilot.pause()
        assert chats.highlighted_child.name == moved
        await pilot.press("down" if chats.index == 0 else "up")
        await pilot.press("down" if chats.index == 0 else "up")  # away and back by keyboard
        assert moved != open_id and chats.highlighted_child.name == moved
        h.screen.refresh_lists()
        await pilot.pause(0.2)
        await until(pilot, lambda: not h.screen.workers)
        # Two refreshes landing at once (two list workers' results) that both rebuild the rows (a new order):
        # their clear/extend must not interleave.
        lists = h.backend.list_chats()[::-1], h.backend.list_documents(), open_id
        await asyncio.gather(h.screen._set_lists(*lists), h.screen._set_lists(*lists))
        assert len(h.sidebar_titles()) == 2
        h.screen.refresh_lists()
        await pilot.pause(0.2)
        await until(pilot, lambda: not h.screen.workers)
        assert chats.highlighted_child.name == moved, "a refresh moved the user's highlight"
        await pilot.press("enter")
        await until(pilot, lambda: h.backend.current().id == moved)
        await pilot.click(ChatInput)
        await pilot.press("ctrl+n")
        h.screen.refresh_lists()
        await until(pilot, lambda: not h.screen.workers and chats.index is None)  # no open chat: no highlight


async def test_enter_opens_the_highlighted_or_else_the_first_chat(harness):
    """Tab to the list and Enter opens a chat though none is highlighted; so does Enter in the search box."""
    h = harness
    async with h.app.run_test(size=SIZE) as pilot:
        await two_chats(pilot, h)
        await pilot.press("ctrl+n")
        chats = h.screen.query_one("#chats", ListView)
        await until(pilot, lambda: h.backend.current().id is None and not h.screen.workers and chats.index is None)
        first = h.backend.list_chats()[0].id
        while not chats.has_focus:
            await pilot.press("tab")
        chats.index = None  # as when the rows arrive after the list got focus
        await pilot.press("enter")
        await until(pilot, lambda: h.backend.current().id == first and len(h.blocks("user")) == 1)
        await pilot.press("ctrl+f", *"zebr", "enter")
        await until(pilot, lambda: [b.text for b in h.blocks("user")] == ["tell me about zebras"])
        await pilot.press("f1")
        table = h.app.screen.query_one(DataTable)
        assert any("open a stored chat" in str(table.get_row_at(i)[2]).lower() for i in range(table.row_count))


async def test_the_resume_line_lasts_until_the_next_turn_finishes(harness):
    h = harness
    async with h.app.run_test(size=SIZE) as pilot:
        await two_chats(pilot, h)
        status = h.screen.query_one(StatusBar)
        zebras = next(c.id for c in h.backend.list_chats() if "zebras" in c.title)
        chats = h.screen.query_one("#chats", ListView)
        chats.focus()
        await until(pilot, lambda: chats.has_focus)
        chats.index = [c.id for c in h.backend.list_chats()].index(zebras)
        await pilot.press("enter")
        await until(pilot, lambda: h.backend.current().id == zebras and "resumed" in shown(status))
        await h.send(pilot, "and their stripes?")
        assert "resumed" not in shown(status) and "TTFT 12 ms" in shown(status)
        assert h.backend.status().resume is not None, "the backend still knows how the chat was opened"


async def test_the_last_turn_figures_are_the_open_chats_own(harness):
    """TTFT and tok/s describe the open chat's last answer: none in a new chat, the stored chat's own when it
    is opened again, never the figures of the chat left."""
    h = harness
    async with h.app.run_test(size=SIZE) as pilot:
        await h.send(pilot, "hi there")
        status = h.screen.query_one(StatusBar)
        assert "TTFT 12 ms" in shown(status) and "100.0 tok/s" in shown(status)
        chat_id = h.backend.current().id
        await pilot.press("ctrl+n")
        await until(pilot, lambda: h.backend.current().id is None and not h.screen.workers)
        await until(pilot, lambda: "TTFT" not in shown(status) and "tok/s" not in shown(status))
        chats = h.screen.query_one("#chats", ListView)
        chats.focus()
        await until(pilot, lambda: chats.has_focus and len(chats.children) == 1)
        chats.index = 0
        await pilot.press("enter")
        await until(pilot, lambda: h.backend.current().id == chat_id and "TTFT 12 ms" in shown(status)
                    and "100.0 tok/s" in shown(status))


class SlowSearch(FakeBackend):
    """``list_chats(hold)`` waits for ``gate`` (a slow SQLite search); every query is recorded."""

    def __init__(self, hold: str, **kwargs):
        super().__init__(**kwargs)
        self.hold, self.gate, self.queries = hold, threading.Event(), []

    def list_chats(self, query: str = ""):
        self.queries.append(query)
        if query == self.hold:
            self.gate.wait(timeout=10)
        return super().list_chats(query)


async def test_typing_a_search_never_waits_and_a_stale_result_never_lands():
    h = Harness(SlowSearch("a", answers=["Zebras run.", "Owls hoot."]))
    async with h.app.run_test(size=SIZE) as pilot:
        await two_chats(pilot, h)
        search = h.screen.query_one("#search", Input)
        await pilot.press("ctrl+f", "a")
        await until(pilot, lambda: "a" in h.backend.queries)  # the search for "a" (both chats) now hangs
        await pilot.press(*"bout z")
        assert search.value == "about z", "typing waited for the search"
        await until(pilot, lambda: h.sidebar_titles() == ["tell me about zebras"])
        h.backend.gate.set()  # the stale search finishes last
        await pilot.pause(0.5)
        assert h.sidebar_titles() == ["tell me about zebras"], "a stale search result replaced the last one"
        typed = [q for q in h.backend.queries if q not in ("", "a")]
        assert len(typed) < len("bout z"), f"one search per keystroke: {typed}"


async def test_export_writes_markdown_in_the_current_dir(harness, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    h = harness
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await h.send(pilot, "hi there")
        await pilot.press("ctrl+s")
        [path] = tmp_path.glob("kvchat-*.md")
        assert path.read_text() == "# hi there\n\n**System prompt:** You are a helpful assistant.\n\n" \
                                   "## You\n\nhi there\n\n## Assistant\n\nHello **world**\n"
        assert any(str(path) in n for n in h.notes)


async def test_help_lists_every_binding(harness):
    h = harness
    async with h.app.run_test(size=SIZE) as pilot:
        await pilot.press("f1")
        assert isinstance(h.app.screen, HelpScreen)
        table = h.app.screen.query_one(DataTable)
        keys = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
        assert keys == [a.key for a in ACTIONS] + [k for k, _ in INPUT_KEYS] + list(CACHE_MARK.values())
        assert "ctrl+j" in keys and "shared with other chats" in str(table.get_row_at(table.row_count - 3)[2])
        await pilot.press("escape")
        assert isinstance(h.app.screen, ChatScreen)
        palette = {c.title for c in h.app.get_system_commands(h.app.screen)}
        assert {a.title for a in ACTIONS} <= palette | {"Theme"}


@pytest.mark.parametrize("size", [(80, 30), SIZE, (200, 50)])
async def test_help_fits_the_terminal_width_and_wraps_long_lines(harness, size):
    h = harness
    async with h.app.run_test(size=size) as pilot:
        await pilot.press("f1")
        table = h.app.screen.query_one(DataTable)
        await until(pilot, lambda: table.row_count and table.size.width)
        await pilot.pause()
        assert table.virtual_size.width <= table.size.width  # nothing to scroll sideways to
        texts = [str(table.get_row_at(i)[2]) for i in range(table.row_count)]
        assert texts == [a.help for a in ACTIONS] + [t for _, t in INPUT_KEYS] + list(CACHE_MARK_MEANING.values())
        longest = max(range(table.row_count), key=lambda i: len(texts[i]))
        width = table.ordered_columns[2].width
        assert (table.ordered_rows[longest].height > 1) == (len(texts[longest]) > width)  # wrapped where too long


async def test_bad_document_path_is_a_notice_not_a_crash(harness, tmp_path):
    h = harness
    doc = tmp_path / "notes.txt"
    doc.write_text("The heron nests by the mill.")
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await pilot.press("ctrl+o")
        h.app.screen.query_one(Input).value = str(tmp_path / "missing.txt")
        await pilot.press("enter")
        await until(pilot, lambda: any("cannot read document" in n for n in h.notes))
        assert isinstance(h.app.screen, ChatScreen)
        await pilot.press("ctrl+o")
        h.app.screen.query_one(Input).value = str(doc)
        await pilot.press("enter")
        await until(pilot, lambda: h.blocks("notice"))
        assert h.blocks("notice")[0].text == "Documents (cached prefix): notes.txt"
        await until(pilot, lambda: len(h.screen.query_one("#documents", ListView).children) == 1)


async def test_the_sidebar_lists_only_documents_with_a_file(harness, tmp_path):
    """A document pasted into a message (``kvchat doc list``: ``pasted: …``) names no file to start a chat on."""
    h = harness
    h.backend.documents["pasted"] = DocumentSummary("d_pasted", "pasted: Section 0.", "", 300, "disk")
    doc = tmp_path / "notes.txt"
    doc.write_text("The heron nests by the mill.")
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await pilot.press("ctrl+o")
        h.app.screen.query_one(Input).value = str(doc)
        await pilot.press("enter")
        rows = lambda: [item.name for item in h.screen.query_one("#documents", ListView).children]  # noqa: E731
        await until(pilot, lambda: str(doc) in rows())
        assert rows() == [str(doc)]


async def test_attach_takes_any_real_file_path_even_with_a_semicolon(harness, tmp_path):
    odd, plain = tmp_path / "notes;v2.txt", tmp_path / "plain.txt"
    odd.write_text("The heron nests by the mill.")
    plain.write_text("The mill stands by the river.")
    assert split_paths(str(odd)) == [str(odd)]
    assert split_paths(f" {odd} ;{plain};") == [str(odd), str(plain)]
    assert split_paths("missing.txt; other.txt") == ["missing.txt", "other.txt"]
    h = harness
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await pilot.press("ctrl+o")
        assert "contains ;" in shown(h.app.screen.query_one(".question")), "the prompt says how ; is read"
        h.app.screen.query_one(Input).value = str(odd)
        await pilot.press("enter")
        await until(pilot, lambda: h.blocks("notice"))
        assert h.blocks("notice")[0].text == "Documents (cached prefix): notes;v2.txt"


async def test_markup_and_escape_sequences_are_shown_literally():
    nasty = "[bold]x[/] [link=http://e]y[/link] \x1b[31mred"
    h = Harness(FakeBackend(answers=[nasty]))
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await h.send(pilot, "[/] and [red]")
        user, answer = h.blocks("user")[0], h.blocks("assistant")[0]
        assert shown(user.query_one(".body")) == "[/] and [red]"
        paragraph = answer.query_one(Markdown).query_one("MarkdownParagraph")
        assert shown(paragraph) == "[bold]x[/] [link=http://e]y[/link] ␛[31mred"
        await until(pilot, lambda: h.sidebar_titles() == ["[/] and [red]"])


async def test_regenerate_and_edit_last(harness):
    h = harness
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await h.send(pilot, "question")
        await pilot.press("ctrl+r")
        await until(pilot, lambda: [b.text for b in h.blocks()] == ["question", "Second answer"])
        await pilot.press("f4")
        assert h.screen.query_one(ChatInput).text == "question"
        await h.send(pilot, "better question")
        assert [b.text for b in h.blocks()] == ["better question", "Third answer"]
        assert [m.text for m in h.backend.current().messages] == ["better question", "Third answer"]


async def test_settings_dialog_validates_and_applies(harness):
    h = harness
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await pilot.press("ctrl+g")
        h.app.screen.query_one("#temperature", Input).value = "hot"
        await pilot.press("enter")
        assert "temperature must be a number" in shown(h.app.screen.query_one("#settings-error"))
        h.app.screen.query_one("#temperature", Input).value = "0.7"
        h.app.screen.query_one("#frequency_penalty", Input).value = "2.5"
        await pilot.press("enter")
        assert "frequency_penalty must be in [-2, 2]" in shown(h.app.screen.query_one("#settings-error"))
        h.app.screen.query_one("#frequency_penalty", Input).value = "0.5"
        h.app.screen.query_one("#max_tokens", Input).value = "1"
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(h.app.screen, ChatScreen))
        assert h.screen.settings == SamplingParams(temperature=0.7, max_tokens=1, frequency_penalty=0.5)
        await h.send(pilot, "q")
        answer = h.blocks("assistant")[0]
        assert answer.text == "Hello " and "stopped at max tokens" in shown(answer.query_one(".stats"))


async def test_long_history_is_mounted_lazily(harness):
    h = harness
    messages = [ChatMessage("user" if i % 2 == 0 else "assistant", f"message {i}") for i in range(3 * PAGE + 4)]
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        view = h.screen.query_one(MessageView)
        await view.show(messages, [])
        assert [b.text for b in view.blocks()] == [m.text for m in messages[-PAGE:]]
        view.query_one("#earlier", Button).press()  # scrolled out of view at the top: no click
        await until(pilot, lambda: len(view.blocks()) == 2 * PAGE)
        assert view.blocks()[0].text == messages[-2 * PAGE].text
        assert str(view.query_one("#earlier", Button).label) == f"▲ {len(messages) - 2 * PAGE} earlier messages"


async def test_copy_cache_screen_system_prompt_and_quit(harness):
    h = harness
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await pilot.press("f3")
        h.app.screen.query_one("#system-text").text = "Answer briefly."
        await pilot.press("ctrl+s")
        await until(pilot, lambda: h.backend.current() and h.backend.current().system_prompt == "Answer briefly.")
        await h.send(pilot, "hi")
        await pilot.press("f9")
        assert h.app.clipboard == "Hello **world**"
        await pilot.press("f5")
        table = h.app.screen.query_one(DataTable)
        await until(pilot, lambda: table.row_count == 1)
        await pilot.press("p")
        await until(pilot, lambda: h.backend.list_chats()[0].pinned)
        assert h.backend.cache_report().rows[0].disk_bytes > 0
        await pilot.press("d")
        await until(pilot, lambda: h.backend.cache_report().rows[0].disk_bytes == 0)
        await pilot.press("escape")
        await pilot.press("ctrl+q")
        await until(pilot, lambda: h.backend.shutdown_called)


async def open_first_chat(pilot, screen) -> None:
    await until(pilot, lambda: len(screen.query_one("#chats", ListView).children) == 1, timeout=60)
    await pilot.click("#chats")
    await pilot.press("enter")


def real_app(smol_info):
    """``(backend, app)``: the app on the real backend (SmolLM2, a 1,024-token fp8 pool, one thread)."""
    import torch

    from kvchat.tui.real_backend import RealBackend

    torch.set_num_threads(1)
    backend = RealBackend(str(smol_info.path), "fp8", pool_bytes=12 * 2**20, threads=1)
    return backend, KvchatApp(backend)


async def test_real_model_end_to_end(smol_info):
    """Real engine: stream an answer, reopen it (from memory), quit, restart: the history comes from disk, and
    the answer's marker (stopped at max tokens) with it."""
    backend, app = real_app(smol_info)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen_stack[0]
        await until(pilot, lambda: screen.ready, timeout=120)
        screen.settings = SamplingParams(max_tokens=8)
        await pilot.click(ChatInput)
        screen.query_one(ChatInput).text = "Name a fruit."
        await pilot.press("enter")
        view = screen.query_one(MessageView)
        await until(pilot, lambda: not screen.generating and view.blocks("assistant")
                    and view.blocks("assistant")[0].text, timeout=120)
        status = shown(screen.query_one(StatusBar))
        assert "TTFT" in status and "tok/s" in status and "SmolLM2" in status
        answer, chat_id = view.blocks("assistant")[0].text, backend.current().id
        marked = shown(view.blocks("assistant")[0].query_one(".stats"))
        assert "stopped at max tokens" in marked  # 8 tokens cannot hold the answer
        await pilot.press("ctrl+n")
        await until(pilot, lambda: backend.current().id is None and view.blocks() == [])
        await open_first_chat(pilot, screen)
        await until(pilot, lambda: backend.current().id == chat_id and len(view.blocks()) == 2, timeout=60)
        resume = backend.status().resume
        # the pool's whole blocks, then the files' tail: the whole history is resident
        assert resume.tokens == backend.current().num_tokens and resume.tokens - resume.from_disk >= 48
        assert "prefill skipped" in shown(screen.query_one(StatusBar))
        await pilot.press("ctrl+q")
        await until(pilot, lambda: app._shut_down, timeout=60)

    backend, app = real_app(smol_info)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen_stack[0]
        await until(pilot, lambda: screen.ready, timeout=120)
        await open_first_chat(pilot, screen)
        view = screen.query_one(MessageView)
        await until(pilot, lambda: backend.current() is not None and len(view.blocks()) == 2, timeout=60)
        assert view.blocks("assistant")[0].text == answer
        assert shown(view.blocks("assistant")[0].query_one(".stats")) == marked  # how it ended, from the store
        resume = backend.status().resume
        assert resume.from_disk == resume.tokens >= backend.current().num_tokens - 16  # nothing was in memory
        assert f"resumed {resume.tokens:,} tokens from disk" in shown(screen.query_one(StatusBar))
        screen.settings = SamplingParams(max_tokens=4)
        await pilot.click(ChatInput)
        screen.query_one(ChatInput).text = "And a vegetable?"
        await pilot.press("enter")
        await until(pilot, lambda: not screen.generating and len(view.blocks()) == 4, timeout=120)
        stats = backend._chats.last
        assert stats.reused_tokens >= resume.tokens and stats.prefilled_tokens < 40  # the new message, not history
        await pilot.press("ctrl+q")
        await until(pilot, lambda: app._shut_down, timeout=60)
