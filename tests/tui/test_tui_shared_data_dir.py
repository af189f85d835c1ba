"""The TUI and CLI processes on one data dir: a chat must never be lost to another process's writes.

TUI sends → ``kvchat cache stats`` → TUI sends → ``kvchat ask`` → quit: the
database passes ``integrity_check`` and holds both chats, every message.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from test_tui_app import SIZE, real_app, until

from kvchat.engine.turn import SamplingParams
from kvchat.index import get_db
from kvchat.store.conversations import get_conversation, list_conversations
from kvchat.store.db import close_thread_dbs
from kvchat.tui.widgets.chat_input import ChatInput
from kvchat.tui.widgets.message_view import MessageView

pytestmark = [pytest.mark.asyncio, pytest.mark.tui]


def _kvchat(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh process on the test's data dir and models dir."""
    return subprocess.run([sys.executable, "-m", "kvchat.cli", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


async def _send(pilot, screen, text: str, n_blocks: int) -> None:
    view = screen.query_one(MessageView)
    await pilot.click(ChatInput)
    screen.query_one(ChatInput).text = text
    await pilot.press("enter")
    await until(pilot, lambda: not screen.generating and len(view.blocks()) == n_blocks, timeout=180)


async def test_tui_and_cli_processes_share_a_data_dir_without_loss(smol_info):
    backend, app = real_app(smol_info)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen_stack[0]
        await until(pilot, lambda: screen.ready, timeout=120)
        screen.settings = SamplingParams(max_tokens=5)
        await _send(pilot, screen, "Name a fruit.", 2)
        stats = await asyncio.to_thread(_kvchat, "cache", "stats")
        assert stats.returncode == 0, stats.stderr
        await _send(pilot, screen, "And a colour?", 4)
        tui_chat = backend.current().id
        ask = await asyncio.to_thread(_kvchat, "ask", "CLI chat", "--max-tokens", "5", "--threads", "1", "--json")
        assert ask.returncode == 0, ask.stderr
        await _send(pilot, screen, "And a number?", 6)  # the TUI still writes after the CLI closed
        await pilot.press("ctrl+q")
        await until(pilot, lambda: app._shut_down, timeout=60)
    close_thread_dbs()
    db = get_db()
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    cli_chat = json.loads(ask.stdout)["chat_id"]
    assert {c.id for c in list_conversations(db)} == {tui_chat, cli_chat}
    assert [m.role for m in get_conversation(db, tui_chat).messages] == ["user", "assistant"] * 3
    assert [m.text for m in get_conversation(db, cli_chat).messages][0] == "CLI chat"
