"""``kvchat serve`` (a real process with an API key) and the OpenAI request fields, through the real ``openai``
client: finish reasons as the OpenAI API means them (and stored with the answer), ``response_format`` text,
presence/frequency penalties and logit bias that change the answer, unknown fields refused, consecutive user messages joined
(and reused by the next request), ``/health`` without the key."""

from __future__ import annotations

import math
import sqlite3

import openai
import pytest
from server_helpers import MODEL, ask_greedy
from transformers import AutoTokenizer

from kvchat.model.chat_format import ChatFormat

pytestmark = pytest.mark.model


def _stored_finish(server, chat_id: str) -> str | None:
    db = sqlite3.connect(server.home / "kvchat.db")
    [(finish,)] = db.execute("SELECT finish_reason FROM messages WHERE conversation_id = ? AND role = 'assistant'",
                             [chat_id]).fetchall()
    db.close()
    return finish


def test_finish_reason_is_stop_at_the_end_of_sequence_and_length_at_max_tokens(server):
    c = server.client()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    eos = ask_greedy(c, msgs, max_tokens=40)
    assert eos.choices[0].finish_reason == "stop" and eos.usage.completion_tokens < 40
    cut = ask_greedy(c, msgs, max_tokens=2)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 2
    reasons = [ch.choices[0].finish_reason for ch in ask_greedy(c, msgs, max_tokens=2, stream=True) if ch.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert _stored_finish(server, eos.model_extra["kvchat"]["chat_id"]) == "stop"
    assert _stored_finish(server, cut.model_extra["kvchat"]["chat_id"]) == "length"


def test_response_format_text_is_accepted(server):
    c = server.client()
    msgs = [{"role": "user", "content": "Say hi."}]
    assert ask_greedy(c, msgs, max_tokens=2, response_format={"type": "text"}).choices[0].message.content


def test_a_frequency_penalty_changes_the_answer_and_unknown_fields_are_refused(server):
    c = server.client()
    msgs = [{"role": "user", "content": "Write the word cat ten times."}]
    plain = ask_greedy(c, msgs, max_tokens=24).choices[0].message.content
    penalized = ask_greedy(c, msgs, max_tokens=24, frequency_penalty=2.0).choices[0].message.content
    assert plain.lower().count("cat") > penalized.lower().count("cat"), (plain, penalized)
    with pytest.raises(openai.BadRequestError, match="unknown field 'repetition_penalty'"):
        ask_greedy(c, msgs, max_tokens=2, extra_body={"repetition_penalty": 1.1})



def test_logit_bias_bans_the_greedy_first_token_and_an_id_outside_the_vocabulary_is_refused(server, smol_dir):
    c = server.client()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    plain = ask_greedy(c, msgs, max_tokens=3, logprobs=True)
    first = plain.choices[0].logprobs.content[0]
    [first_id] = AutoTokenizer.from_pretrained(smol_dir).encode(bytes(first.bytes).decode(), add_special_tokens=False)
    banned = ask_greedy(c, msgs, max_tokens=3, logprobs=True, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].bytes != first.bytes
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        ask_greedy(c, msgs, max_tokens=2, logit_bias={"10000000": 5})


def test_consecutive_user_messages_are_joined_and_the_next_request_reuses_them(server, smol_dir):
    c = server.client()
    msgs = [{"role": "user", "content": "My name is Ada."}, {"role": "user", "content": "What is my name?"}]
    r1 = ask_greedy(c, msgs, max_tokens=12)
    joined = ask_greedy(c, [{"role": "user", "content": "My name is Ada.\n\nWhat is my name?"}], max_tokens=12)
    assert r1.choices[0].message.content == joined.choices[0].message.content  # the same prompt
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And yours?"}, {"role": "user", "content": "Answer briefly."}]
    r2 = ask_greedy(c, msgs, max_tokens=4)
    fmt = ChatFormat(AutoTokenizer.from_pretrained(smol_dir))
    history = r2.usage.prompt_tokens - len(fmt.user_turn_ids("And yours?\n\nAnswer briefly."))
    assert r2.usage.prompt_tokens_details.cached_tokens >= history - 32, r2.model_extra["kvchat"]
    assert r2.model_extra["kvchat"]["miss_reason"] is None


def test_health_without_the_key_says_only_the_status(server):
    assert server.health(key=False) == {"status": "ok"}
    full = server.health()
    assert full["status"] == "ok" and full["model"] == MODEL and "pool_blocks_total" in full
    code, body, _ = server.request("GET", "/health", headers={"Authorization": "Bearer wrong"})
    assert (code, body) == (200, {"status": "ok"})


def test_logprobs_with_five_alternatives_streaming_and_not(server):
    c = server.client()
    msgs = [{"role": "user", "content": "Name three colors."}]
    r = ask_greedy(c, msgs, max_tokens=12, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")  # no entry for EOS
    assert bytes(b for t in content for b in t.bytes).decode() == r.choices[0].message.content
    for t in content:
        top = [alt.logprob for alt in t.top_logprobs]
        assert len(top) == 5 and top == sorted(top, reverse=True)
        assert t.logprob == top[0] and t.token == t.top_logprobs[0].token  # greedy: the chosen one is the likeliest
        assert sum(math.exp(lp) for lp in top) <= 1 + 1e-6
    chunks = [ch for ch in ask_greedy(c, msgs, max_tokens=12, logprobs=True, top_logprobs=5, stream=True)
              if ch.choices and ch.choices[0].logprobs]
    streamed = [(t.token, t.logprob) for ch in chunks for t in ch.choices[0].logprobs.content]
    assert streamed == [(t.token, t.logprob) for t in content]
    assert ask_greedy(c, msgs, max_tokens=2).choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match=r"top_logprobs must be an integer in \[0, 20\]"):
        ask_greedy(c, msgs, max_tokens=2, logprobs=True, top_logprobs=50)


def test_n_choices_share_one_prefill_and_each_equals_its_seed_alone(server):
    c = server.client()
    msgs = [{"role": "user", "content": "Write one sentence about a small boat on a quiet lake at dawn."}]
    kw = dict(model=MODEL, messages=msgs, temperature=1.0, max_tokens=16, seed=1234)
    r = c.chat.completions.create(n=3, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    kv = r.model_extra["kvchat"]
    prefilled = [ch["prefilled_tokens"] for ch in kv["choices"]]
    assert prefilled[0] == r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens, kv
    assert prefilled[1:] == [0, 0], kv  # the others fork choice 0's prompt: computed once
    assert len({ch["chat_id"] for ch in kv["choices"]}) == 3  # each choice is its own stored chat
    alone = [c.chat.completions.create(**{**kw, "seed": 1234 + i}) for i in range(3)]
    assert [ch.message.content for ch in r.choices] == [a.choices[0].message.content for a in alone]
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens  # counted once
    assert len({ch.message.content for ch in r.choices}) > 1  # the seeds differ, so do the choices
    texts, finishes, usage = ["", "", ""], [None] * 3, None
    for chunk in c.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
        usage = chunk.usage or usage
    assert texts == [ch.message.content for ch in r.choices] and finishes == [ch.finish_reason for ch in r.choices]
    assert (usage.prompt_tokens, usage.completion_tokens) == (r.usage.prompt_tokens, r.usage.completion_tokens)
