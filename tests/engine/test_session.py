"""Generation on the real model: sampling, stop/limit/cancel endings, in-process prefix hits, context limit."""

from __future__ import annotations

import threading

import pytest

from kvchat.context_fit import ContextFullError
from kvchat.conversation.records import new_settings
from kvchat.engine.loop import EngineLoop
from kvchat.engine.runner import last_cut
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.session import DEFAULT_SYSTEM_PROMPT, EmptyPromptError, Session
from kvchat.runtime import load_runtime

DOC = "Kvchat keeps the KV cache of every chat on disk. " * 40


@pytest.fixture(scope="module")
def rt(smol_info):
    return load_runtime(None, "fp8")


@pytest.fixture(scope="module")
def loop(rt):
    loop = EngineLoop(rt.engine)
    yield loop
    loop.close()


def new_session(rt, docs=()):
    return Session.new(rt.engine, rt.chat_format(new_settings([t for t, _ in docs])), DEFAULT_SYSTEM_PROMPT, list(docs))


def answer(loop, session, text, **kw):
    pieces = []
    loop.run(session.turn(text, SamplingParams(**kw)), on_text=pieces.append)
    assert "".join(pieces) == session.last_turn.text, "the streamed pieces add up to the final text"
    return session.last_turn


def test_seeded_sampling_is_reproducible(rt, loop):
    # Every run below reuses the same system-prompt prefix from the pool, so all three see the same cache
    # state. A cold first run could sample differently: its last prompt row's logits come from a longer
    # prefill, whose attention matmul rounds differently in the last fp32 bits, and int8 weights cast
    # activations to bf16, which can turn that into a visible logit change (K/V stay bit-identical:
    # test_canonical_kv.py).
    answer(loop, new_session(rt), "Name a colour.", max_tokens=1)
    runs = [answer(loop, new_session(rt), "Name a colour.", temperature=1.0, top_p=0.9, seed=s, max_tokens=8) for s in (7, 7, 8)]
    ids = [r.text for r in runs]
    assert ids[0] == ids[1]
    first = new_session(rt)
    answer(loop, first, "Name a colour.", max_tokens=8)
    greedy = new_session(rt)
    answer(loop, greedy, "Name a colour.", max_tokens=8)
    assert first.token_ids == greedy.token_ids, "greedy is deterministic"


def test_token_limit_and_cancel_append_the_full_closing(rt, loop):
    fmt_close = new_session(rt).fmt.assistant_close_ids(None)
    s = new_session(rt)
    turn = answer(loop, s, "Write a long story about a dragon named Ember.", max_tokens=3)
    assert turn.stats.finish_reason == "length" and turn.stats.new_tokens == 3
    assert s.token_ids[-len(fmt_close):] == fmt_close
    cancel = threading.Event()
    loop.run(s.turn("Tell me another long story, about a knight.", SamplingParams(max_tokens=50), cancel),
             on_text=lambda piece: cancel.set())  # cancelled once the first piece is out
    assert s.last_turn.stats.finish_reason == "cancelled" and s.last_turn.stats.new_tokens < 50
    assert s.token_ids[-len(fmt_close):] == fmt_close
    assert [seg.kind for seg in s.segments] == ["prefix", "user", "assistant", "user", "assistant"]


def test_second_chat_on_a_document_hits_the_pool_and_matches_a_cold_run(rt, loop):
    a = new_session(rt, [("kv.txt", DOC)])
    answer(loop, a, "What does kvchat keep?", max_tokens=6)
    b = new_session(rt, [("kv.txt", DOC)])
    turn = answer(loop, b, "Where is the cache kept?", max_tokens=6)
    prefix = b.segments[0].end
    # every full block of the shared prefix is a hit, cut back to the cold chunk plan's edge below it (no files)
    assert turn.stats.from_memory == last_cut(prefix - prefix % 16, b.boundaries) > 0
    assert turn.stats.prefilled_tokens == turn.stats.prompt_tokens - turn.stats.from_memory
    a.close()
    b.close()


def test_refusals_before_any_work(rt, loop):
    s = new_session(rt)
    before = list(s.token_ids)
    with pytest.raises(EmptyPromptError):
        loop.run(s.turn("  ", SamplingParams()))
    with pytest.raises(ContextFullError, match=r"context limit is 8192 tokens") as full:
        loop.run(s.turn("word " * 9000, SamplingParams()))
    assert full.value.limit == 8192 and full.value.needed > 8192  # the one error every layer raises, with its figures
    with pytest.raises(ContextFullError, match=r"conversation would be 8193 tokens; the context limit is 8192") as full:
        rt.engine.check_fits(8193)
    assert (full.value.needed, full.value.limit) == (8193, 8192)
    rt.engine.check_fits(8192)  # a full context fits
    assert s.token_ids == before and s.blocks.num_computed == 0
    assert s.tokens_left == rt.engine.max_context - len(before)


def test_pool_full_refuses_clearly_and_keeps_the_conversation(smol_info):
    from kvchat.engine.block_manager import PoolFullError

    small = load_runtime(None, "fp8", pool_bytes=60 * 16 * small_bytes_per_token(smol_info))  # 960 tokens
    loop = EngineLoop(small.engine)
    try:
        fmt = small.chat_format(new_settings(["kv.txt"]))
        big = Session.new(small.engine, fmt, DEFAULT_SYSTEM_PROMPT, [("kv.txt", DOC * 3)])
        with pytest.raises(ContextFullError, match="the KV pool holds 960"):
            loop.run(big.turn("What does kvchat keep?", SamplingParams(max_tokens=4)))
        holder = Session.new(small.engine, fmt, DEFAULT_SYSTEM_PROMPT, [("kv.txt", DOC)])
        answer(loop, holder, "What does kvchat keep?", max_tokens=2)  # ~560 tokens stay resident
        other = Session.new(small.engine, fmt, DEFAULT_SYSTEM_PROMPT, [("other.txt", DOC.replace("disk", "tape"))])
        before, free = list(other.token_ids), small.engine.blocks.num_free_blocks
        with pytest.raises(PoolFullError, match="KV pool is full"):
            loop.run(other.turn("Where is it kept?", SamplingParams(max_tokens=4)))
        assert other.token_ids == before and [seg.kind for seg in other.segments] == ["prefix"]
        assert small.engine.blocks.num_free_blocks == free, "no block leaked"
        assert answer(loop, holder, "And then?", max_tokens=2).stats.new_tokens >= 1, "the resident chat still works"
    finally:
        loop.close()


def small_bytes_per_token(info) -> int:
    from kvchat.engine.kv_pool import KVCacheSpec

    c = info.config
    return KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, "fp8").bytes_per_token
