"""``kvchat bench memory``: bytes per token from the allocated pool tensors, chats that fit, paged waste.

Each figure is checked against an independent count, so a pool that allocates
more than the spec says, a BlockManager that stops sharing prefixes or leaks
blocks, or a waste sum that double-counts, fails here.
"""

from __future__ import annotations

import math

import pytest

from kvchat.bench.memory import chats_that_fit, measure_pool
from kvchat.bench.paged_waste import _build_chats, measure_paged_waste
from kvchat.model.config import ModelConfig

BLOCK = 16
# SmolLM2-135M's KV shape (30 layers, 3 KV heads, head_dim 64): no weights needed.
CFG = ModelConfig.from_hf({
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
})


@pytest.mark.parametrize(("kv", "value_bytes", "scale_bytes"), [("fp8", 1, 4), ("bf16", 2, 0), ("fp16", 2, 0)])
def test_bytes_per_token_measured_from_the_pool_tensors(kv, value_bytes, scale_bytes):
    m = measure_pool(CFG, kv, num_blocks=8)
    per_head = 64 * value_bytes + scale_bytes  # K or V of one token, one KV head, one layer
    assert m["bytes_per_token"] == 2 * 30 * 3 * per_head
    assert m["scale_bytes_per_token"] == 2 * 30 * 3 * scale_bytes
    assert m["pool_nbytes"] == m["bytes_per_token"] * 8 * BLOCK
    assert m["bytes_per_token"] == m["formula_bytes_per_token"]


def test_chats_that_fit_counted_by_the_block_manager():
    block_bytes = 2 * 30 * 3 * 68 * BLOCK  # fp8
    budget = 10 * 256 * block_bytes + block_bytes * 255  # room for 10 chats of 4096 and 255 spare blocks
    fit = chats_that_fit(block_bytes, budget, 4096, BLOCK)
    assert fit["blocks"] == 10 * 256 + 255
    assert fit["chats_block_manager"] == fit["chats_arithmetic"] == 10
    odd = chats_that_fit(block_bytes, budget, 4097, BLOCK)  # one token more takes a whole extra block per chat
    assert odd["chats_block_manager"] == (10 * 256 + 255) // 257 == 10


def test_paged_waste_matches_an_independent_count_of_blocks():
    chats, seed = 60, 3
    res = measure_paged_waste(chats, seed, 8192, BLOCK)
    built = _build_chats(chats, seed, 8192)
    # Blocks a perfect prefix cache holds: every distinct full-block prefix once, plus each chat's partial last block.
    full = {tuple(ids[: (i + 1) * BLOCK]) for ids, _ in built for i in range(len(ids) // BLOCK)}
    partial = sum(1 for ids, _ in built if len(ids) % BLOCK)
    assert res["allocated_slots"] == (len(full) + partial) * BLOCK
    tails = sum(len(ids) % BLOCK for ids, _ in built)
    assert res["filled_slots"] == len(full) * BLOCK + tails
    assert res["internal_waste_slots"] == partial * BLOCK - tails
    assert 0 < res["internal_waste_slots"] <= chats * (BLOCK - 1)
    assert res["tokens_in_use"] == sum(len(ids) for ids, _ in built)
    assert res["shared_saved_slots"] > 0, "chats on the same document shared no blocks"
    assert res["contiguous_waste_pct"] == pytest.approx(100 * (1 - res["tokens_in_use"] / (chats * 8192)))
    assert all(ends == sorted(set(ends)) and ends[-1] == len(ids) <= 8192 for ids, ends in built)
    assert math.isclose(res["internal_waste_pct"], 100 * res["internal_waste_slots"] / res["allocated_slots"])
