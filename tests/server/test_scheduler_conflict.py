"""A server turn on a chat that another kvchat process changes meanwhile is kept, in a new chat (docs/server.md:
a resent history branches), never a 500 that throws the finished answer away."""

from __future__ import annotations

import json
import queue
import sqlite3

import pytest
from process_helpers import run_kvchat

from kvchat.runtime import load_runtime
from kvchat.server.protocol import parse_chat_request
from kvchat.server.scheduler import Job, Scheduler


@pytest.fixture(scope="module")
def rt(smol_info):
    return load_runtime(None, "fp8")


def _request(messages: list[dict], on_text=None) -> tuple[Job, queue.Queue]:
    got: queue.Queue = queue.Queue()

    def push(item):
        if item[0] == "text" and on_text is not None:
            on_text()
        got.put(item)

    body = {"model": "m", "messages": messages, "max_tokens": 6, "temperature": 0}
    return Job(parse_chat_request(json.dumps(body).encode()), push), got


def _last(got: queue.Queue):
    item = got.get(timeout=300)
    while item[0] == "text":
        item = got.get(timeout=300)
    return item


def test_a_turn_on_a_chat_changed_by_another_process_is_stored_in_a_new_chat(rt, kvchat_home):
    sched = Scheduler(rt, store=True)
    try:
        first = [{"role": "user", "content": "Name a colour."}]
        job, got = _request(first)
        sched.submit(job)
        kind, done = _last(got)
        assert kind == "done", done
        chat_id, answer = done.chat_id, done.text
        other: list = []

        def another_process_writes_the_chat():  # runs on the scheduler thread: the turn waits for it
            if not other:
                other.append(run_kvchat(kvchat_home, "ask", "Name a fruit.", "--chat", chat_id, "--threads", "1",
                                        "--max-tokens", "3", timeout=300))

        follow = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Another one?"}]
        job, got = _request(follow, another_process_writes_the_chat)
        sched.submit(job)
        kind, done = _last(got)
    finally:
        sched.stop()
    assert other and other[0].returncode == 0, other[0].stderr if other else "no text was streamed"
    assert kind == "done", done.body()
    assert done.chat_id not in (None, chat_id) and done.text
    db = sqlite3.connect(kvchat_home / "kvchat.db")

    def rows(cid):
        return list(db.execute("SELECT role, text FROM messages WHERE conversation_id = ? ORDER BY idx", [cid]))

    assert [r[1] for r in rows(chat_id)][2] == "Name a fruit."  # the other process's turn, kept
    assert rows(done.chat_id) == [("user", "Name a colour."), ("assistant", answer), ("user", "Another one?"),
                                  ("assistant", done.text)]
