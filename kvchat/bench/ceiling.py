"""The matmul ceiling: how fast prefill and decode could be if nothing but the weight matmuls ran.

Every runner of the model in torch (kvchat's and transformers') performs the
same linear layers with the same library GEMM/GEMV, so their time alone
bounds what any torch implementation can reach on this machine at this
weight dtype and thread count. A target above the ceiling cannot be met by
removing overhead; it needs smaller weights or other matmul kernels.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from kvchat.model.transformer import Linear, Transformer


def _weights(model: Transformer) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]


def _pass_s(weights: list[torch.Tensor], head: torch.Tensor, rows: int) -> float:
    """Seconds for one pass: every layer weight at ``rows`` input rows, the LM head at one row."""
    xs = [torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights]
    x_head = torch.randn(1, head.shape[1], dtype=head.dtype)
    t0 = time.perf_counter()
    for x, w in zip(xs, weights):
        F.linear(x, w)
    F.linear(x_head, head)
    return time.perf_counter() - t0


@torch.inference_mode()
def matmul_ceiling(model: Transformer, chunk_tokens: int = 512, repeats: int = 3) -> dict:
    """Median time of the model's matmuls alone, as tokens/s ceilings.

    Args:
        model: the engine's model (its weights, dtype and device as used).
        chunk_tokens: rows per prefill matmul (the engine's prefill chunk).
        repeats: passes per phase after one warm-up; the median is kept.
    Returns:
        ``decode_ms`` (one token: every weight at 1 row + LM head),
        ``decode_ceiling_tok_s``, ``weight_gb_s`` (weight bytes read per
        second in that pass), ``prefill_ms`` (one chunk of ``chunk_tokens``),
        ``prefill_ceiling_tok_s`` and ``gemm_gflop_s``.
    """
    weights, head = _weights(model), model.lm_head.weight
    nbytes = sum(w.numel() * w.element_size() for w in [*weights, head])
    flops = 2 * chunk_tokens * sum(w.numel() for w in weights) + 2 * head.numel()
    out = {}
    for phase, rows in (("decode", 1), ("prefill", chunk_tokens)):
        _pass_s(weights, head, rows)
        out[phase] = statistics.median(_pass_s(weights, head, rows) for _ in range(repeats))
    return {
        "decode_ms": round(out["decode"] * 1e3, 2),
        "decode_ceiling_tok_s": round(1 / out["decode"], 1),
        "weight_gb_s": round(nbytes / out["decode"] / 1e9, 2),
        "prefill_ms": round(out["prefill"] * 1e3, 1),
        "prefill_ceiling_tok_s": round(chunk_tokens / out["prefill"], 1),
        "gemm_gflop_s": round(flops / out["prefill"] / 1e9, 1),
    }
