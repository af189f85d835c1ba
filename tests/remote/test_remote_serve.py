"""The TUI and ``kvchat ask --server`` on a real ``kvchat serve`` process: each holds a 3-turn conversation,
the server is restarted, and the next turn of each says it resumed the history from the server's disk (the
status bar, ``--json``); the chats are in the local store as text (listed, searchable, reopened)."""

from __future__ import annotations

import json
import re

import pytest
from process_helpers import run_kvchat
from server_helpers import API_KEY, MODEL, Server

from kvchat.engine.turn import SamplingParams
from kvchat.tui.app import KvchatApp
from kvchat.tui.remote_backend import RemoteBackend
from kvchat.tui.widgets.chat_input import ChatInput
from kvchat.tui.widgets.status_bar import StatusBar

pytestmark = [pytest.mark.model, pytest.mark.tui]
SIZE = (120, 40)
TURNS = ("Name a fruit.", "Name a colour.", "Name a tree.")  # the TUI's
ASKED = ("Name a river.", "Name a city.", "Name a bird.")  # ask's (another history: nothing shared to reuse)
MAX_TOKENS = 8


async def until(pilot, condition, timeout=120.0):
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await pilot.pause(0.05)


async def tui_turns(server_url: str, texts, chat_id: str | None = None) -> tuple[list[str], str]:
    """Run the TUI on the server, (open ``chat_id`` and) send ``texts``; returns the status bar after each
    answer and the chat's id."""
    backend = RemoteBackend(server_url, API_KEY)
    app, lines = KvchatApp(backend), []
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen_stack[0]
        await until(pilot, lambda: screen.ready)
        screen.settings = SamplingParams(max_tokens=MAX_TOKENS)
        if chat_id is not None:
            screen.run_engine(backend.open_chat, chat_id, then=screen.opened)
            await until(pilot, lambda: backend.current() is not None and screen.job is None)
        for text in texts:
            before = len(backend.current().messages) if backend.current() else 0
            await pilot.click(ChatInput)
            screen.query_one(ChatInput).text = text
            await pilot.press("enter")
            await until(pilot, lambda: not screen.generating and backend.current() is not None
                        and len(backend.current().messages) == before + 2)
            lines.append(str(screen.query_one(StatusBar).render()))
        chat_id = backend.current().id
        await pilot.press("ctrl+q")
    return lines, chat_id


def ask(home, url: str, text: str, chat_id: str | None = None, args: tuple[str, ...] = ()) -> dict:
    argv = ["ask", "--server", url, "--api-key-env", "SERVE_KEY", "--json", "--max-tokens", str(MAX_TOKENS), text]
    proc = run_kvchat(home, *argv, *args, *(["--chat", chat_id] if chat_id else []))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return json.loads(proc.stdout)


@pytest.mark.asyncio
async def test_tui_and_ask_resume_from_the_servers_disk_after_it_restarts(smol_info, tmp_path, kvchat_home,
                                                                          monkeypatch):
    monkeypatch.setenv("SERVE_KEY", API_KEY)
    server = Server(tmp_path / "serve-home").start()
    try:
        lines, tui_chat = await tui_turns(server.url, TURNS)
        assert all(MODEL in line and "KV fp8" in line and "TTFT" in line for line in lines)
        assert all(re.search(r"resumed [\d,]+ tokens (from the server's memory|on the server \([\d,]+ from memory)",
                             line) for line in lines[1:]), lines

        outs = [ask(kvchat_home, server.url, ASKED[0])]
        for text in ASKED[1:]:
            outs.append(ask(kvchat_home, server.url, text, outs[0]["chat_id"]))
        assert len({o["chat_id"] for o in outs}) == 1 and outs[-1]["model"] == MODEL
        assert outs[2]["reused_tokens"] >= outs[1]["context_tokens"] - 16 and outs[2]["from_memory"] > 0

        doc = tmp_path / "heron.txt"
        doc.write_text("The blue heron nests near the old mill. " * 20)
        with_doc = ask(kvchat_home, server.url, "Where does the heron nest?", args=("--doc", str(doc)))
        again = ask(kvchat_home, server.url, "And the mill?", with_doc["chat_id"])
        assert with_doc["prompt_tokens"] > 200, "the document went in the system message"
        assert again["reused_tokens"] >= with_doc["context_tokens"] - 16, "the server reused the document's prefix"

        server.stop()
        server.start()  # same port and data dir: its pool is empty, its snapshots are on disk

        after = ask(kvchat_home, server.url, "Name a fish.", outs[0]["chat_id"])
        assert after["from_disk"] >= outs[2]["context_tokens"] - 16 and after["from_memory"] == 0, after
        assert "bytes_read" not in after and "prefill_ms" not in after  # kvchat serve reports neither
        assert after["server_reuse"].startswith(f"resumed {after['reused_tokens']:,} tokens from the server's disk")

        [line], _ = await tui_turns(server.url, ["Name a bird."], tui_chat)
        assert "from the server's disk" in line, line
    finally:
        server.stop()

    chats = {c["id"]: c for c in _stored(kvchat_home)}
    assert set(chats) == {tui_chat, outs[0]["chat_id"], with_doc["chat_id"]}
    assert [chats[i]["messages"] for i in (tui_chat, outs[0]["chat_id"], with_doc["chat_id"])] == [8, 8, 4]
    assert all(c["model_name"] == MODEL and c["model_fingerprint"] == f"server:{server.url}" for c in chats.values())
    local = run_kvchat(kvchat_home, "ask", "--chat", tui_chat, "Name a bird.")  # the local model: one line
    assert local.returncode == 2 and local.stderr.strip() == (
        f"kvchat: error: chat {tui_chat} is held with the server {server.url}; open it with kvchat --server "
        f"{server.url}"), local.stderr


def _stored(home) -> list[dict]:
    import sqlite3

    with sqlite3.connect(home / "kvchat.db") as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute(
            "SELECT id, model_name, model_fingerprint, (SELECT count(*) FROM messages m WHERE m.conversation_id = c.id)"
            " AS messages FROM conversations c")]
