"""``kvchat serve`` on loopback without an API key, a real process driven by the real ``openai`` client and raw
HTTP: odd but valid messages, limits on ``stop``, stop strings across turns, many chats sharing a prefix,
a non-streaming client that goes away, the content-type and host rules, malformed bodies, lone surrogates,
a history too long to tokenize, foreign Host headers."""

from __future__ import annotations

import http.client
import json
import socket
import sqlite3
import time

import pytest
from process_helpers import assert_one_error_line, run_kvchat
from server_helpers import MODEL, Server, ask_greedy
from transformers import AutoTokenizer

from kvchat.model.chat_format import ChatFormat

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def server(tmp_path_factory, smol_info):
    srv = Server(tmp_path_factory.mktemp("serve") / "home", api_key=None).start()
    yield srv
    srv.stop()


def test_a_blank_first_message_is_answered_and_titled_new_chat(server):
    c = server.client()
    r = ask_greedy(c, [{"role": "user", "content": "  \n"}, {"role": "assistant", "content": "Hello!"},
                 {"role": "user", "content": "Say yes."}], max_tokens=3)
    chat_id = r.model_extra["kvchat"]["chat_id"]
    db = sqlite3.connect(server.home / "kvchat.db")
    assert db.execute("SELECT title FROM conversations WHERE id = ?", [chat_id]).fetchone()[0] == "New chat"


def _body(**kw) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}).encode()


@pytest.mark.parametrize("stop", [["x"] * 5, "y" * 257, ["ok", "z" * 257], [""]], ids=["five", "long", "long-in-list",
                                                                                    "empty"])
def test_stop_strings_are_limited_in_number_and_length(server, stop):
    code, err, _ = server.request("POST", "/v1/chat/completions", _body(stop=stop))
    assert code == 400 and err["error"]["param"] == "stop", err


def test_stop_strings_at_the_limits_are_accepted(server):
    code, body, _ = server.request("POST", "/v1/chat/completions", _body(stop=["a" * 256, "b", "c", "d"]))
    assert code == 200, body


def test_an_answer_cut_at_a_stop_string_is_reused_when_resent(server, smol_dir):
    c = server.client()
    msgs = [{"role": "user", "content": "Describe the sea in three sentences."}]
    r1 = ask_greedy(c, msgs, max_tokens=60, stop=["."])
    cut = r1.choices[0].message.content
    assert cut and "." not in cut and r1.choices[0].finish_reason == "stop" and r1.usage.completion_tokens < 60
    db = sqlite3.connect(server.home / "kvchat.db")
    stored = db.execute("SELECT text FROM messages WHERE conversation_id = ? AND role = 'assistant'",
                        [r1.model_extra["kvchat"]["chat_id"]]).fetchall()
    assert stored == [(cut,)]  # what the client got, not the generated text past the stop string
    msgs += [{"role": "assistant", "content": cut}, {"role": "user", "content": "And the sky?"}]
    r2 = ask_greedy(c, msgs, max_tokens=4)
    fmt = ChatFormat(AutoTokenizer.from_pretrained(smol_dir))
    history = r2.usage.prompt_tokens - len(fmt.user_turn_ids(msgs[-1]["content"]))
    assert r2.usage.prompt_tokens_details.cached_tokens >= history - 32, r2.model_extra["kvchat"]
    assert r2.model_extra["kvchat"]["miss_reason"] is None


@pytest.mark.parametrize("n", [1, 2])
def test_a_non_streaming_client_that_disconnects_stops_its_generation(server, n):
    start = server.wait_idle()
    assert start["pool_blocks_used"] == 0
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "Count from 1 to 1000, separated by commas."}],
        "max_tokens": 1000, "temperature": 0, "n": n}), {"Content-Type": "application/json"})
    deadline = time.time() + 60
    while ((h := server.health())["running"] < n or h["decode_steps"] < start["decode_steps"] + 3) and \
            time.time() < deadline:
        time.sleep(0.05)
    assert h["running"] == n and h["pool_blocks_used"] > 0  # every choice decoding
    conn.close()
    idle = server.wait_idle(timeout=15)
    assert (idle["running"], idle["pool_blocks_used"]) == (0, 0)
    assert idle["decode_steps"] - h["decode_steps"] < 200  # it stopped soon after, far from its 1000 tokens


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_without_an_api_key_a_post_needs_json_content_type(server, content_type):
    code, err, _ = server.request("POST", "/v1/chat/completions", _body(), {"Content-Type": content_type})
    assert code == 415 and err["error"]["code"] == "unsupported_media_type", err
    code, _, _ = server.request("POST", "/v1/chat/completions", _body(), {"Content-Type": "application/json; charset=utf-8"})
    assert code == 200


def _status_with_host(server, host: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("GET", "/health", skip_host=True)
    conn.putheader("Host", host)
    conn.endheaders()
    status = conn.getresponse().status
    conn.close()
    return status


def test_without_an_api_key_only_loopback_host_names_are_served(server):
    for host in ("localhost", f"localhost:{server.port}", f"127.0.0.1:{server.port}", f"[::1]:{server.port}"):
        assert _status_with_host(server, host) == 200, host
    for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example"):  # DNS rebinding
        assert _status_with_host(server, host) == 400, host


def test_the_api_key_can_come_from_the_environment(tmp_path, smol_info):
    srv = Server(tmp_path / "home", api_key=None, env={"KVCHAT_API_KEY": "env-key"}).start()
    try:
        assert srv.request("GET", "/v1/models", headers={"Authorization": None})[0] == 401
        assert srv.request("GET", "/v1/models", headers={"Authorization": "Bearer env-key"})[0] == 200
        assert "env-key" not in " ".join(srv.proc.args)  # not in the process list
    finally:
        srv.stop()


@pytest.mark.parametrize("body", [b"[" * 200000, b'{"model": "m", "messages": ' + b"[" * 200000],
                         ids=["top", "in-messages"])
def test_deeply_nested_json_gets_400(server, body):
    code, err, _ = server.request("POST", "/v1/chat/completions", body)
    assert code == 400 and "nested too deeply" in err["error"]["message"], err


def test_a_port_in_use_is_one_error_line(tmp_path, smol_info):
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        proc = run_kvchat(tmp_path / "home", "serve", "--port", str(port), "--threads", "1")
    assert_one_error_line(proc, "kvchat: error: cannot listen on 127.0.0.1 port", str(port))


def test_a_port_in_use_is_found_before_the_model_loads(tmp_path):
    """The port is bound before the load: with a model that does not exist, the error is still the port's."""
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        proc = run_kvchat(tmp_path / "home", "serve", "--port", str(port), "--model", str(tmp_path / "no-model"))
    assert_one_error_line(proc, "kvchat: error: cannot listen on 127.0.0.1 port", str(port))


# bad input found in a fresh-user trial: a 400 error object, never a 500
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


def test_a_port_in_use_leaves_no_data_dir_behind(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        proc = run_kvchat(tmp_path / "new-home", "serve", "--port", str(port))
    assert_one_error_line(proc, "cannot listen on 127.0.0.1 port", str(port))
    assert not (tmp_path / "new-home").exists()
