"""How big the KV pool is when nobody says (``KVCHAT_KV_BUDGET_MB`` unset), and the one line that says why.

On CUDA the pool is sized for what will be used: ``resident chats`` (``KVCHAT_RESIDENT_CHATS``)
of the model's full context, ``chats x max_position_embeddings x bytes_per_token``,
capped by the memory it may take (:func:`gpu_pool_cap`), read once the weights are
loaded and one prefill chunk's activation peak is set aside. The peak is measured
(:func:`activation_peak_bytes`: a forward of one chunk over a scratch pool,
``torch.cuda.max_memory_allocated`` around it), not guessed. The cap: with
``--gpu-memory F`` (``KVCHAT_GPU_MEMORY``, as vLLM's ``gpu_memory_utilization``) this process
holds at most ``F`` of the GPU's total memory; without it the pool takes
:data:`DEFAULT_FREE_SHARE` of what is still free, so a desktop, a browser or a second
kvchat process keep room (taking 90 % of it would leave a second process an
OOM at load or a one-block pool on which every prompt overflowed). A cap under
:data:`MIN_POOL_TOKENS` tokens is one :class:`GPUMemoryError` line with the numbers and
the flag, as is running out of memory while loading (:func:`load_oom_line`).

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
DEFAULT_FREE_SHARE = 0.5  # without --gpu-memory: the pool's share of the memory free after weights and activations
MIN_POOL_TOKENS = 2048  # a pool below this (or the model's context, if shorter) is refused: chats would overflow
GIB = 2**30


class GPUMemoryError(ValueError):
    """The GPU has too little memory for the model or its KV pool; the message is one line with the numbers
    and what to change (``--gpu-memory``)."""


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
    fraction = settings.gpu_memory()
    act = int(activation_bytes()) if activation_bytes is not None else 0
    free, total = torch.cuda.mem_get_info(device)  # after the peak's measurement, which returned its memory
    return gpu_plan(spec, max_position, chats, free, act, total, torch.cuda.memory_reserved(device), fraction)


def gpu_pool_cap(free_bytes: int, activation_bytes: int, total_bytes: int, held_bytes: int,
                 fraction: float | None) -> int:
    """The most bytes the KV pool may take on a GPU (0 at least).

    Args:
        free_bytes, total_bytes: the device's free and total memory now (``torch.cuda.mem_get_info``).
        activation_bytes: one prefill chunk's activation peak, kept free for it.
        held_bytes: what this process holds already (its allocator's reserved memory: the weights).
        fraction: ``--gpu-memory`` (None: the default).
    Returns:
        With ``fraction``: ``min(fraction x total - held - activations, free - activations)`` (what this
        process may still take, and no more than is free); without: :data:`DEFAULT_FREE_SHARE` x
        ``(free - activations)``.
    """
    left = max(free_bytes - activation_bytes, 0)
    if fraction is None:
        return int(left * DEFAULT_FREE_SHARE)
    return max(min(int(fraction * total_bytes) - held_bytes - activation_bytes, left), 0)


def gpu_plan(spec: KVCacheSpec, max_position: int, chats: int, free_bytes: int, activation_bytes: int,
             total_bytes: int, held_bytes: int, fraction: float | None) -> PoolPlan:
    """The CUDA rule of :func:`plan_pool` on given numbers (bytes; see :func:`gpu_pool_cap` for them):
    ``min(chats x max_position x bytes_per_token, cap)``.

    Raises:
        GPUMemoryError: the cap holds fewer than ``min(MIN_POOL_TOKENS, max_position)`` tokens.
    """
    free, act, total, held = free_bytes, activation_bytes, total_bytes, held_bytes
    want = chats * max_position * spec.bytes_per_token
    cap = gpu_pool_cap(free, act, total, held, fraction)
    need_tokens = min(MIN_POOL_TOKENS, max_position)
    need = -(-need_tokens // spec.block_size) * spec.bytes_per_block
    if fraction is None:
        rule = f"{DEFAULT_FREE_SHARE:.0%} of the {max(free - act, 0) / GIB:.1f} GiB free after weights and activations"
        change = f"pass --gpu-memory FRACTION (this process's share of the GPU's {total / GIB:.1f} GiB)"
    else:
        rule = (f"--gpu-memory {fraction:g} x {total / GIB:.1f} GiB less {held / GIB:.1f} GiB held and "
                f"{act / GIB:.1f} GiB of activations, at most the {max(free - act, 0) / GIB:.1f} GiB free")
        change = "raise --gpu-memory"
    if cap < need:
        raise GPUMemoryError(f"the KV pool would get {cap / GIB:.2f} GiB ({rule}), under the {need / GIB:.2f} GiB of "
                             f"{need_tokens:,} tokens; {change}, or free GPU memory")
    n = min(want, cap)
    why = (f"{chats} chats x {max_position:,} tokens (KVCHAT_RESIDENT_CHATS)" if want <= cap else
           f"capped at {rule}; {chats} chats x {max_position:,} tokens would need {want / GIB:.1f} GiB")
    return PoolPlan(n, f"KV pool {n / GIB:.2f} GiB ({n // spec.bytes_per_token:,} tokens): {why}")


def load_oom_line(name: str, weight_bytes: int, free_bytes: int, total_bytes: int, fraction: float | None) -> str:
    """The one line for running out of GPU memory while loading model ``name``: its weights' bytes, the
    memory free before loading and in all (bytes), and what to change (``fraction``: ``--gpu-memory``)."""
    line = (f"out of GPU memory loading {name}: its weights take {weight_bytes / GIB:.1f} GiB; "
            f"{free_bytes / GIB:.1f} GiB of the GPU's {total_bytes / GIB:.1f} GiB were free before loading")
    if weight_bytes >= free_bytes:
        return line + " (other processes hold the rest); free GPU memory or use a smaller model"
    change = "pass --gpu-memory FRACTION" if fraction is None else f"lower --gpu-memory (now {fraction:g})"
    return line + f"; the KV pool, activations and kernels took the rest: {change} or free GPU memory"


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
    from kvchat.engine.inference import inference

    with inference():  # at the engine's load, before any loop
        model.logits(torch.zeros(1, cfg.hidden_size, device=device, dtype=model.embed_tokens.dtype))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del pool
    torch.cuda.empty_cache()
    return int(peak)
