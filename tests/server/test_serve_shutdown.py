"""Ctrl-C on ``kvchat serve`` (a real process) during a stream: the stream ends with its finish chunk and
[DONE], the partial answer is stored, the server exits without a traceback."""

from __future__ import annotations

import http.client
import json
import signal
import sqlite3

import pytest

from server_helpers import MODEL, Server

pytestmark = pytest.mark.model


def test_sigint_during_a_stream_ends_it_cleanly(tmp_path, smol_info):
    srv = Server(tmp_path / "home", "--verbose", api_key=None).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
                "max_tokens": 300, "temperature": 0, "stream": True}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events, pieces = [], 0
        for raw in resp:  # SSE lines
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            pieces += '"content": "' in line
            if pieces == 4:  # mid-answer
                srv.proc.send_signal(signal.SIGINT)
        assert events[-1] == "[DONE]", events[-3:]
        finish = json.loads(events[-2])
        assert finish["choices"][0]["finish_reason"] is not None and finish["kvchat"]["chat_id"]
        rc = srv.proc.wait(60)
    finally:
        srv.stop()
    log = srv.read_log()
    assert rc in (0, 130), log  # 130: the interrupt uvicorn re-raises once it has shut down
    assert "Traceback" not in log and "ERROR" not in log and "CancelledError" not in log, log
    db = sqlite3.connect(srv.home / "kvchat.db")
    answers = db.execute("SELECT text FROM messages WHERE role = 'assistant'").fetchall()
    assert len(answers) == 1 and answers[0][0]  # the partial answer, stored
