"""A server that fails (refused connection, wrong key, 503 with Retry-After, an error or a cut connection
mid-answer, a stream that never ends): one line each from ``kvchat ask --server`` and the TUI, and the TUI goes
on (the next question answered). A failure before the answer began stores nothing and gives the typed text
back in the box; one after part of it came keeps the question and that part, marked ``interrupted``, as a
stopped answer is kept (the box stays empty: the question is in the chat). A cut during Regenerate or Edit
stores nothing: the chat keeps the answer it had. A complete answer closed without ``[DONE]`` is an answer.

The failing servers are a stub (:mod:`remote_stub`); the working conversation runs on a real kvchat serve
in ``test_remote_serve.py``.
"""

from __future__ import annotations

import json
import sqlite3

import pytest
from process_helpers import run_kvchat
from remote_stub import KEY, MODEL, StubServer
from server_helpers import free_port

from kvchat.remote.chats import NOT_HERE
from kvchat.tui.app import KvchatApp
from kvchat.tui.remote_backend import RemoteBackend
from kvchat.tui.screens.cache import CacheScreen
from kvchat.tui.widgets.chat_input import ChatInput
from kvchat.tui.widgets.message_view import MessageView
from kvchat.tui.widgets.status_bar import StatusBar

SIZE = (120, 40)
FAILURES = {  # behaviour: (words of the error line, ask --json's error type)
    "busy": ("is busy (503: the pool is full); retry after 7 s", "rate_limited"),
    "error_event": ("stopped mid-answer (it sent an error)", "server_error"),
    "cut": ("stopped mid-answer (the connection", "server_error"),
    "silent": ("stopped mid-answer (it sent nothing for 1 s)", "server_error"),
}
MID_ANSWER = ("error_event", "cut", "silent")  # the stub sent "Half an " first
KEPT = "the question and the part of the answer that came are kept in the chat, marked interrupted"


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    """A silent stream is given up after 1 s (the default waits minutes), the right key in STUB_KEY."""
    monkeypatch.setenv("KVCHAT_SERVER_TIMEOUT_S", "1")
    monkeypatch.setenv("STUB_KEY", KEY)
    monkeypatch.setenv("WRONG_KEY", "not-the-key")


def stored_chats(home) -> int:
    db = home / "kvchat.db"
    if not db.exists():
        return 0
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM conversations").fetchone()[0] + \
            conn.execute("SELECT count(*) FROM messages").fetchone()[0]


def ask(home, url: str, *args: str, key_env: str = "STUB_KEY"):
    return run_kvchat(home, "ask", "--server", url, "--api-key-env", key_env, "Tell me something.", *args)


def assert_error(proc, words: str, kind: str, json_out: bool) -> None:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    if json_out:
        err = json.loads(proc.stdout)["error"]
        assert err["type"] == kind and words in err["message"] and "\n" not in err["message"], err
        return
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("kvchat: error: ") and words in line, line


@pytest.mark.parametrize("json_out", [False, True], ids=["text", "json"])
def test_ask_refused_connection_and_wrong_key(kvchat_home, json_out):
    extra = ("--json",) if json_out else ()
    port = free_port()  # nothing listens there
    assert_error(ask(kvchat_home, f"http://127.0.0.1:{port}", *extra), f"cannot reach the server at "
                 f"http://127.0.0.1:{port} (Connection refused)", "connection_error", json_out)
    with StubServer() as stub:
        assert_error(ask(kvchat_home, stub.url, *extra, key_env="WRONG_KEY"), "refused the API key (401: Incorrect "
                     "API key provided)", "authentication_error", json_out)
        assert_error(ask(kvchat_home, stub.url + "/wrong/path", *extra), f"not found on the server at {stub.url}"
                     "/wrong/path (404: Not Found)", "not_found", json_out)
        assert stub.requests == []
    assert stored_chats(kvchat_home) == 0


@pytest.mark.parametrize("json_out", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("behaviour", FAILURES)
def test_ask_on_a_failing_answer_says_one_line_and_keeps_only_what_came(kvchat_home, behaviour, json_out):
    words, kind = FAILURES[behaviour]
    with StubServer([behaviour]) as stub:
        proc = ask(kvchat_home, stub.url, *(["--json"] if json_out else []))
        assert_error(proc, words, kind, json_out)
    err = json.loads(proc.stdout)["error"] if json_out else {}
    if behaviour == "busy":
        assert stored_chats(kvchat_home) == 0
        assert not json_out or err["retry_after_s"] == 7
        return
    [(chat_id, finish, text)] = stored_answers(kvchat_home)
    assert (finish, text) == ("interrupted", "Half an ")
    assert KEPT in (err["message"] if json_out else proc.stderr) and f"(chat {chat_id})" in (err.get("message")
                                                                                           or proc.stderr)
    assert not json_out or err["chat_id"] == chat_id
    assert stored_chats(kvchat_home) == 3  # the chat, its question, the part of the answer


def test_ask_on_a_complete_answer_closed_without_done_is_an_answer(kvchat_home):
    with StubServer(["no_done"]) as stub:
        proc = ask(kvchat_home, stub.url, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["text"] == "Half an answer"
    [(_, finish, text)] = stored_answers(kvchat_home)
    assert (finish, text) == ("stop", "Half an answer"), "the finish reason came: not a cut answer"


def stored_answers(home) -> list[tuple[str, str, str]]:
    """(chat id, finish reason, text) of each stored answer."""
    with sqlite3.connect(home / "kvchat.db") as conn:
        return conn.execute("SELECT conversation_id, finish_reason, text FROM messages WHERE role = 'assistant' "
                            "ORDER BY rowid").fetchall()


def test_ask_on_a_server_that_is_not_kvchat_shows_its_cached_tokens(kvchat_home):
    with StubServer() as stub:
        proc = ask(kvchat_home, stub.url, "--json", "--max-tokens", "5")
        assert proc.returncode == 0, proc.stderr
        [body] = stub.requests
    out = json.loads(proc.stdout)
    assert out["text"] == "Half an answer" and out["model"] == MODEL and out["server"] == stub.url
    assert out["server_reuse"] == "the server reused 8 cached tokens of 11" and out["reused_tokens"] == 8
    assert (out["new_tokens"], out["context_tokens"], out["context_limit"]) == (3, 14, 4096)
    # no zeros that look measured: a server reports no bytes read or prefill time, and this one not where the
    # reused tokens came from
    assert not {"bytes_read", "prefill_ms", "from_memory", "from_disk", "restore_ms", "miss_reason"} & set(out)
    assert body["max_tokens"] == 5 and body["stream"] and "top_k" not in body, "OpenAI's own API refuses top_k"
    assert stored_chats(kvchat_home) == 3  # the chat, its question and its answer


def harness(url: str, key: str | None = KEY):
    backend = RemoteBackend(url, key)
    app = KvchatApp(backend)
    notes: list[str] = []
    notify = app.notify

    def record(message, **kwargs):
        notes.append(message)
        notify(message, **kwargs)

    app.notify = record
    return app, backend, notes


async def until(pilot, condition, timeout=15.0):
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await pilot.pause(0.02)


def status(app) -> str:
    return str(app.screen_stack[0].query_one(StatusBar).render())


async def type_and_send(pilot, app, text: str) -> None:
    box = app.screen_stack[0].query_one(ChatInput)
    await pilot.click(ChatInput)
    box.text = text
    await pilot.press("enter")


@pytest.mark.asyncio
@pytest.mark.tui
async def test_tui_goes_on_after_each_failed_answer(kvchat_home):
    with StubServer(list(FAILURES)) as stub:
        app, backend, notes = harness(stub.url)
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen_stack[0]
            await until(pilot, lambda: screen.ready)
            kept: list[tuple[str, str, str]] = []  # (question, answer, finish reason) of the chat so far
            for i, (behaviour, (words, _)) in enumerate(FAILURES.items()):
                text = f"Question {i}?"
                await type_and_send(pilot, app, text)
                await until(pilot, lambda: len(notes) > i and not screen.generating)
                assert words in notes[i] and "\n" not in notes[i], notes
                assert screen.query_one(ChatInput).text == ("" if behaviour in MID_ANSWER else text), \
                    "the typed text is back in the box unless the chat holds it"
                if behaviour in MID_ANSWER:
                    kept.append((text, "Half an ", "interrupted"))
                    assert KEPT in notes[i] and "chat c_" not in notes[i], notes[i]
                    assert words in status(app), "the status line says it until the next answer"
                    await until(pilot, lambda: "interrupted: the server stopped sending" in str(
                        screen.query(".assistant").last().query_one(".stats").render()))
                got = backend.current().messages
                assert [(q.text, a.text, a.finish_reason) for q, a in zip(got[::2], got[1::2])] == kept
                assert len(backend.list_chats()) == (1 if kept else 0)
                screen.query_one(ChatInput).text = ""
            await type_and_send(pilot, app, "Last question?")
            await until(pilot, lambda: len(backend.current().messages) == 2 * len(kept) + 2 and not screen.generating)
            assert [m.text for m in backend.current().messages[-2:]] == ["Last question?", "Half an answer"]
            assert [c.title for c in backend.list_chats()] == ["Question 1?"]
            assert f"the server reused 8 cached tokens of {11 * (2 * len(kept) + 1)}" in status(app)  # stub's usage
            await pilot.press("f5")  # the cache screen: the chat is listed, its KV said to be the server's
            await until(pilot, lambda: isinstance(app.screen, CacheScreen) and app.screen.report.rows)
            [row] = app.screen.report.rows
            assert (row.title, row.disk_bytes, row.miss_reason) == ("Question 1?", 0, NOT_HERE)
            await pilot.press("escape")
            await pilot.press("ctrl+q")
        assert len(stub.requests) == len(FAILURES) + 1
        sent = [m["content"] for m in stub.requests[-1]["messages"]]
        assert sent == [x for q, a, _ in kept for x in (q, a)] + ["Last question?"], "the kept turns are history"
    assert stored_chats(kvchat_home) == 1 + 2 * len(kept) + 2


@pytest.mark.asyncio
@pytest.mark.tui
@pytest.mark.parametrize("case", ["refused", "wrong key"])
async def test_tui_on_a_server_it_cannot_use_says_why_and_keeps_the_text(kvchat_home, case):
    with StubServer() as stub:
        url, key = (f"http://127.0.0.1:{free_port()}", KEY) if case == "refused" else (stub.url, "not-the-key")
        app, backend, notes = harness(url, key)
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen_stack[0]
            words = "cannot reach the server" if case == "refused" else "refused the API key (401"
            # the app is usable (its chats listed from the store); the status line says why the server is not
            await until(pilot, lambda: screen.ready and words in status(app))
            assert "asks it again at the next message" in status(app) and notes == []
            await type_and_send(pilot, app, "Anyone there?")
            await until(pilot, lambda: notes and not screen.generating)
            assert words in notes[0] and "\n" not in notes[0], notes
            assert screen.query_one(ChatInput).text == "Anyone there?" and app.is_running
            await pilot.press("ctrl+q")
    assert stored_chats(kvchat_home) == 0


def test_a_chat_goes_on_with_another_server_and_a_local_chat_is_refused(kvchat_home):
    with StubServer() as first, StubServer() as second:
        out = json.loads(ask(kvchat_home, first.url, "--json").stdout)
        proc = ask(kvchat_home, second.url, "--json", "--chat", out["chat_id"])
        assert proc.returncode == 0, proc.stderr
        assert [m["content"] for m in second.requests[0]["messages"]] == ["Tell me something.", "Half an answer",
                                                                          "Tell me something."]
    with sqlite3.connect(kvchat_home / "kvchat.db") as conn:
        assert conn.execute("SELECT model_fingerprint FROM conversations").fetchall() == [(f"server:{second.url}",)]
        conn.execute("INSERT INTO conversations (id, title, model_fingerprint, model_name, created, updated) "
                     "VALUES ('c_local1', 'local', '8c1f6d79', 'SmolLM2-135M-Instruct', 0, 0)")
    proc = ask(kvchat_home, "http://127.0.0.1:9", "--chat", "c_local1")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "kvchat: error: chat c_local1 belongs to the local model 'SmolLM2-135M-Instruct' (its history is that "
        "model's tokens); open it without --server"), proc.stderr


@pytest.mark.asyncio
@pytest.mark.tui
async def test_esc_on_a_silent_server_keeps_the_partial_answer_at_once(kvchat_home, monkeypatch):
    import time

    monkeypatch.setenv("KVCHAT_SERVER_TIMEOUT_S", "60")  # the answer ends by Esc, not by the timeout
    with StubServer(["silent"]) as stub:
        app, backend, notes = harness(stub.url)
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen_stack[0]
            await until(pilot, lambda: screen.ready)
            await type_and_send(pilot, app, "Go on and on?")
            # a stalled stream shows the pieces the batcher held back
            await until(pilot, lambda: screen._answer is not None and screen._answer.text == "Half an ")
            t0 = time.monotonic()
            await pilot.press("escape")
            await until(pilot, lambda: not screen.generating, timeout=5)
            assert time.monotonic() - t0 < 2, "Esc does not wait for the silent server's timeout"
            [msg] = backend.current().messages[1:]
            assert (msg.text, msg.finish_reason) == ("Half an ", "cancelled") and notes == []
            await pilot.press("ctrl+q")
    assert stored_chats(kvchat_home) == 3, "a stopped answer is kept, as a local one is"


def stored_messages(home) -> list[tuple]:
    with sqlite3.connect(home / "kvchat.db") as conn:
        return conn.execute("SELECT * FROM messages ORDER BY rowid").fetchall()


@pytest.mark.asyncio
@pytest.mark.tui
async def test_a_cut_during_regenerate_or_edit_leaves_the_chat_as_it_was(kvchat_home):
    with StubServer(["ok", "cut", "cut"]) as stub:
        app, backend, notes = harness(stub.url)
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen_stack[0]
            box = screen.query_one(ChatInput)
            await until(pilot, lambda: screen.ready)
            await type_and_send(pilot, app, "Question?")
            await until(pilot, lambda: len(backend.current().messages) == 2 and not screen.generating)
            before = stored_messages(kvchat_home)
            chat = [(m.text, m.finish_reason) for m in backend.current().messages]
            assert chat[1] == ("Half an answer", "stop")

            await pilot.press("ctrl+r")
            await until(pilot, lambda: notes and not screen.generating)
            await pilot.press("f4")
            assert box.text == "Question?"
            await type_and_send(pilot, app, "Better question?")
            await until(pilot, lambda: len(notes) == 3 and not screen.generating)
            assert "editing the last message" in notes.pop(1)
            for note in notes:
                assert "stopped mid-answer (the connection" in note and "the chat is unchanged" in note, note
                assert KEPT not in note and "\n" not in note, note
            assert box.text == "Better question?", "nothing was stored: the typed text is back in the box"
            assert [(m.text, m.finish_reason) for m in backend.current().messages] == chat
            assert [b.text for b in screen.query_one(MessageView).blocks()] == ["Question?", "Half an answer"]
            await pilot.press("ctrl+q")
        assert len(stub.requests) == 3
    assert stored_messages(kvchat_home) == before, "the complete answer is kept, nothing was rewound or added"
