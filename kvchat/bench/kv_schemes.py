"""Alternative FP8 KV schemes, for measuring them against the engine's default.

The engine's scheme (``kvchat.kernels.SCALE_SCHEME``, "pth1": per-token,
per-KV-head absmax scales) is not touched here. For a fidelity run,
:meth:`SchemeOverride.active` swaps the cache-write dispatch
(``kvchat.kernels.write_kv``, the one call the model makes to store K/V),
and for the exact-sink variant the two attention dispatches, for the
duration of a ``with`` block. A scheme is applied at write time, so every
later read (the chunk's own attention, later chunks, decode) sees the stored
values exactly as it would see the default scheme's. The pool layout is
unchanged: fp8 values plus fp32 per-token, per-head scales.

Schemes:

- ``pth1``: the engine's default (no override).
- ``fixed-1.0``: one scale of 1.0 for everything, values clamped to ±448
  before the cast (vLLM's default when no scales are calibrated; without the
  clamp, values beyond ±448 would become NaN).
- ``pth1+kc``: K centring. A per-layer, per-KV-head mean of post-RoPE K,
  calibrated once on other text (:func:`calibrate_k_mean`), is subtracted
  before the default quantization. Each query's scores then all shift by
  the same ``q · mean``, which softmax ignores (softmax(s - c) = softmax(s)),
  so the mean is never added back. fp8 keeps a fixed relative precision, so
  the rounding error of an element scales with its magnitude; removing K's
  large, steady per-channel offsets (the fixed outlier channels that led
  KIVI, Liu et al. 2024, to quantize K per channel) shrinks it.
- ``pth1+kc+sink``: K centring, and position 0's K/V kept exact (fp32) for
  attention. Position 0 is the attention sink (Xiao et al. 2023, "Efficient
  Streaming Language Models with Attention Sinks"): it takes a large share of
  every query's attention, so its rounding error weighs on every score.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvchat import kernels
from kvchat.kernels import FP8_DTYPE, FP8_MAX, SCALE_SCHEME, reference

FIXED_SCALE_SCHEME = "fixed-1.0"
K_CENTRED_SCHEME = f"{SCALE_SCHEME}+kc"
K_CENTRED_SINK_SCHEME = f"{SCALE_SCHEME}+kc+sink"


@dataclass(slots=True)
class KVScheme:
    """How K/V are quantized on write.

    Attributes:
        name: scheme name as reported.
        fixed_scale: one scale for all values (None: per-token, per-head absmax).
        k_shift: float32 ``[num_layers, num_kv_heads, head_dim]`` subtracted from
            post-RoPE K before quantizing (None: no centring).
        exact_sink: attention reads position 0's K/V unquantized (after the shift).
    """

    name: str
    fixed_scale: float | None = None
    k_shift: torch.Tensor | None = None
    exact_sink: bool = False

    @property
    def is_default(self) -> bool:
        """True for the engine's own scheme (no override needed)."""
        return self.fixed_scale is None and self.k_shift is None and not self.exact_sink


def default_scheme() -> KVScheme:
    """The engine's scheme (``pth1``)."""
    return KVScheme(SCALE_SCHEME)


def fixed_scale_scheme(scale: float = 1.0) -> KVScheme:
    """A single fixed scale (vLLM's default is 1.0)."""
    return KVScheme(FIXED_SCALE_SCHEME if scale == 1.0 else f"fixed-{scale:g}", fixed_scale=scale)


def k_centred_scheme(k_mean: torch.Tensor, exact_sink: bool = False) -> KVScheme:
    """Default quantization of K minus ``k_mean`` ``[num_layers, num_kv_heads, head_dim]``."""
    name = K_CENTRED_SINK_SCHEME if exact_sink else K_CENTRED_SCHEME
    return KVScheme(name, k_shift=k_mean.float(), exact_sink=exact_sink)


@torch.inference_mode()
def calibrate_k_mean(engine, token_ids: Sequence[int]) -> torch.Tensor:
    """Mean post-RoPE K per layer and KV head over positions 1.., read back from ``engine``'s pool.

    Position 0 (the attention sink, an outlier) is left out of the mean.

    Args:
        engine: a :class:`kvchat.engine.Engine` with a 16-bit pool (bf16 or fp16),
            so the mean is not shaped by fp8 rounding.
        token_ids: calibration text, ids (never the evaluation text).
    Returns:
        float32 ``[num_layers, num_kv_heads, head_dim]``.
    Raises:
        ValueError: the engine's pool is fp8, or fewer than 2 tokens.
    """
    from kvchat.block_manager import SeqBlocks

    if engine.spec.kv_dtype == "fp8":
        raise ValueError("calibrate K on a 16-bit pool, not fp8")
    if len(token_ids) < 2:
        raise ValueError("calibration needs at least 2 tokens")
    seq = SeqBlocks()
    engine.prefill(seq, list(token_ids))
    blocks = torch.tensor(seq.block_table, device=engine.pool.k.device)
    k = engine.pool.k[:, blocks].flatten(1, 2)[:, 1 : len(token_ids)]  # [L, T-1, Hkv, D]
    mean = k.float().mean(dim=1)
    engine.release(seq)
    return mean


def _write_fixed_scale(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, scale: float) -> None:
    """``write_kv`` with one fixed scale: ``q = clamp(x / scale, ±448)`` cast to e4m3fn."""
    keep = slot_mapping >= 0
    key, value, slots = key[keep], value[keep], slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for x, cache, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        cache.view(torch.uint8)[blocks, offsets] = q.view(torch.uint8)
        scales[blocks, offsets] = scale


class SchemeOverride:
    """Stand-ins for the three kernel dispatch functions while ``scheme`` runs one sequence on ``pool``.

    Create one per (scheme, sequence) before the sequence's first token and
    enter :meth:`active` around every engine call on that sequence; position
    0's exact K/V (``[num_kv_heads, head_dim]`` fp32 per layer) are captured
    when it is written.
    """

    def __init__(self, pool, scheme: KVScheme, seq):
        if not scheme.is_default and pool.spec.kv_dtype != "fp8":
            raise ValueError(f"scheme {scheme.name} needs an fp8 pool, not {pool.spec.kv_dtype}")
        self.scheme, self.seq = scheme, seq
        self.layer_of = {pool.k[i].data_ptr(): i for i in range(pool.spec.num_layers)}
        self.shift = scheme.k_shift.to(pool.k.device) if scheme.k_shift is not None else None
        self.block_size = pool.spec.block_size
        self.sink: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block the model's K/V writes (and attention, for ``exact_sink``) use the scheme."""
        if self.scheme.is_default:
            yield
            return
        names = ["write_kv"] + (["extend_attention", "decode_attention"] if self.scheme.exact_sink else [])
        originals = {n: getattr(kernels, n) for n in names}
        for n in names:
            setattr(kernels, n, getattr(self, n))
        try:
            yield
        finally:
            for n, fn in originals.items():
                setattr(kernels, n, fn)

    def write_kv(self, key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
        """:func:`kvchat.kernels.write_kv` under the scheme (same arguments)."""
        layer = self.layer_of[k_cache.data_ptr()]
        if self.shift is not None:
            key = key - self.shift[layer].to(key.dtype)
        if self.scheme.exact_sink:
            hit = torch.nonzero(slot_mapping == self.seq.block_table[0] * self.block_size).flatten()
            if hit.numel():
                self.sink[layer] = (key[hit[0]].float().clone(), value[hit[0]].float().clone())
        if self.scheme.fixed_scale is not None:
            _write_fixed_scale(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, self.scheme.fixed_scale)
        else:
            reference.write_kv(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)

    def extend_attention(self, query, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens, cu_seqlens_q, sm_scale):
        """The reference's gather-then-attend (fp32), with position 0 replaced by its exact K/V."""
        layer = self.layer_of[k_cache.data_ptr()]
        out = torch.empty_like(query)
        for i in range(block_table.shape[0]):
            a, b = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            length = int(seq_lens[i])
            k = reference.gather_kv(k_cache, k_scale, block_table[i], length)
            v = reference.gather_kv(v_cache, v_scale, block_table[i], length)
            k[0], v[0] = self.sink[layer]
            q_start, t = length - (b - a), b - a
            mask = torch.ones(t, length, dtype=torch.bool, device=query.device).tril(diagonal=q_start)
            o = F.scaled_dot_product_attention(
                query[a:b].float().transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                attn_mask=mask, scale=sm_scale, enable_gqa=True,
            )
            out[a:b] = o[0].transpose(0, 1).to(query.dtype)
        return out

    def decode_attention(self, query, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens, sm_scale):
        """One query per sequence: :meth:`extend_attention` with one-token chunks."""
        cu = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
        return self.extend_attention(query, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens, cu, sm_scale)
