"""A model forward over a throw-away KV pool: the engine's own weights, none of its state.

Used at engine start, before the engine's own pool exists: the fp8
K-centring calibration reads the K this writes into a 16-bit pool
(:func:`kvchat.engine.calibration.calibrate_k_mean`), and the pool sizing
measures the activation peak of one prefill chunk
(:func:`kvchat.engine.pool_size.activation_peak_bytes`). The sequence is laid
out in blocks ``0, 1, 2, ...`` of the scratch pool; chunks attend through the
pool as :meth:`kvchat.engine.runner.Engine.prefill` does (no dense copy, no sink).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvchat.engine.cache_identity import BLOCK_SIZE
from kvchat.engine.kv_pool import KVCacheSpec, KVPool
from kvchat.model.config import ModelConfig
from kvchat.model.transformer import AttnMetadata, Transformer


@torch.inference_mode()
def scratch_prefill(model: Transformer, cfg: ModelConfig, token_ids: Sequence[int], device: torch.device,
                    chunk_tokens: int, kv_dtype: str = "bf16") -> KVPool:
    """Run ``token_ids`` through ``model`` in chunks of ``chunk_tokens``; return the scratch pool holding their K/V.

    Returns:
        a :class:`KVPool` of ``ceil(len / block_size)`` blocks in ``kv_dtype``; token ``t`` is at slot ``t``
        (block ``t // block_size``).
    Raises:
        ValueError: no tokens.
    """
    n = len(token_ids)
    if n == 0:
        raise ValueError("a scratch prefill needs at least one token")
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype, BLOCK_SIZE)
    pool = KVPool(spec, -(-n // spec.block_size), device)
    table = torch.arange(pool.num_blocks, dtype=torch.int32, device=device)[None]
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    for a in range(0, n, chunk_tokens):
        b = min(a + chunk_tokens, n)
        positions = torch.arange(a, b, device=device)
        meta = AttnMetadata(slot_mapping=positions, block_table=table,
                            seq_lens=torch.tensor([b], dtype=torch.int32, device=device),
                            cu_seqlens_q=torch.tensor([0, b - a], dtype=torch.int32, device=device),
                            is_decode=b - a == 1 and a > 0)
        model(ids[a:b], positions, meta, pool)
    return pool
