"""The CPU read path: a contiguous dequantized copy of one sequence's K/V (kvchat.engine.dense_kv).

It must hold exactly what the pool holds (bit for bit, after any mix of
prefill, decode, rollback, foreign writes and block reuse, and after a
restore that fills it straight from the chunk files), and attention over it
must agree with the paged reference kernels.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
import transformers
from turn_helpers import prefill

from kvchat.engine import dense_kv, persistence
from kvchat.engine.block_manager import SeqBlocks
from kvchat.engine.persistence import CHUNK_TOKENS, KVPersist
from kvchat.engine.runner import Engine
from kvchat.kernels import cpu_attention, dispatch
from kvchat.kernels import reference as ref
from kvchat.model.config import ModelConfig


def _engine(kv_dtype: str = "fp8", pool_bytes: int = 2**20, dense: bool = True) -> Engine:
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                                      initializer_range=0.25)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    return Engine(cfg, dict(hf.state_dict()), "test", kv_dtype=kv_dtype, pool_bytes=pool_bytes, device="cpu", dense_kv=dense)


def _assert_copy_matches_pool(engine: Engine, seq: SeqBlocks, first_token: int, length: int | None = None) -> None:
    """The copy holds ``length`` tokens (default: all the sequence's), the pool's values bit for bit, except
    position 0: the exact sink (fp8 pools)."""
    dense = engine.dense
    assert dense.length == (seq.num_computed if length is None else length)
    table = torch.tensor(seq.block_table)
    sink = engine.sink_kv(first_token) if engine.exact_sink else None
    for layer in range(engine.cfg.num_layers):
        kv = engine.pool.layer(layer)
        want_k = ref.gather_kv(kv.k_cache, kv.k_scale, table, dense.length).transpose(0, 1)
        want_v = ref.gather_kv(kv.v_cache, kv.v_scale, table, dense.length).transpose(0, 1)
        if sink is not None:
            assert not torch.equal(want_k[:, 0], sink[0][layer])  # the pool holds the quantized sink
            want_k[:, 0], want_v[:, 0] = sink[0][layer], sink[1][layer]
        assert torch.equal(dense.k[layer, :, : dense.length], want_k)
        assert torch.equal(dense.v[layer, :, : dense.length], want_v)


DECODE_ON_POOL = [False, pytest.param(True, marks=pytest.mark.skipif(
    cpu_attention._library() is None, reason="the compiled CPU decode attention does not build here"))]


@pytest.mark.parametrize("on_pool", DECODE_ON_POOL)
def test_copy_equals_pool_through_prefill_decode_and_rollback(on_pool):
    """Decode over the dense copy appends to it; decode on the pool (the compiled kernels) leaves it at the
    prefill's tokens, and the next prefill reads back the blocks decode wrote."""
    engine = _engine()
    assert engine.decode_on_pool == (dispatch.backend_for(engine.pool.k) == "compiled")
    engine.plan = replace(engine.plan, decode_on_pool=on_pool)
    ids = torch.randint(0, 97, (70,)).tolist()
    seq = SeqBlocks()
    prefill(engine, seq, ids[:45], boundaries=[0, 19])
    _assert_copy_matches_pool(engine, seq, ids[0])
    for n in range(46, 51):
        engine.decode(seq, ids[:n])
    _assert_copy_matches_pool(engine, seq, ids[0], length=45 if on_pool else 50)
    # from the last cut (48): the copy keeps tokens 0..47 as read before and must notice that block 2
    # (tokens 32..47) was written by the decode steps, and read it back
    prefill(engine, seq, ids[:53], boundaries=[0, 19, 48])
    _assert_copy_matches_pool(engine, seq, ids[0])
    # Roll back into the middle of a block and continue with other tokens (edit / regenerate).
    seq.num_computed = 21
    other = ids[:21] + [(t + 1) % 97 for t in ids[21:60]]
    prefill(engine, seq, other)
    _assert_copy_matches_pool(engine, seq, ids[0])


@pytest.mark.parametrize("on_pool", DECODE_ON_POOL)
def test_a_write_it_did_not_make_is_noticed(on_pool):
    """Another writer (a restore from disk, say) changes a block the copy already read: the next forward
    over the copy (a decode over it, or a prefill) reads it again."""
    engine = _engine()
    engine.plan = replace(engine.plan, decode_on_pool=on_pool)
    ids = torch.randint(0, 97, (40,)).tolist()
    seq = SeqBlocks()
    prefill(engine, seq, ids)
    block = seq.block_table[0]
    engine.pool.mark_written([block])
    engine.pool.k.view(torch.uint8)[:, block, 3] = 0x38  # every element of token 3 becomes 1.0 * scale
    if on_pool:  # from the cut at 40: the copy's tokens 0..39 are trusted unless it notices the write
        prefill(engine, seq, ids + [5, 6], boundaries=[0, 40])
    else:
        engine.decode(seq, ids + [5])
    _assert_copy_matches_pool(engine, seq, ids[0])


def test_switching_sequences_and_reusing_blocks_reads_afresh():
    engine = _engine(pool_bytes=6 * 16 * 2 * 2 * 2 * (16 + 4))  # 6 blocks: the second sequence must reuse the first's
    assert engine.pool.num_blocks == 6
    a_ids = torch.randint(0, 97, (60,)).tolist()
    b_ids = [(t + 3) % 97 for t in a_ids]
    a, b = SeqBlocks(), SeqBlocks()
    prefill(engine, a, a_ids)
    engine.release(a)
    prefill(engine, b, b_ids)
    _assert_copy_matches_pool(engine, b, b_ids[0])
    engine.release(b)
    logits = prefill(engine, a, a_ids).logits  # same seq object, blocks overwritten meanwhile
    _assert_copy_matches_pool(engine, a, a_ids[0])
    fresh = _engine(pool_bytes=6 * 16 * 2 * 2 * 2 * (16 + 4))
    assert torch.equal(logits, prefill(fresh, SeqBlocks(), a_ids).logits)


def test_a_one_token_chunk_is_not_a_decode_step(monkeypatch):
    """A prefill chunk of one token (a segment of one token) stores its K/V: on an engine without a dense
    copy it runs the reference's attention, not the compiled decode kernel, so its logits and pool are
    the reference path's bit for bit."""
    gen = torch.Generator().manual_seed(5)
    texts = [torch.randint(0, 97, (64,), generator=gen).tolist() for _ in range(5)]  # the kernel's rounding
    runs = []  # differs from the reference's in some of them (measured: 3 of 5 seeds), so all must match
    for attention in (None, "torch"):
        if attention:
            monkeypatch.setenv("KVCHAT_ATTENTION", attention)
        engine, run = _engine(dense=False), []
        for ids in texts:
            seq = SeqBlocks()
            run.append(engine.score(seq, ids, boundaries=[0, 40, 41]))  # positions 41.. read token 40's K/V
            engine.release(seq)
        runs.append((*run, engine.pool.k.clone(), engine.pool.v.clone()))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("t,prefix", [(1, 40), (1, 0), (7, 33), (16, 0)])
def test_dense_attention_matches_the_paged_reference(heads, kv_heads, t, prefix):
    torch.manual_seed(1)
    length = prefix + t
    q = torch.randn(t, heads, 64)
    k, v = torch.randn(length, kv_heads, 64), torch.randn(length, kv_heads, 64)
    mask = torch.ones(t, length, dtype=torch.bool).tril(diagonal=prefix)
    want = torch.nn.functional.scaled_dot_product_attention(  # independent formulation: K/V repeated per query head
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=0.125,
        enable_gqa=True)[0].transpose(0, 1)
    got = ref.dense_attention(q, k.transpose(0, 1), v.transpose(0, 1), prefix, 0.125)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # fp32, different reduction order
    strided = torch.cat([k, torch.randn(9, kv_heads, 64)]).transpose(0, 1)[:, :length]  # a longer buffer's view
    assert torch.equal(ref.dense_attention(q, strided, v.transpose(0, 1), prefix, 0.125), got)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.skipif(
    cpu_attention._library() is None, reason="the compiled CPU decode attention does not build here"))])
@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8"])
def test_smollm2_dense_and_paged_paths_give_identical_logits(smol_info, kv_dtype, compiled, monkeypatch):
    """The real model, 300 tokens + 8 decode steps, both read paths side by side: bit for bit the same with
    the reference kernels, so a chunk's K/V (and every snapshot) do not depend on which path computed it.
    With the compiled kernels (``compiled``: cache writes bit for bit the reference's, decode attention on
    the pool against decode over the dense copy), prefill is still bitwise and decode close: its K/V are
    provisional."""
    from kvchat.model.registry import load_weights

    if not compiled:
        monkeypatch.setenv("KVCHAT_ATTENTION", "torch")
    weights = load_weights(smol_info)
    engines = [Engine(smol_info.config, weights, smol_info.fingerprint, kv_dtype=kv_dtype, pool_bytes=2**26,
                      device="cpu", dense_kv=d) for d in (True, False)]
    assert engines[1].decode_on_pool and engines[0].decode_on_pool == compiled
    engines[0].plan = replace(engines[0].plan, decode_on_pool=False)  # decode over the dense copy (the reference)
    ids = list(range(2000, 2300))
    seqs = [SeqBlocks(), SeqBlocks()]
    rows = [[prefill(e, s, ids, boundaries=[0, 128]).logits] for e, s in zip(engines, seqs)]
    assert torch.equal(rows[0][0], rows[1][0])
    assert torch.equal(engines[0].pool.k, engines[1].pool.k) and torch.equal(engines[0].pool.v, engines[1].pool.v)
    for n in range(8):
        step = ids + [int(rows[0][-1].argmax())]
        ids = step
        for e, s, r in zip(engines, seqs, rows):
            r.append(e.decode(s, step))
    dense, paged = torch.stack(rows[0]), torch.stack(rows[1])
    if not compiled:
        assert torch.equal(dense, paged)
        assert torch.equal(engines[0].pool.k, engines[1].pool.k) and torch.equal(engines[0].pool.v, engines[1].pool.v)
    else:
        # another summation order in decode attention: fp32 rounding, but each step writes its token's K/V
        # into the pool, where a last-bit difference can flip a rounding of the pool dtype (fp8: 3 mantissa
        # bits), and later layers and steps read those. Measured (printed per step): fp16 pool <= 0.005 over
        # 8 steps; fp8 0.03 at the first step, 0.64 by the eighth (logits of magnitude ~20). Bounded at
        # about twice (1.5x for fp8's last step); a wrong kernel would be off by whole units at once.
        diff = (dense - paged).abs().amax(dim=-1)
        print("max |dense - paged| per decode step:", [round(float(d), 4) for d in diff[1:]])
        assert not torch.equal(dense, paged)  # the kernel ran
        assert diff[1] < 0.06 and diff.max() < (0.01 if kv_dtype == "fp16" else 1.0)
        assert dense[1].argmax() == paged[1].argmax()


RESTORE_TOKENS = CHUNK_TOKENS + 37  # a full chunk and a tail (the test model allows 512 tokens)
QUESTION = [5, 6, 7]  # the turn after the restored tokens: a segment starting at RESTORE_TOKENS


def _restore_ids() -> list[int]:
    return torch.randint(0, 97, (RESTORE_TOKENS,), generator=torch.Generator().manual_seed(3)).tolist()


def _saved(kv_dtype: str) -> None:
    """Prefill and store the ids with one engine."""
    engine = _engine(kv_dtype, pool_bytes=8 * 2**20)
    persist = KVPersist(engine)
    seq = SeqBlocks()
    prefill(engine, seq, _restore_ids())
    persist.save(seq, _restore_ids(), [], owner="chat")
    persist.close()


def _resumed_logits(engine: Engine) -> torch.Tensor:
    """Restore the stored ids into ``engine`` and compute the question's last logits."""
    persist = KVPersist(engine)
    seq, ids = SeqBlocks(), _restore_ids() + QUESTION
    assert persist.restore(seq, ids).from_disk == RESTORE_TOKENS
    logits = prefill(engine, seq, ids, boundaries=[RESTORE_TOKENS]).logits
    persist.close()
    return logits


def test_restore_fills_the_dense_copy_and_the_next_forward_reads_only_new_tokens(monkeypatch):
    for kv_dtype in ("fp8", "bf16"):
        _saved(kv_dtype)
        engine = _engine(kv_dtype, pool_bytes=8 * 2**20)  # a fresh engine: nothing in its pool
        persist = KVPersist(engine)
        seq, ids = SeqBlocks(), _restore_ids() + QUESTION
        threads, later = torch.get_num_threads(), []
        torch.set_num_threads(2)  # a count the readers' single thread differs from, on any machine
        try:
            res = persist.restore(seq, ids)
            restored = torch.get_num_threads()
            worker = threading.Thread(target=lambda: later.append(torch.get_num_threads()))  # started after it
            worker.start()
            worker.join()
        finally:
            torch.set_num_threads(threads)
        assert res.from_disk == RESTORE_TOKENS and res.miss_reason is None
        assert restored == 2 and later == [2]  # the readers ran single-threaded; the caller and later threads did not
        _assert_copy_matches_pool(engine, seq, ids[0])

        read = []
        real = dense_kv.dispatch.read_slots
        monkeypatch.setattr(dense_kv.dispatch, "read_slots", lambda c, s, slots, out=None: (
            read.append(slots.numel()), real(c, s, slots, out=out))[1])
        logits = prefill(engine, seq, ids, boundaries=[RESTORE_TOKENS]).logits
        monkeypatch.setattr(dense_kv.dispatch, "read_slots", real)
        assert read and max(read) == len(QUESTION)  # only the question's new tokens, layer by layer
        persist.close()
        # the paged path (attention through the block table) over the same restored chunks agrees bit for bit
        assert torch.equal(logits, _resumed_logits(_engine(kv_dtype, pool_bytes=8 * 2**20, dense=False)))


def test_the_engines_copy_is_allocated_for_its_context_at_load(monkeypatch):
    """Preallocated (as load_runtime does), the copy holds the whole context limit (touched, so a first restore
    faults no page) and is never reallocated by a sequence that fits; one bigger than PREALLOCATE_BYTES is capped."""
    engine = _engine()
    engine.plan = replace(engine.plan, decode_on_pool=False)  # the last token over the copy too: it holds the whole context
    dense = engine.dense
    assert dense.k.shape[2] == 0
    assert dense.preallocate(engine.max_context) >= engine.max_context and dense.length == 0
    before = (dense.k.data_ptr(), dense.v.data_ptr())
    ids = torch.randint(0, 97, (engine.max_context,)).tolist()
    seq = SeqBlocks()
    prefill(engine, seq, ids[:-1])
    engine.decode(seq, ids)
    assert (dense.k.data_ptr(), dense.v.data_ptr()) == before
    _assert_copy_matches_pool(engine, seq, ids[0])
    small = dense.fp32_bytes_per_token * 200  # 200 tokens' worth: rounded up to 256
    monkeypatch.setattr(dense_kv, "PREALLOCATE_BYTES", small)
    capped = dense_kv.DenseKV(engine.pool, engine.blocks)
    assert capped.preallocate(engine.max_context) == dense_kv.MIN_CAPACITY < engine.max_context


def _drain(q) -> list[torch.Tensor]:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_a_cpu_restore_reads_through_the_staging_buffers_made_with_the_store(monkeypatch):
    """The buffers are made (and touched) with the store, one per reader, lent to the readers and given back; a
    restore with more readers than buffers makes the others, big enough for any chunk, and keeps them."""
    _saved("fp8")
    seen: list[int] = []
    real = persistence.read_row
    monkeypatch.setattr(persistence, "read_row", lambda row, layout, out=None: (
        seen.append(out.data_ptr()), real(row, layout, out=out))[1])
    full = CHUNK_TOKENS
    engine = _engine("fp8", pool_bytes=8 * 2**20)
    persist = KVPersist(engine)
    made = _drain(persist._cpu_staging)
    assert len(made) == persistence._reader_count()
    assert all(b.numel() == persist.layout.data_bytes(full) and not b.any() for b in made)
    for b in made:
        persist._cpu_staging.put(b)
    ids = _restore_ids() + QUESTION
    assert persist.restore(SeqBlocks(), ids).from_disk == RESTORE_TOKENS
    assert len(seen) == 2 and set(seen) <= {b.data_ptr() for b in made}
    assert sorted(b.data_ptr() for b in _drain(persist._cpu_staging)) == sorted(b.data_ptr() for b in made)
    persist.close()

    seen.clear()
    other = KVPersist(_engine("fp8", pool_bytes=8 * 2**20))
    drained = _drain(other._cpu_staging)  # none left: as if more readers ran than were made (kept alive: new
    gone = {b.data_ptr() for b in drained}  # buffers cannot take their addresses)
    assert other.restore(SeqBlocks(), ids).from_disk == RESTORE_TOKENS
    kept = _drain(other._cpu_staging)
    assert 1 <= len(kept) <= 2 and {b.data_ptr() for b in kept} == set(seen) and not set(seen) & gone
    assert all(b.numel() == other.layout.data_bytes(full) for b in kept)
    other.close()
