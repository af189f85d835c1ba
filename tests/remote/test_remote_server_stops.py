"""A real ``kvchat serve`` that is down when kvchat starts, or stops in the middle of an answer.

The TUI starts on a server that is not up: one status line says so, the chats in the store are listed and
opened, and the first message sent once the server is up is answered (no restart). When the server shuts down
(SIGTERM) or is killed (SIGKILL) mid-answer, the question and the part of the answer that came are kept in the
local chat, marked ``interrupted`` (as Esc or Ctrl-C keep a stopped answer), the error is one line that names
nothing of the server's own (not its chat id), the TUI leaves the box empty (the question is in the chat) and
answers the next turn once the server is back; ``kvchat ask --server`` says the one line, exits 2 and names the local chat.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sqlite3
import subprocess
import sys

import pytest
from process_helpers import RUN_KVCHAT, run_kvchat
from remote_stub import KEY, StubServer
from server_helpers import API_KEY, Server

from kvchat.engine.turn import SamplingParams
from kvchat.tui.app import KvchatApp
from kvchat.tui.remote_backend import RemoteBackend
from kvchat.tui.widgets.chat_input import ChatInput
from kvchat.tui.widgets.status_bar import StatusBar

pytestmark = [pytest.mark.model, pytest.mark.tui]
SIZE = (120, 40)
LONG = "Count from 1 to 300, one number per line."  # an answer long enough to be cut while it streams
KEPT = "the question and the part of the answer that came are kept in the chat, marked interrupted"


async def until(pilot, condition, timeout=180.0):
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await pilot.pause(0.05)


def status(app) -> str:
    return str(app.screen_stack[0].query_one(StatusBar).render())


def stored_messages(home) -> list[tuple[str, str, str, str | None]]:
    with sqlite3.connect(home / "kvchat.db") as conn:
        return conn.execute("SELECT conversation_id, role, text, finish_reason FROM messages ORDER BY rowid").fetchall()


async def send(pilot, screen, text: str) -> None:
    await pilot.click(ChatInput)
    screen.query_one(ChatInput).text = text
    await pilot.press("enter")


@pytest.mark.asyncio
async def test_tui_on_a_server_that_starts_late_and_stops_mid_answer(smol_info, tmp_path, kvchat_home, monkeypatch):
    monkeypatch.setenv("STUB_KEY", KEY)
    with StubServer() as stub:  # a chat held earlier with another server: listed, opened, whatever this one does
        assert run_kvchat(kvchat_home, "ask", "--server", stub.url, "--api-key-env", "STUB_KEY",
                          "Earlier question").returncode == 0
    server = Server(tmp_path / "serve-home")  # its port is chosen; nothing listens there yet
    backend = RemoteBackend(server.url, API_KEY)
    app, notes = KvchatApp(backend), []
    notify = app.notify
    app.notify = lambda message, **kw: (notes.append(message), notify(message, **kw))
    try:
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen_stack[0]
            await until(pilot, lambda: screen.ready and "cannot reach the server" in status(app))
            assert len(status(app).splitlines()[1:]) == 1 and "asks it again at the next message" in status(app)
            [earlier] = backend.list_chats()
            screen.run_engine(backend.open_chat, earlier.id, then=screen.opened)
            await until(pilot, lambda: backend.current() is not None and screen.job is None)
            assert [m.text for m in backend.current().messages] == ["Earlier question", "Half an answer"]
            await pilot.press("ctrl+n")
            await until(pilot, lambda: backend.current().id is None and screen.job is None)

            await asyncio.to_thread(server.start)  # after the app: its next message finds it
            screen.settings = SamplingParams(max_tokens=400)
            await send(pilot, screen, LONG)
            await until(pilot, lambda: screen._answer is not None and len(screen._answer.text) >= 8)
            assert notes == [], "the server was asked again at the message"
            await asyncio.to_thread(server.stop)  # SIGTERM: kvchat serve cuts the answer and says where it kept it
            await until(pilot, lambda: notes and not screen.generating)
            [note] = notes
            assert "stopped mid-answer" in note and KEPT in note and "\n" not in note, note
            assert not re.search(r"\bc_[0-9a-f]+", note), "the server's own chat id is not named"
            [question, answer] = backend.current().messages
            assert (question.text, answer.finish_reason) == (LONG, "interrupted") and len(answer.text) >= 8
            assert screen.query_one(ChatInput).text == "", "the question is in the chat, not handed back to send twice"
            assert "stopped mid-answer" in status(app).splitlines()[1]

            await asyncio.to_thread(server.start)
            screen.query_one(ChatInput).text = ""
            screen.settings = SamplingParams(max_tokens=8)
            await send(pilot, screen, "Name a fruit.")
            await until(pilot, lambda: len(backend.current().messages) == 4 and not screen.generating)
            assert len(notes) == 1 and backend.current().messages[-1].finish_reason in ("stop", "length")
            assert "stopped mid-answer" not in status(app)
            chat_id = backend.current().id
            await pilot.press("ctrl+q")
    finally:
        server.stop()
    rows = [r for r in stored_messages(kvchat_home) if r[0] == chat_id]
    assert [(role, text) for _, role, text, _ in rows[:1]] == [("user", LONG)]
    assert [finish for *_, finish in rows[1::2]][0] == "interrupted" and len(rows) == 4


@pytest.mark.parametrize("sig", [signal.SIGKILL], ids=["killed"])
def test_ask_keeps_the_question_and_the_part_answered_when_the_server_dies(smol_info, tmp_path, kvchat_home, sig):
    server = Server(tmp_path / "serve-home").start()
    env = {**os.environ, "KVCHAT_HOME": str(kvchat_home), "SERVE_KEY": API_KEY}
    proc = subprocess.Popen([sys.executable, "-c", RUN_KVCHAT, "ask", "--server", server.url, "--api-key-env",
                             "SERVE_KEY", "--max-tokens", "400", LONG], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        shown = proc.stdout.read(8)  # the answer streams
        server.stop(sig)
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        server.stop()
    assert len(shown) == 8 and proc.returncode == 2, err
    [line] = err.strip().splitlines()
    [(chat_id, *_), (_, role, text, finish)] = stored_messages(kvchat_home)
    assert line == (f"kvchat: error: the server at {server.url} stopped mid-answer (the connection was cut); "
                    f"{KEPT} (chat {chat_id})"), line
    assert (role, finish) == ("assistant", "interrupted") and (shown + rest)[:-1] == text, (text, shown + rest)
