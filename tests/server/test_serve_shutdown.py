"""SIGTERM or Ctrl-C on ``kvchat serve`` (a real process) while a stream and a non-streaming request run: neither
client takes the cut answer for a complete one (the stream ends with an error event and no [DONE], the other
request gets a 5xx error object), both partial answers are stored as cut, the server exits without a traceback."""

from __future__ import annotations

import http.client
import json
import signal
import sqlite3
import threading

import pytest
from server_helpers import MODEL, Server

pytestmark = pytest.mark.model


def _body(content: str, stream: bool) -> str:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 400,
                       "temperature": 0, "stream": stream})


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_shutdown_mid_answer_is_an_error_to_both_clients_and_stored_as_cut(tmp_path, smol_info, sig):
    srv = Server(tmp_path / "home", "--verbose", api_key=None).start()
    whole: dict = {}
    waiting = threading.Thread(target=lambda: whole.update(
        reply=srv.request("POST", "/v1/chat/completions", _body("Write a long story about a knight.", False).encode())))
    try:
        waiting.start()
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
        conn.request("POST", "/v1/chat/completions", _body("Write a long story about a dragon.", True),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events, pieces, sent = [], 0, False
        for raw in resp:  # SSE lines
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            pieces += '"content": "' in line
            if pieces >= 4 and not sent and srv.health()["running"] == 2:  # both mid-answer
                srv.proc.send_signal(sig)
                sent = True
        assert sent, events[-3:]
        waiting.join(60)
        rc = srv.proc.wait(60)
    finally:
        srv.stop()
    assert "[DONE]" not in events, events[-3:]
    last = json.loads(events[-1])
    assert last["error"]["code"] == "answer_cut" and "shutting down" in last["error"]["message"], last
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-1])
    status, err, _ = whole["reply"]
    assert status == 503 and err["error"]["code"] == "answer_cut", err
    log = srv.read_log()
    assert rc in (0, 130, -sig), log  # uvicorn re-raises the signal once it has shut down (SIGINT: exit 130)
    assert "Traceback" not in log and "ERROR" not in log and "CancelledError" not in log, log
    db = sqlite3.connect(srv.home / "kvchat.db")
    answers = db.execute("SELECT text, finish_reason FROM messages WHERE role = 'assistant'").fetchall()
    assert len(answers) == 2 and all(text and finish == "cancelled" for text, finish in answers), answers
