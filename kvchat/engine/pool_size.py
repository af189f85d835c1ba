"""How big the KV pool is when nobody says (``KVCHAT_KV_BUDGET_MB`` unset), and the one line that says why.

On CUDA the pool is sized for what will be used: ``resident chats`` (``KVCHAT_RESIDENT_CHATS``)
of the model's full context, ``chats x max_position_embeddings x bytes_per_token``,
capped at :data:`GPU_MEMORY_FRACTION` of the device memory left once the
weights are loaded and one prefill chunk's activation peak is set aside. The
peak is measured (:func:`activation_peak_bytes`: a forward of one chunk over a
scratch pool, ``torch.cuda.max_memory_allocated`` around it), not guessed. A
fixed half of free memory (the old rule) gave a 135M model ~70 GB and ~357K
Python ``Block`` objects on an H200.

On CPU the pool stays :data:`DEFAULT_CPU_POOL_BYTES`: its zeroed pages cost
nothing until a token is written there (the OS maps them on first touch), so
a generous fixed size keeps every existing chat fitting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvchat import settings
from kvchat.engine.kv_pool import KVCacheSpec

DEFAULT_CPU_POOL_BYTES = 512 * 2**20
GPU_MEMORY_FRACTION = 0.9  # of the memory left after weights and activations; the rest: allocator slack, other work


@dataclass(slots=True, frozen=True)
class PoolPlan:
    """The pool's size in bytes and why (``text``: one line, e.g. for a status bar or ``--json``)."""

    bytes: int
    text: str


def plan_pool(spec: KVCacheSpec, max_position: int, device: torch.device, activation_bytes=None) -> PoolPlan:
    """The default pool of an engine (see module doc).

    Args:
        spec: the pool's layout (``bytes_per_token`` per token, K + V + scales).
        max_position: the model's context length, tokens.
        device: where the pool goes; on CUDA call this after the weights are loaded (free memory is read now).
        activation_bytes: a callable returning the measured activation peak in bytes (CUDA only; None: 0).
    Raises:
        kvchat.settings.SettingError: a bad ``KVCHAT_KV_BUDGET_MB`` or ``KVCHAT_RESIDENT_CHATS``.
    """
    mib = settings.kv_budget_mb()
    if mib is not None:
        n = int(mib * 2**20)
        return PoolPlan(n, f"KV pool {n / 2**20:,.0f} MiB (KVCHAT_KV_BUDGET_MB)")
    if device.type != "cuda":
        n = DEFAULT_CPU_POOL_BYTES
        return PoolPlan(n, f"KV pool {n / 2**20:,.0f} MiB ({n // spec.bytes_per_token:,} tokens; CPU default)")
    chats = settings.resident_chats()
    free, _ = torch.cuda.mem_get_info(device)
    act = int(activation_bytes()) if activation_bytes is not None else 0
    return gpu_plan(spec, max_position, chats, free, act)


def gpu_plan(spec: KVCacheSpec, max_position: int, chats: int, free_bytes: int, activation_bytes: int) -> PoolPlan:
    """The CUDA rule of :func:`plan_pool` on given numbers: ``min(chats x max_position x bytes_per_token,
    GPU_MEMORY_FRACTION x (free_bytes - activation_bytes))``, at least one block."""
    free, act = free_bytes, activation_bytes
    want = chats * max_position * spec.bytes_per_token
    cap = int(max(free - act, 0) * GPU_MEMORY_FRACTION)
    n = max(min(want, cap), spec.bytes_per_block)
    why = (f"{chats} chats x {max_position:,} tokens (KVCHAT_RESIDENT_CHATS)" if want <= cap else
           f"capped at {GPU_MEMORY_FRACTION:.0%} of {(free - act) / 2**30:.1f} GiB left after weights and "
           f"{act / 2**20:,.0f} MiB of activations; {chats} chats x {max_position:,} tokens would need {want / 2**30:.1f} GiB")
    return PoolPlan(n, f"KV pool {n / 2**30:.2f} GiB ({n // spec.bytes_per_token:,} tokens): {why}")


def activation_peak_bytes(model, cfg, device: torch.device, chunk_tokens: int) -> int:
    """Peak extra device memory of one ``chunk_tokens`` prefill forward (bytes), measured on CUDA.

    Runs the chunk (token id 0 repeated) over a scratch 16-bit pool
    (:func:`kvchat.engine.scratch.scratch_prefill`); the result counts the
    activations, the scratch pool and the last token's logits' worth of
    workspace, so it errs high. 0 on CPU (nothing to measure against).
    """
    if device.type != "cuda":
        return 0
    from kvchat.engine.scratch import scratch_prefill

    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    pool = scratch_prefill(model, cfg, [0] * chunk_tokens, device, chunk_tokens)
    with torch.inference_mode():
        model.logits(torch.zeros(1, cfg.hidden_size, device=device, dtype=model.embed_tokens.dtype))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del pool
    torch.cuda.empty_cache()
    return int(peak)
