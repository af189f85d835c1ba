"""Every token's K/V are bit-identical however they were obtained: decoded, reused from memory, or cold.

Decode computes one token at a time and differs in the last bits from a
prefill chunk; after a turn the session recomputes the answer in a cold
run's chunks, and reused K/V are trimmed to a chunk edge. So a chat's pool
contents equal a cold prefill of its token list, byte for byte, and an
answer cannot depend on whether the snapshot of a turn was on disk.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from turn_helpers import prefill, run_prefix, run_turn

from kvchat.conversation.records import new_settings
from kvchat.engine.block_manager import SeqBlocks
from kvchat.engine.inference import inference
from kvchat.engine.runner import chunk_plan, last_cut
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.sequence import DecodeStep, PrefillChunk
from kvchat.engine.session import DEFAULT_SYSTEM_PROMPT, Session
from kvchat.runtime import load_runtime

DOC = ("Paged attention stores the KV cache in fixed-size blocks, like virtual memory pages, "
       "so memory is allocated on demand and shared between sequences. ") * 12
# a text no other test of this module puts in the shared pool: a pool hit on a longer document that starts with
# the same tokens would come from other chunks (its segment ends elsewhere), see the test that uses it
NOTES = "The heron nests by the old mill, and the mill wheel turns the river into light. " * 25
# another such text, for the test of a prefix restored whole: its first chat must compute the whole prefix cold
LEDGER = ("A ledger keeps one line per block: its number, the sequence that owns it and how many tokens it "
          "holds, so a freed block goes back to the free list at once. ") * 12


@pytest.fixture(scope="module")
def rt(smol_info):
    return load_runtime(None, "fp16")  # 11-bit mantissa: a last-bit difference shows up (fp8 hides most)


def _pool_bytes(engine, seq: SeqBlocks, n: int) -> list[torch.Tensor]:
    """Raw bytes of tokens [0, n) of ``seq`` in every pool tensor (K, V, scales), all layers."""
    pos = torch.arange(n)
    slots = torch.tensor(seq.block_table)[pos // 16] * 16 + pos % 16
    out = []
    for t in (engine.pool.k, engine.pool.v, engine.pool.k_scale, engine.pool.v_scale):
        if t is not None:
            out.append(t.flatten(1, 2)[:, slots].contiguous().view(torch.uint8))
    return out


@pytest.fixture(scope="module")
def cold_rt(rt):
    return load_runtime(None, rt.engine.spec.kv_dtype)  # its own pool: a cold run shares nothing


def _assert_equals_cold(cold_rt, session: Session) -> None:
    ids = session.token_ids
    assert session.blocks.num_computed == len(ids)
    cold = SeqBlocks()
    prefill(cold_rt.engine, cold, ids, session.boundaries)
    got = _pool_bytes(session.engine, session.blocks, len(ids))
    want = _pool_bytes(cold_rt.engine, cold, len(ids))
    cold_rt.engine.release(cold)
    for g, w, name in zip(got, want, ("k", "v")):
        assert torch.equal(g, w), f"{name} differs from a cold prefill"


def test_last_cut_is_an_edge_of_the_chunk_plan():
    bounds = [0, 700, 730, 1500]
    edges = {a for a, _ in chunk_plan(0, 2100, bounds)}  # where chunks start, for any longer plan too
    for n in range(0, 2100, 7):
        cut = last_cut(n, bounds)
        assert cut in edges and cut <= n
        assert not any(cut < e <= n for e in edges), "largest edge at or below n"


def test_a_chat_holds_exactly_what_a_cold_run_computes(rt, cold_rt):
    session = Session.new(rt.engine, rt.chat_format(new_settings(["doc"])), DEFAULT_SYSTEM_PROMPT, [("doc", DOC)])
    for q in ("What does paged attention store?", "Why are blocks shared?"):
        run_turn(session, q, SamplingParams(max_tokens=24))
        assert session.last_turn.stats.new_tokens > 1, "decode ran"
        assert session.last_turn.stats.settle_ms > 0
    _assert_equals_cold(cold_rt, session)


def test_the_answer_is_settled_in_steps_after_its_text(cold_rt):
    """The recompute comes as ``PrefillChunk(settle=True)`` steps after the last text piece (a scheduler runs
    other streams between them), and a progress callback sees only the prompt's prefill."""
    # its own runtime: after another chat in the same pool, a prefix reused from memory is not yet bit-equal to a
    # cold run
    rt = load_runtime(None, cold_rt.engine.spec.kv_dtype)
    session = Session.new(rt.engine, rt.chat_format(new_settings([])), DEFAULT_SYSTEM_PROMPT, [])
    forward = rt.engine._forward
    rt.engine._forward = lambda *a, **k: (kinds.append("forward"), forward(*a, **k))[1]  # this runtime only
    kinds, steps, reply = [], session.turn("What does paged attention store?", SamplingParams(max_tokens=24)), None
    while True:
        try:
            with inference():  # as the engine loop drives a turn
                item = steps.send(reply)
        except StopIteration:
            break
        reply = None
        if isinstance(item, DecodeStep):
            reply = rt.engine.decode(item.sequence.blocks, item.token_ids)
            kinds.append("decode")
        elif isinstance(item, PrefillChunk):
            kinds.append("settle" if item.settle else "prefill")
        else:
            kinds.append("text")
    first = kinds.index("settle")
    assert "decode" in kinds[:first] and "text" in kinds[:first] and "forward" in kinds[:first]
    assert kinds[first + 1] == "forward"  # the first settle step comes before any of the recompute's forwards
    assert set(kinds[first:]) == {"settle", "forward"} and kinds[-1] == "settle"
    assert session.last_turn.stats.settle_ms > 0
    _assert_equals_cold(cold_rt, session)
    calls: list[tuple[int, int]] = []
    run_turn(session, "And why?", SamplingParams(max_tokens=24), progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1] == session.last_turn.stats.prefilled_tokens  # the prompt's prefill only


def test_a_resume_whose_chain_stops_inside_a_segment_recomputes_in_cold_chunks(rt, cold_rt):
    """The second snapshot chunk is gone: restore stops at token 256, inside the documents' prefix."""
    from kvchat.engine.persistence import KVPersist

    persist = KVPersist(rt.engine)
    first = Session.new(rt.engine, rt.chat_format(new_settings(["doc"])), DEFAULT_SYSTEM_PROMPT, [("doc", DOC * 3)], persist)
    run_turn(first, "What does paged attention store?", SamplingParams(max_tokens=16))
    first.save_snapshot("c_canonical")
    persist.flush()
    rows = persist.find(first.token_ids)
    assert first.segments[0].end > 768 and rows[0].token_count == 256
    Path(rows[1].path).unlink()
    first.close()
    persist.close()

    resumed_rt = load_runtime(None, rt.engine.spec.kv_dtype)  # a new process: nothing in its pool
    again = Session(resumed_rt.engine, first.fmt, list(first.token_ids), list(first.segments), KVPersist(resumed_rt.engine))
    run_turn(again, "And what is shared?", SamplingParams(max_tokens=16))
    stats = again.last_turn.stats
    assert stats.bytes_read > 0 and stats.miss_reason and "missing" in stats.miss_reason  # chunk 1 was read...
    # ...but 256 is inside the first 512-token chunk of the prefix: cut back to 0 and recomputed from there,
    # so nothing counts as reused (reused_tokens = from_memory + from_disk)
    assert stats.from_disk == 0 and stats.reused_tokens == 0
    _assert_equals_cold(cold_rt, again)
    again.persist.close()


def test_a_second_chat_on_a_prefix_in_the_pool_holds_a_cold_runs_kv(rt, cold_rt):
    """The same documents and question twice in one process: the second chat's pool hit covers whole blocks,
    416 of the 417-token prompt, and stops inside the question's chunk; it is cut back to the question's
    start (a chunk edge) instead of computing its last token alone, which gave other bits."""
    fmt = rt.chat_format(new_settings(["doc"]))
    first = Session.new(rt.engine, fmt, DEFAULT_SYSTEM_PROMPT, [("doc", DOC)])
    run_turn(first, "What does paged attention store?", SamplingParams(max_tokens=8))
    second = Session.new(rt.engine, fmt, DEFAULT_SYSTEM_PROMPT, [("doc", DOC)])
    run_turn(second, "What does paged attention store?", SamplingParams(max_tokens=8))
    stats, question = second.last_turn.stats, second.segments[1]
    assert stats.from_memory == question.start == stats.reused_tokens  # 416 in the pool, 401 kept
    assert stats.prompt_tokens - 1 > stats.from_memory and stats.prompt_tokens % 16 != 0
    _assert_equals_cold(cold_rt, second)
    first.close()
    second.close()


def test_a_stored_documents_prefix_is_restored_whole_and_the_next_turn_is_cold_exact(rt, cold_rt, tmp_path):
    """A prefix's steps (a new chat on a known document) restores all the prefix's tokens from its files,
    the last one included, and computes nothing; before, it restored all but the last and computed that
    one alone, with other bits than the cold chunk, and every later token read it."""
    from kvchat.engine.persistence import KVPersist

    fmt = rt.chat_format(new_settings(["doc"]))
    persist = KVPersist(rt.engine)
    first = Session.new(rt.engine, fmt, DEFAULT_SYSTEM_PROMPT, [("doc", LEDGER)], persist)
    assert run_prefix(first).reused_tokens == 0  # computed cold, not on another test's blocks (a known limit)
    first.save_snapshot("c_whole")
    persist.flush()
    first.close()
    persist.close()

    other_rt = load_runtime(None, rt.engine.spec.kv_dtype)  # a new process: nothing in its pool
    again = Session.new(other_rt.engine, fmt, DEFAULT_SYSTEM_PROMPT, [("doc", LEDGER)], KVPersist(other_rt.engine))
    stats = run_prefix(again)
    assert stats.from_disk == len(again.token_ids) == stats.reused_tokens and stats.prefilled_tokens == 0
    run_turn(again, "What is shared?", SamplingParams(max_tokens=8))
    _assert_equals_cold(cold_rt, again)
    again.persist.close()
    again.close()


def test_a_pool_hit_is_extended_by_the_files_tail_and_a_live_turn_reads_nothing(rt, cold_rt):
    """Two chats on one stored documents prefix that does not end on a block: the second takes the prefix's
    whole blocks from the pool and only the last partial block from the file's tail (not cut back and read
    again), holds a cold run's K/V; its next turn reuses its own history and counts nothing as read from disk.

    Its own document (NOTES): the pool and the files key K/V by token ids only, so a hit on another chat whose
    document starts with the same tokens but ends elsewhere (DOC * 3 above, computed in other chunks) is
    reused as is and is not a cold run's bits for this chat: a known limit, not what this test is about (nor
    the one of a prefix restored whole, which has its own text, LEDGER, for the same reason)."""
    from kvchat.engine.persistence import KVPersist

    fmt = rt.chat_format(new_settings(["notes"]))
    persist = KVPersist(rt.engine)
    first = Session.new(rt.engine, fmt, DEFAULT_SYSTEM_PROMPT, [("notes", NOTES)], persist)
    run_turn(first, "What does paged attention store?", SamplingParams(max_tokens=8))
    first.save_snapshot("c_tail")
    persist.flush()
    second = Session.new(rt.engine, fmt, DEFAULT_SYSTEM_PROMPT, [("notes", NOTES)], persist)
    run_turn(second, "Why are blocks shared?", SamplingParams(max_tokens=8))
    stats, prefix = second.last_turn.stats, second.segments[0].end
    assert prefix % 16 and stats.from_memory == prefix - prefix % 16 and stats.from_disk == prefix % 16
    assert stats.reused_tokens == prefix and stats.bytes_read > 0
    _assert_equals_cold(cold_rt, second)
    history = len(second.token_ids)
    run_turn(second, "And what is stored?", SamplingParams(max_tokens=4))
    stats = second.last_turn.stats
    assert stats.from_disk == 0 and stats.from_memory == 0 and stats.reused_tokens == history
    _assert_equals_cold(cold_rt, second)
    first.close()
    second.close()
    persist.close()
