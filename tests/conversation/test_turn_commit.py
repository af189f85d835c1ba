"""A turn commits only onto the stored history it was computed on, and a turn that is not stored
leaves nothing behind in the session. Real SmolLM2, real SQLite, real processes."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from kvchat.engine.turn import SamplingParams
from kvchat.index import get_db
from kvchat.phase_trace import read_trace
from kvchat.store.conversations import get_conversation
from kvchat.store.db import close_thread_dbs
from kvchat.store.errors import ConversationConflictError

POOL_BYTES = 12 * 2**20  # 1,024 tokens of SmolLM2 fp8 KV
GS = SamplingParams(max_tokens=4)


def kvchat(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """The CLI in a fresh process on the test's data dir."""
    return subprocess.run([sys.executable, "-m", "kvchat.cli", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})}, **kw)


@pytest.fixture()
def backend(smol_info):
    """The real backend on SmolLM2 with a 4,096-token pool and a new chat open."""
    import torch

    from kvchat.tui.real_backend import RealBackend

    torch.set_num_threads(1)
    b = RealBackend(str(smol_info.path), "fp8", pool_bytes=4 * POOL_BYTES, threads=1)
    b.load(lambda event: None)
    b.new_chat(None, [], lambda event: None)
    yield b
    b.shutdown()


def _engine_db(backend, sql: str):
    """Run ``sql`` on the engine loop thread's own connection (the one that stores turns); its first row."""
    return backend._chats.loop.call(lambda: get_db().execute(sql).fetchone())


def _fill_the_database(backend) -> None:
    """Make the database unable to grow, as on a full disk (SQLITE_FULL): compact it, then cap its size
    at its current pages on the connection that stores turns. A row bigger than a page still needs a new one."""
    def fill():
        db = get_db()
        db.execute("VACUUM")
        db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")

    backend._chats.loop.call(fill)


def test_a_failed_save_rolls_the_turn_back(backend):
    backend.send("Name a fruit.", GS, threading.Event(), lambda e: None)
    before = backend.status().context_used
    _fill_the_database(backend)
    long_text = "Name a vegetable. " + "The quick brown fox jumps over the lazy dog. " * 120  # 5.4 KB > a page
    for _ in range(2):
        with pytest.raises(sqlite3.OperationalError, match="full"):
            backend.send(long_text, GS, threading.Event(), lambda e: None)
        assert backend.status().context_used == before  # the meter did not grow
        assert len(backend.current().messages) == 2
    _engine_db(backend, "PRAGMA max_page_count = 1073741823")
    done = backend.send("And a colour?", GS, threading.Event(), lambda e: None)
    conv = get_conversation(get_db(), done.chat_id)
    assert [m.text for m in conv.messages[::2]] == ["Name a fruit.", "And a colour?"]
    assert done.context_used == len(conv.token_ids)  # session and store agree
    assert "vegetable" not in backend._chats.chat.session.fmt.decode(conv.token_ids)
    assert backend._chats.last.reused_tokens >= before - 16  # the history stayed cached through the failures


def test_a_tui_turn_on_a_chat_changed_by_another_process_is_refused(backend):
    done = backend.send("Name a fruit.", GS, threading.Event(), lambda e: None)
    chat_id, before = done.chat_id, done.context_used
    other = kvchat("ask", "Name a colour.", "--chat", chat_id, "--max-tokens", "3", "--threads", "1")
    assert other.returncode == 0, other.stderr
    with pytest.raises(ConversationConflictError, match="changed by another kvchat"):
        backend.send("Name a number.", GS, threading.Event(), lambda e: None)
    stored = get_conversation(get_db(), chat_id)
    assert [m.text for m in stored.messages[::2]] == ["Name a fruit.", "Name a colour."]
    # the TUI reloaded the chat as stored, so the user's next send continues on the new history
    assert [m.text for m in backend.current().messages[::2]] == ["Name a fruit.", "Name a colour."]
    assert backend.status().context_used == len(stored.token_ids) > before
    done = backend.send("Name a number.", GS, threading.Event(), lambda e: None)
    stored = get_conversation(get_db(), chat_id)
    assert [m.text for m in stored.messages[::2]] == ["Name a fruit.", "Name a colour.", "Name a number."]
    assert done.context_used == len(stored.token_ids)


def test_two_cli_turns_on_one_chat_at_once_are_never_merged(smol_info, tmp_path):
    first = kvchat("ask", "Hi.", "--max-tokens", "3", "--threads", "1", "--json")
    assert first.returncode == 0, first.stderr
    chat_id = json.loads(first.stdout)["chat_id"]
    trace = tmp_path / "trace"
    slow = subprocess.Popen(
        [sys.executable, "-m", "kvchat.cli", "ask", "Write the numbers from 1 to 500, separated by commas.",
         "--chat", chat_id, "--max-tokens", "4000", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "KVCHAT_PHASE_TRACE": str(trace)})
    try:
        deadline = time.monotonic() + 300
        while "decoding" not in [p for _, p in read_trace(trace)]:
            assert slow.poll() is None and time.monotonic() < deadline, "the first turn never started decoding"
            time.sleep(0.1)
        fast = kvchat("ask", "Name a colour.", "--chat", chat_id, "--max-tokens", "3", "--threads", "1")
        assert fast.returncode == 0, fast.stderr
        assert slow.poll() is None, "the first turn ended before the second committed: no race was made"
        slow.send_signal(signal.SIGINT)  # stop it: it keeps its partial answer and tries to store it
        _, err = slow.communicate(timeout=120)
    finally:
        slow.kill()
    assert slow.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvchat: error: chat ") and "nothing was stored" in lines[0]
    close_thread_dbs()
    stored = get_conversation(get_db(), chat_id)
    assert [m.text for m in stored.messages[::2]] == ["Hi.", "Name a colour."]
    assert stored.segments[-1][1] == len(stored.token_ids)
    explain = kvchat("cache", "explain", chat_id)
    assert explain.returncode == 0 and "corrupt" not in explain.stdout
