"""The FP8 KV schemes ``kvchat bench fidelity`` compares: the engine's default and its alternatives.

Each scheme is an engine configuration (:meth:`KVScheme.engine`), so the
benchmark measures exactly the code the app runs. The pool layout is the same
for all: fp8 values plus fp32 per-token, per-head scales.

- ``pth1+kc+sink``: the engine's default for fp8 pools. Per-token, per-KV-head
  absmax scales; K centred by the model's calibrated mean
  (:mod:`kvchat.engine.calibration`); position 0, the attention sink, read exact
  (:meth:`kvchat.engine.runner.Engine.sink_kv`).
- ``pth1+kc``: the same without the exact sink.
- ``pth1``: per-token, per-KV-head scales only.
- ``fixed-1.0``: one scale of 1.0 for everything, values clamped to ±448
  before the cast (vLLM's default when no scales are calibrated; without the
  clamp, values beyond ±448 would become NaN). The only scheme the engine
  cannot run by itself: :meth:`KVScheme.active` swaps the cache-write dispatch
  (``kvchat.kernels.dispatch.write_kv``, the one call the model makes to store K/V) for
  the duration of a ``with`` block, so every later read sees the stored values
  exactly as it would see the default scheme's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvchat.kernels import dispatch
from kvchat.kernels.layout import KVLayer
from kvchat.kernels.reference import FP8_DTYPE, FP8_MAX, SCALE_SCHEME

FIXED_SCALE_SCHEME = "fixed-1.0"


@dataclass(slots=True, frozen=True)
class KVScheme:
    """How an fp8 engine quantizes and reads K/V.

    Attributes:
        name: as reported (the engine's ``scale_scheme`` for the engine-run schemes).
        k_centring: subtract the model's calibrated K mean before quantizing.
        exact_sink: attention reads position 0's K/V unquantized.
        fixed_scale: one scale for all values (None: per-token, per-head absmax).
    """

    name: str
    k_centring: bool = False
    exact_sink: bool = False
    fixed_scale: float | None = None

    def engine(self, cfg, weights, model_fingerprint: str, calibration, **kwargs):
        """An fp8 :class:`kvchat.engine.runner.Engine` running this scheme (``kwargs`` go to the engine)."""
        from kvchat.engine.runner import Engine

        return Engine(cfg, weights, model_fingerprint, kv_dtype="fp8", exact_sink=self.exact_sink,
                      calibration=calibration if self.k_centring else None, **kwargs)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block the model's K/V writes use ``fixed_scale`` (a no-op for the other schemes)."""
        if self.fixed_scale is None:
            yield
            return
        original = dispatch.write_kv
        scale = self.fixed_scale
        # the backend the model passes (every backend writes the same rows) does not apply to this scheme
        dispatch.write_kv = lambda *args, backend=None: write_fixed_scale(*args[:4], scale=scale)
        try:
            yield
        finally:
            dispatch.write_kv = original


def all_schemes() -> list[KVScheme]:
    """The default first, then ``pth1``, ``fixed-1.0`` and ``pth1+kc``."""
    return [
        KVScheme(f"{SCALE_SCHEME}+kc+sink", k_centring=True, exact_sink=True),
        KVScheme(SCALE_SCHEME),
        KVScheme(FIXED_SCALE_SCHEME, fixed_scale=1.0),
        KVScheme(f"{SCALE_SCHEME}+kc", k_centring=True),
    ]


def write_fixed_scale(key, value, kv: KVLayer, slot_mapping, *, scale: float) -> None:
    """``write_kv`` with one fixed scale: ``q = clamp(x / scale, ±448)`` cast to e4m3fn (same arguments)."""
    keep = slot_mapping >= 0
    key, value, slots = key[keep], value[keep], slot_mapping[keep]
    block_size = kv.k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for x, cache, scales in ((key, kv.k_cache, kv.k_scale), (value, kv.v_cache, kv.v_scale)):
        q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        cache.view(torch.uint8)[blocks, offsets] = q.view(torch.uint8)
        scales[blocks, offsets] = scale
