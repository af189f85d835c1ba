"""Block manager: ref counts, free list, prefix caching, fork + copy-on-write (properties and cases)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchat.engine.block_manager import BlockManager, PoolFullError, SeqBlocks, block_hash

BS = 4


def grow(bm: BlockManager, seq: SeqBlocks, ids: list[int], n: int, written: dict) -> list[tuple[int, int]]:
    """Reserve and 'compute' tokens up to n, recording which block got written (to check CoW)."""
    copies = bm.reserve(seq, n)
    for src, dst in copies:
        written[dst] = written.get(src, ())
    for p in range(seq.num_computed, n):
        b = seq.block_table[p // BS]
        written[b] = written.get(b, ()) + ((p % BS, ids[p]),)
    bm.commit(seq, ids, n)
    return copies


def check_invariants(bm: BlockManager, seqs: list[SeqBlocks]) -> None:
    refs = {}
    for s in seqs:
        for b in s.block_table:
            refs[b] = refs.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0) >= 0
        assert (block.block_id in bm.free) == (block.ref_count == 0), "free exactly when unreferenced"
    for h, b in bm.cached.items():
        assert bm.blocks[b].hash == h


def test_prefix_hit_shares_blocks_and_full_hit_recomputes_last_token_in_a_copy():
    bm = BlockManager(16, BS, b"salt")
    ids = list(range(12))  # exactly 3 full blocks
    a = SeqBlocks()
    grow(bm, a, ids, 12, {})
    b = SeqBlocks()
    hit = bm.attach_prefix(b, ids)
    assert hit == 11, "a full-prefix hit still recomputes the last token"
    assert b.block_table == a.block_table
    copies = bm.reserve(b, 12)
    assert len(copies) == 1 and copies[0][0] == a.block_table[2], "the shared last block is copied, never written"
    assert b.block_table[2] != a.block_table[2] and b.block_table[:2] == a.block_table[:2]


def test_freed_blocks_stay_cached_until_reused_lru():
    bm = BlockManager(6, BS, b"")
    ids = list(range(8))
    a = SeqBlocks()
    grow(bm, a, ids, 8, {})
    bm.free_seq(a)
    assert bm.num_free_blocks == 6
    b = SeqBlocks()
    assert bm.attach_prefix(b, ids + [99]) == 8, "freed blocks are revived by a later prefix hit"
    bm.free_seq(b)
    c = SeqBlocks()
    grow(bm, c, list(range(100, 116)), 16, {})  # needs 4 blocks: the 4 never-cached ones go first
    d = SeqBlocks()
    assert bm.attach_prefix(d, ids + [99]) == 8
    bm.free_seq(d)
    with pytest.raises(PoolFullError):
        grow(bm, SeqBlocks(), list(range(200, 300)), 100, {})


def test_fork_copy_on_write_of_partial_block():
    bm = BlockManager(8, BS, b"")
    ids = list(range(6))
    a = SeqBlocks()
    grow(bm, a, ids, 6, {})
    child = bm.fork(a, 6)
    assert child.block_table == a.block_table and bm.blocks[a.block_table[1]].ref_count == 2
    written: dict = {}
    copies = grow(bm, child, ids + [50, 51], 8, written)
    assert copies and copies[0][0] == a.block_table[1]
    assert a.block_table[1] != child.block_table[1]


def test_hashes_are_stable_across_processes():
    code = "from kvchat.engine.block_manager import block_hash; print(block_hash(None, b'fp', [1, 2, 3, 4]).hex())"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONHASHSEED": seed, "PATH": ""},
                           check=True).stdout for seed in ("1", "2")}
    assert outs == {block_hash(None, b"fp", [1, 2, 3, 4]).hex() + "\n"}
    assert block_hash(None, b"other", [1, 2, 3, 4]) != block_hash(None, b"fp", [1, 2, 3, 4])


ops = st.lists(st.tuples(st.sampled_from(["new", "grow", "fork", "free"]), st.integers(0, 7), st.integers(1, 9)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_sequences_keep_invariants(program):
    bm = BlockManager(24, BS, b"p")
    vocab = [i % 5 for i in range(200)]  # few distinct tokens: many prefix hits
    seqs: list[SeqBlocks] = []
    ids_of: dict[int, list[int]] = {}
    written: dict = {}
    for op, which, n in program:
        try:
            if op == "new":
                s = SeqBlocks()
                ids = vocab[which : which + 40]
                bm.attach_prefix(s, ids[: n * 2])
                seqs.append(s)
                ids_of[id(s)] = ids
                snapshot = {b: written.get(b) for b in s.block_table}
                grow(bm, s, ids, min(len(ids), s.num_computed + n), written)
                for b, content in snapshot.items():  # CoW: a mapped block's content never changes
                    if bm.blocks[b].ref_count > 0 and b not in s.block_table:
                        assert written.get(b) == content
            elif seqs and op == "grow":
                s = seqs[which % len(seqs)]
                ids = ids_of[id(s)]
                others = {b: written.get(b) for o in seqs if o is not s for b in o.block_table}
                grow(bm, s, ids, min(len(ids), s.num_computed + n), written)
                for b, content in others.items():
                    assert written.get(b) == content, "growing one sequence changed a block another one uses"
            elif seqs and op == "fork":
                s = seqs[which % len(seqs)]
                child = bm.fork(s, max(0, s.num_computed - n))
                seqs.append(child)
                ids_of[id(child)] = ids_of[id(s)]
            elif seqs and op == "free":
                s = seqs.pop(which % len(seqs))
                bm.free_seq(s)
        except PoolFullError:
            pass
        check_invariants(bm, seqs)
