"""The matmul ceiling: how fast prefill and decode could be if nothing but the weight matmuls ran.

Every runner of the model in torch (kvchat's and transformers') performs the
same linear layers with the same library GEMM/GEMV, so their time alone
bounds what any torch implementation can reach on this machine at this
weight format and thread count. A target above the ceiling cannot be met by
removing overhead; it needs smaller weights or other matmul kernels. The
layers are called as the model calls them (``Linear`` or, for int8
weights, :data:`kvchat.model.quant.QUANTIZED_LAYERS` with their kernel choice by
row count), so there is one ceiling per weight format.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from kvchat.engine.inference import inference
from kvchat.model.quant import QUANTIZED_LAYERS
from kvchat.model.transformer import Linear, Transformer


def _layers(model: Transformer) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (Linear, *QUANTIZED_LAYERS)) and m is not model.lm_head]


def _shape(m: nn.Module) -> tuple[int, int]:
    """``(out, in)`` features of a linear layer."""
    return (m.out_features, m.in_features) if isinstance(m, QUANTIZED_LAYERS) else tuple(m.weight.shape)


def _weight_bytes(m: nn.Module) -> int:
    return m.weight_bytes if isinstance(m, QUANTIZED_LAYERS) else m.weight.numel() * m.weight.element_size()


def _pass_s(layers: list[nn.Module], head: nn.Module, rows: int, dtype: torch.dtype) -> float:
    """Seconds for one pass: every layer at ``rows`` input rows, the LM head at one row."""
    xs = [torch.randn(rows, _shape(m)[1], dtype=dtype) for m in layers]
    x_head = torch.randn(1, _shape(head)[1], dtype=dtype)
    t0 = time.perf_counter()
    for x, m in zip(xs, layers):
        m(x)
    head(x_head)
    return time.perf_counter() - t0


@inference()
def matmul_ceiling(model: Transformer, chunk_tokens: int = 512, repeats: int = 3) -> dict:
    """Median time of the model's matmuls alone, as tokens/s ceilings.

    Args:
        model: the engine's model (its weight format, dtype and device as used).
        chunk_tokens: rows per prefill matmul (the engine's prefill chunk).
        repeats: passes per phase after one warm-up; the median is kept.
    Returns:
        ``decode_ms`` (one token: every weight at 1 row + LM head),
        ``decode_ceiling_tok_s``, ``weight_gb_s`` (weight bytes read per
        second in that pass), ``prefill_ms`` (one chunk of ``chunk_tokens``),
        ``prefill_ceiling_tok_s`` and ``gemm_gflop_s``.
    """
    layers, head = _layers(model), model.lm_head
    dtype = model.embed_tokens.dtype
    nbytes = sum(_weight_bytes(m) for m in [*layers, head])
    def numel(m):
        return _shape(m)[0] * _shape(m)[1]

    flops = 2 * chunk_tokens * sum(numel(m) for m in layers) + 2 * numel(head)
    out = {}
    for phase, rows in (("decode", 1), ("prefill", chunk_tokens)):
        _pass_s(layers, head, rows, dtype)
        out[phase] = statistics.median(_pass_s(layers, head, rows, dtype) for _ in range(repeats))
    return {
        "decode_ms": round(out["decode"] * 1e3, 2),
        "decode_ceiling_tok_s": round(1 / out["decode"], 1),
        "weight_gb_s": round(nbytes / out["decode"] / 1e9, 2),
        "prefill_ms": round(out["prefill"] * 1e3, 1),
        "prefill_ceiling_tok_s": round(chunk_tokens / out["prefill"], 1),
        "gemm_gflop_s": round(flops / out["prefill"] / 1e9, 1),
    }
