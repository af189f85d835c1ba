"""The scheduler thread in-process with the real SmolLM2 runtime: a failing step answers 500 and serving goes on;
requests that arrive together decode together; a follow-up sent at "done" continues its chat; the grammar
tokenizer is built off the engine loop's thread."""

from __future__ import annotations

import json
import queue
import threading

import llguidance.hf
import pytest

from kvchat.runtime import load_runtime
from kvchat.server.protocol import parse_chat_request
from kvchat.server.scheduler import Job, Scheduler


@pytest.fixture(scope="module")
def rt(smol_info):
    return load_runtime(None, "fp8")


def _run(sched: Scheduler, content: str) -> list[tuple[str, object]]:
    """Submit one greedy request and collect its pushes up to the last ("done" or "error")."""
    got: queue.Queue = queue.Queue()
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    sched.submit(Job(parse_chat_request(json.dumps(body).encode()), got.put))
    items = [got.get(timeout=120)]
    while items[-1][0] == "text":
        items.append(got.get(timeout=120))
    return items


def test_an_unexpected_decode_error_fails_the_request_and_the_loop_goes_on(rt, monkeypatch):
    sched = Scheduler(rt, store=False)
    try:
        real = rt.engine.decode_batch
        calls = []

        def broken(steps):
            calls.append(len(steps))
            if len(calls) == 1:
                raise RuntimeError("injected decode failure")
            return real(steps)

        monkeypatch.setattr(rt.engine, "decode_batch", broken)
        kind, err = _run(sched, "Say hello.")[-1]
        assert kind == "error" and err.status == 500 and err.body()["error"]["type"] == "server_error"
        assert sched.alive and sched.health()["status"] == "ok"
        assert sched.health()["pool_blocks_used"] == 0  # the failed turn's blocks went back
        kind, done = _run(sched, "Say hello.")[-1]  # the next request is served
        assert kind == "done" and done.stats.new_tokens > 0
    finally:
        sched.stop()
    assert not sched.alive and sched.health()["status"] != "ok"


def test_requests_that_arrive_together_start_decoding_together(rt, monkeypatch):
    """Prompts queued at once, one of them a resent history of several turns (one prefill chunk per turn),
    are all prefilled in one loop iteration (the prefill token budget), so the first batched decode step
    already holds every one of them."""
    sched = Scheduler(rt, store=False)
    try:
        real, sizes = rt.engine.decode_batch, []
        monkeypatch.setattr(rt.engine, "decode_batch", lambda steps: sizes.append(len(steps)) or real(steps))
        history = [m for k in range(4) for m in ({"role": "user", "content": f"Number {k}?"},
                                                 {"role": "assistant", "content": f"It is {k}."})]
        boxes = [queue.Queue() for _ in range(3)]
        with sched._wake:  # the loop takes none of them before all three are queued
            for k, box in enumerate(boxes):
                body = {"model": "m", "messages": (history if k == 0 else []) + [
                    {"role": "user", "content": f"Count to {k + 3}."}], "max_tokens": 4, "temperature": 0}
                sched.submit(Job(parse_chat_request(json.dumps(body).encode()), box.put))
        for box in boxes:
            item = box.get(timeout=120)
            while item[0] == "text":
                item = box.get(timeout=120)
            assert item[0] == "done"
        assert sizes[0] == 3, sizes
    finally:
        sched.stop()


def test_a_follow_up_sent_at_done_continues_the_same_chat(rt):
    """The "done" comes before the answer's recompute and snapshot; a next turn sent right then (from the push
    itself, on the scheduler thread) continues that stored chat and reuses its K/V, it does not branch off."""
    sched = Scheduler(rt, store=True)
    first, second = queue.Queue(), queue.Queue()
    msgs = [{"role": "user", "content": "Say hello."}]

    def body(messages):
        raw = {"model": "m", "messages": messages, "max_tokens": 6, "temperature": 0}
        return parse_chat_request(json.dumps(raw).encode())

    def on_first(item):
        first.put(item)
        if item[0] == "done":
            follow = msgs + [{"role": "assistant", "content": item[1].text}, {"role": "user", "content": "Again."}]
            sched.submit(Job(body(follow), second.put))

    def last(box):
        item = box.get(timeout=120)
        while item[0] == "text":
            item = box.get(timeout=120)
        return item

    try:
        sched.submit(Job(body(msgs), on_first))
        (k1, done1), (k2, done2) = last(first), last(second)
        assert k1 == k2 == "done" and done1.chat_id is not None
        assert done2.chat_id == done1.chat_id  # continued, not a branch
        assert done2.stats.from_memory > 0  # whole 16-token blocks up to a chunk edge: short turns reuse a part
        assert done1.stats.settle_ms > 0  # its recompute ran after it was answered
    finally:
        sched.stop()


def test_the_grammar_tokenizer_is_built_off_the_engine_loop_thread(rt, monkeypatch):
    """Building llguidance's tokenizer view takes ~0.5 s: on the loop's thread it would stall every running
    stream. The scheduler starts it at construction; a structured request waits for it on its own thread,
    as the HTTP handler does, before it is queued."""
    real, builders = llguidance.hf.from_tokenizer, []
    monkeypatch.setattr(llguidance.hf, "from_tokenizer",
                        lambda *a, **kw: builders.append(threading.current_thread().name) or real(*a, **kw))
    sched = Scheduler(rt, store=False)
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "A JSON object with your name."}],
                "max_tokens": 24, "temperature": 0, "response_format": {"type": "json_object"}}
        req = parse_chat_request(json.dumps(body).encode())
        if sched.needs_grammar_tokenizer(req):
            sched.grammars.wait()  # the handler's await asyncio.to_thread(...)
        assert sched.grammars.ready and not sched.needs_grammar_tokenizer(req)
        got: queue.Queue = queue.Queue()
        sched.submit(Job(req, got.put))
        item = got.get(timeout=120)
        while item[0] == "text":
            item = got.get(timeout=120)
        assert item[0] == "done" and item[1].text.startswith("{"), item
    finally:
        sched.stop()
    assert len(builders) == 1 and builders[0] != "kvchat-engine", builders  # the loop thread's name
