"""A model forward over a throw-away KV pool: the engine's own weights, none of its state.

Used at engine start, before the engine's own pool exists: the fp8
K-centring calibration (:mod:`kvchat.engine.calibration`) reads the K this
writes into a 16-bit pool (:func:`calibrate_k_mean`, here rather than beside
the calibration's storage, which the cache identity imports), and the pool sizing
measures the activation peak of one prefill chunk
(:func:`kvchat.engine.pool_size.activation_peak_bytes`). The sequence is laid
out in blocks ``0, 1, 2, ...`` of the scratch pool; chunks attend through the
pool as :meth:`kvchat.engine.runner.Engine.prefill_steps` does (no dense copy, no sink).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

from kvchat.engine.cache_identity import BLOCK_SIZE
from kvchat.engine.inference import inference
from kvchat.engine.kv_pool import KVCacheSpec, KVPool
from kvchat.model.config import ModelConfig
from kvchat.model.transformer import AttnMetadata, Block, Transformer

CALIBRATION_CHUNK_TOKENS = 512  # the prefill chunk the stored calibrations were computed with (runner's default then)


def _scratch(cfg: ModelConfig, token_ids: Sequence[int], device: torch.device, chunk_tokens: int,
             kv_dtype: str) -> tuple[KVPool, torch.Tensor, list[tuple[int, int, AttnMetadata]]]:
    """The scratch pool for ``token_ids`` (token ``t`` at slot ``t``), the ids on ``device`` and each chunk's
    ``(start, end, metadata)``. Raises ValueError for no tokens."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("a scratch prefill needs at least one token")
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype, BLOCK_SIZE)
    pool = KVPool(spec, -(-n // spec.block_size), device)
    table = torch.arange(pool.num_blocks, dtype=torch.int32, device=device)[None]
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    chunks = []
    for a in range(0, n, chunk_tokens):
        b = min(a + chunk_tokens, n)
        positions = torch.arange(a, b, device=device)
        chunks.append((a, b, AttnMetadata(slot_mapping=positions, block_table=table,
                                          seq_lens=torch.tensor([b], dtype=torch.int32, device=device),
                                          cu_seqlens_q=torch.tensor([0, b - a], dtype=torch.int32, device=device),
                                          is_decode=b - a == 1 and a > 0)))
    return pool, ids, chunks


@inference()  # at the engine's load, before any loop
def scratch_prefill(model: Transformer, cfg: ModelConfig, token_ids: Sequence[int], device: torch.device,
                    chunk_tokens: int, kv_dtype: str = "bf16") -> KVPool:
    """Run ``token_ids`` through ``model`` in chunks of ``chunk_tokens``; return the scratch pool holding their K/V.

    Returns:
        a :class:`KVPool` of ``ceil(len / block_size)`` blocks in ``kv_dtype``; token ``t`` is at slot ``t``
        (block ``t // block_size``).
    Raises:
        ValueError: no tokens.
    """
    pool, ids, chunks = _scratch(cfg, token_ids, device, chunk_tokens, kv_dtype)
    for a, b, meta in chunks:
        model(ids[a:b], meta.slot_mapping, meta, pool)
    return pool


@inference()  # at the engine's load, before any loop
def scratch_prefill_layers(model: Transformer, layers: Iterable[Block], cfg: ModelConfig, token_ids: Sequence[int],
                           device: torch.device, chunk_tokens: int, kv_dtype: str = "bf16") -> KVPool:
    """:func:`scratch_prefill`'s K/V computed layer by layer: every chunk through a layer of ``layers`` (the
    model's decoder layers in order, e.g. :meth:`kvchat.engine.runner.Engine.unquantized_layers`) before the
    next layer is asked for. The same operations on the same values as the model's forward chunk by chunk
    (a chunk of a layer reads that layer's K/V of the earlier chunks only), so the same K/V bits; the
    hidden states of all chunks are held between layers (``len(token_ids) x hidden_size`` twice, fp32). Only
    ``model``'s embedding and RoPE are used from ``model`` itself (no final norm: nothing reads it).

    Raises:
        ValueError: no tokens.
    """
    pool, ids, chunks = _scratch(cfg, token_ids, device, chunk_tokens, kv_dtype)
    backend = model.kernels.backend if model.kernels is not None else None
    states = []
    for a, b, meta in chunks:
        x = F.embedding(ids[a:b], model.embed_tokens)
        states.append([x, None, *model.rope(meta.slot_mapping, x.dtype)])
    for layer in layers:
        for state, (_, _, meta) in zip(states, chunks):
            x, delta, cos, sin = state
            state[0], state[1] = layer(x, delta, cos, sin, meta, pool, backend)
    return pool


@inference()  # at the engine's load, before any loop
def calibrate_k_mean(engine, token_ids: Sequence[int]) -> torch.Tensor:
    """Mean post-RoPE K per layer and KV head over positions 1.., as a bf16 pool stores them.

    Runs ``engine``'s unquantized layers (:meth:`kvchat.engine.runner.Engine.unquantized_layers`) over a
    throw-away bf16 pool (:func:`scratch_prefill_layers`, chunks of :data:`CALIBRATION_CHUNK_TOKENS`), so the
    mean is not shaped by fp8 rounding nor by weight quantization, and the engine's own pool and block tables
    are untouched (it may be an engine still being built: only ``model``, ``cfg``, ``device`` and
    ``unquantized_layers`` are used). The scratch pool is freed on return.

    Args:
        engine: a :class:`kvchat.engine.runner.Engine` (or one being built) whose model has no K shift yet.
        token_ids: calibration text, ids (never the evaluation text).
    Returns:
        float32 ``[num_layers, num_kv_heads, head_dim]`` on the CPU.
    Raises:
        ValueError: the model already subtracts a K shift, or fewer than 2 tokens.
    """
    if any(layer.self_attn.k_shift is not None for layer in engine.model.layers):
        raise ValueError("calibrate K on a model without K centring")
    if len(token_ids) < 2:
        raise ValueError("calibration needs at least 2 tokens")
    pool = scratch_prefill_layers(engine.model, engine.unquantized_layers(), engine.cfg, token_ids, engine.device,
                                  CALIBRATION_CHUNK_TOKENS)
    k = pool.k.flatten(1, 2)[:, 1 : len(token_ids)]  # [L, T-1, Hkv, D]
    return k.float().mean(dim=1).cpu()
