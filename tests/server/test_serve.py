"""``kvchat serve`` as a real process on loopback, driven by the real ``openai`` client.

Resume after a restart and after ``kill -9`` (from disk), streaming equal to
non-streaming, 8 concurrent conversations equal to their single-client
answers, a disconnect that frees its blocks, bad requests and their codes, a
full pool answering 503 with Retry-After. Greedy, short answers (2 cores).
"""

from __future__ import annotations

import http.client
import json
import sqlite3
import threading
import time

import openai
import pytest
from process_helpers import run_kvchat
from server_helpers import API_KEY, MODEL, Server, ask_greedy
from transformers import AutoTokenizer

from kvchat.model.chat_format import ChatFormat

pytestmark = pytest.mark.model
SYSTEM = {"role": "system", "content": "You are a concise assistant."}
TOPICS = ["cats", "the moon", "bread", "rivers", "chess", "music", "trains", "winter"]


def _stream_text(client, messages, **kw) -> tuple[str, dict]:
    parts, extra = [], {}
    for chunk in ask_greedy(client, messages, stream=True, **kw):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        extra.update(chunk.model_extra or {})
    return "".join(parts), extra


def test_resume_after_restart_and_kill9(tmp_path, smol_info, smol_dir):
    home = tmp_path / "home"
    srv = Server(home).start()
    c = srv.client()
    msgs = [SYSTEM, {"role": "user", "content": "Name three colors of the rainbow."}]
    r1 = ask_greedy(c, msgs, max_tokens=24)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "Which one is your favourite, and why?"}]
    r2 = ask_greedy(c, msgs, max_tokens=24)
    text2 = r2.choices[0].message.content
    streamed, extra = _stream_text(c, msgs, max_tokens=24)
    assert text2 and streamed == text2
    assert extra["kvchat"]["chat_id"] and r2.model_extra["kvchat"]["chat_id"]
    assert r2.usage.prompt_tokens_details.cached_tokens > 0  # turn 1 was in memory
    msgs += [{"role": "assistant", "content": text2}, {"role": "user", "content": "Count from one to fifty in words."}]

    # kill -9 mid-generation of turn 3
    got = []
    stream = ask_greedy(c, msgs, max_tokens=300, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got.append(chunk.choices[0].delta.content)
        if len(got) >= 4:
            srv.proc.kill()
            break
    srv.proc.wait(30)
    srv.log.close()
    assert srv.proc.returncode == -9

    srv2 = Server(home).start()
    try:
        r3 = ask_greedy(srv2.client(), msgs, max_tokens=12)
    finally:
        srv2.stop()
    k = r3.model_extra["kvchat"]
    fmt = ChatFormat(AutoTokenizer.from_pretrained(smol_dir))
    history = r3.usage.prompt_tokens - len(fmt.user_turn_ids(msgs[-1]["content"]))
    assert r3.usage.prompt_tokens_details.cached_tokens >= history - 32, k
    assert k["from_disk"] > 0 and k["from_memory"] == 0, k
    killed = "".join(got)
    answer = r3.choices[0].message.content
    assert killed.startswith(answer) or answer.startswith(killed)  # greedy: the same answer resumed
    assert k["chat_id"] in (r2.model_extra["kvchat"]["chat_id"], extra["kvchat"]["chat_id"])
    db = sqlite3.connect(home / "kvchat.db")
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    roles = [r[0] for r in db.execute("SELECT role FROM messages WHERE conversation_id = ? ORDER BY idx",
                                      [k["chat_id"]])]
    assert roles == ["user", "assistant"] * 3  # the two turns stored before the kill, then this one
    ls = run_kvchat(home, "cache", "ls")
    assert ls.returncode == 0 and k["chat_id"] in ls.stdout


def _conversation(client, topic: str, turns: int = 5, counted: list | None = None) -> list[str]:
    msgs, out = [{"role": "user", "content": f"Tell me one fact about {topic}."}], []
    for k in range(turns):
        r = ask_greedy(client, msgs, max_tokens=6)
        text = r.choices[0].message.content
        out.append(text)
        if counted is not None:
            counted.append(r.usage.completion_tokens)
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Another one, number {k + 2}?"}]
    return out


def test_eight_concurrent_clients_get_their_single_client_answers(server):
    c = server.client()
    alone = {t: _conversation(c, t) for t in TOPICS}
    steps_before = server.health()["decode_steps"]
    together, errors, counted = {}, [], []

    def run(topic):
        try:
            together[topic] = _conversation(server.client(), topic, counted=counted)
        except Exception as exc:  # noqa: BLE001 - counted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in TOPICS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert together == alone
    # batched: the 40 answers' decode steps (all tokens but each answer's first) took far fewer forwards
    steps = server.health()["decode_steps"] - steps_before
    decoded = sum(n - 1 for n in counted)
    assert len(counted) == 40 and 0 < steps < decoded / 2, (steps, decoded)


def test_disconnect_mid_stream_frees_blocks(server):
    assert server.wait_idle()["pool_blocks_used"] == 0
    stream = ask_greedy(server.client(), [{"role": "user", "content": "Write a long story about a dragon."}],
                  max_tokens=400, stream=True)
    n = 0
    for chunk in stream:
        n += bool(chunk.choices and chunk.choices[0].delta.content)
        if n == 3:
            assert server.health()["pool_blocks_used"] > 0
            stream.close()
            break
    h = server.wait_idle()
    assert (h["running"], h["pool_blocks_used"]) == (0, 0)
    steps = h["decode_steps"]
    time.sleep(0.5)
    assert server.health()["decode_steps"] == steps  # nothing is generating any more


def _chat_body(**kw) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}).encode()


@pytest.mark.parametrize("body,headers,status,param", [
    (b"{not json", {}, 400, None),
    (_chat_body(messages="hi"), {}, 400, "messages"),
    (_chat_body(temperature="hot"), {}, 400, "temperature"),
    (_chat_body(max_tokens=0), {}, 400, "max_tokens"),
    (_chat_body(n=9), {}, 400, "n"),
    (_chat_body(messages=[{"role": "tool", "content": "x"}]), {}, 400, "messages[0]"),
    (_chat_body(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]), {}, 400, "messages"),
    (_chat_body(model="gpt-4"), {}, 404, "model"),
    (_chat_body(), {"Authorization": None}, 401, None),
    (_chat_body(), {"Authorization": "Bearer wrong"}, 401, None),
    (_chat_body(messages=[{"role": "user", "content": "word " * 9000}]), {}, 400, "messages"),
], ids=["json", "messages-type", "temperature", "max-tokens", "n", "role", "ends-with-assistant", "model",
        "no-key", "wrong-key", "context"])
def test_bad_requests_get_their_status(server, body, headers, status, param):
    code, err, _ = server.request("POST", "/v1/chat/completions", body, headers)
    assert code == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert err["error"]["param"] == param


def test_oversized_body_gets_413_before_it_is_read(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    for k, v in (("Authorization", f"Bearer {API_KEY}"), ("Content-Type", "application/json"),
                 ("Content-Length", str(9 * 2**20))):
        conn.putheader(k, v)
    conn.endheaders(b"{")
    resp = conn.getresponse()
    err = json.loads(resp.read())
    conn.close()
    assert resp.status == 413 and err["error"]["code"] == "request_too_large"


def test_routes_models_and_client_errors(server):
    code, err, _ = server.request("GET", "/v1/nothing")
    assert code == 404 and "does not exist" in err["error"]["message"]
    c = server.client()
    assert [m.id for m in c.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    r = ask_greedy(c, [{"role": "user", "content": "Say the word yes."}], max_tokens=20, stop=["e"])
    assert "e" not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    assert API_KEY not in server.read_log() and "Say the word" not in server.read_log()  # prompts are not logged


def test_full_pool_queues_then_503(tmp_path, smol_info):
    srv = Server(tmp_path / "home", "--queue-timeout", "1", env={"KVCHAT_KV_BUDGET_MB": "2"}).start()
    try:
        limit = srv.health()["context_limit"]
        c = srv.client()
        first = ask_greedy(c, [{"role": "user", "content": "Count from 1 to 500, separated by commas."}],
                     max_tokens=limit - 40, stream=True)
        next(iter(first))
        code, err, headers = srv.request("POST", "/v1/chat/completions", _chat_body())
        assert code == 503 and err["error"]["code"] == "pool_full" and int(headers["Retry-After"]) >= 1
        first.close()
        srv.wait_idle()
        assert srv.request("POST", "/v1/chat/completions", _chat_body())[0] == 200  # served once there is room
    finally:
        srv.stop()


def test_non_loopback_host_needs_an_api_key(tmp_path):
    proc = run_kvchat(tmp_path / "home", "serve", "--host", "0.0.0.0")
    assert proc.returncode == 2 and proc.stderr.startswith("kvchat: error: --host 0.0.0.0") and "--api-key" in proc.stderr
    assert not (tmp_path / "home").exists()
