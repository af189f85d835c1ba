"""A CUDA save copies its chunks out of the pool into pinned host memory only up to a bound
(kvchat.engine.persistence.pinned_chunks): a 32K-token chat of an 8B model never pins its ~2.2 GB at once."""

from __future__ import annotations

import torch

from kvchat.engine.persistence import CHUNK_TOKENS, SAVE_PINNED_BYTES, pinned_chunks
from kvchat.store.snapshot import ChunkLayout


def test_a_long_chats_save_pins_within_the_bound():
    chunk = ChunkLayout(32, 8, 128, torch.float8_e4m3fn).data_bytes(CHUNK_TOKENS)  # Llama-3-8B, fp8 pool: ~17 MB
    sizes = [chunk] * (32768 // CHUNK_TOKENS)
    pins = pinned_chunks(sizes, 0)
    assert SAVE_PINNED_BYTES <= 256 * 2**20 and sum(sizes) > 2e9
    assert sum(n for n, p in zip(sizes, pins) if p) <= SAVE_PINNED_BYTES
    assert pins == [True] * (SAVE_PINNED_BYTES // chunk) + [False] * (len(sizes) - SAVE_PINNED_BYTES // chunk)


def test_chunks_still_queued_count_against_the_bound():
    assert pinned_chunks([10, 10, 10], 0, limit=25) == [True, True, False]
    assert pinned_chunks([10, 10], 25, limit=25) == [False, False], "a writer behind: nothing more is pinned"
    assert pinned_chunks([10, 3, 10], 12, limit=25) == [True, True, False], "a short tail still fits"
    assert pinned_chunks([], 0) == []
