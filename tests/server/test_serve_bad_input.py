"""``kvchat serve`` as a real process on loopback: bad input found in a fresh-user trial gets a 400 error
object (never a 500), and a huge history is refused before it is tokenized."""

from __future__ import annotations

import http.client
import json

import pytest

from server_helpers import MODEL, Server

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def server(tmp_path_factory, smol_info):
    srv = Server(tmp_path_factory.mktemp("serve") / "home", api_key=None).start()
    yield srv
    srv.stop()


def test_a_lone_surrogate_in_a_message_is_a_400(server):
    raw = ('{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}' % MODEL).encode()
    status, body, _ = server.request("POST", "/v1/chat/completions", raw)
    assert status == 400, body
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "messages[0]" and "not UTF-8" in err["message"]
    assert "Traceback" not in server.read_log()


def test_a_history_that_cannot_fit_is_refused_by_its_message_count(server):
    # 20,001 one-word messages: 10,000 earlier turns of at least 10 tokens each cannot fit 8,192 tokens
    turns = [m for _ in range(10_000) for m in ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"})]
    raw = json.dumps({"model": MODEL, "messages": [*turns, {"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    status, body, _ = server.request("POST", "/v1/chat/completions", raw)
    assert status == 400, body
    err = body["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert "20,001 user and assistant messages" in err["message"]
    r = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize("host", ["evil.example", "127.0.0.1.evil.example:80", "[::2]:80"])
def test_a_foreign_host_header_gets_an_openai_error_object(server, host):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("GET", "/v1/models", skip_host=True)
    conn.putheader("Host", host)
    conn.endheaders()
    resp = conn.getresponse()
    status, body = resp.status, json.loads(resp.read())
    conn.close()
    assert status == 400 and body["error"]["code"] == "invalid_host" and body["error"]["type"] == "invalid_request_error"
