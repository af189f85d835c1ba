"""What int8 and int4 weights cost in quality: teacher-forced against fp32 weights, the protocol of
``kvchat bench fidelity``.

For each KV pool dtype (fp8 with the engine's default scheme, and bf16) an
fp32-weights engine is the reference and an int8-weights and an int4-weights engine
(:mod:`kvchat.model.quant`; int4 where its compiled kernel builds) are compared with it position by position
(:func:`kvchat.bench.fidelity.compare_to_reference`: perplexity change, mean
KL, top-1 agreement). Both kernels of this process's int8 scheme are
measured, by the chunk size the text is scored in (:func:`kernel_chunks`):
chunks of ``GROUPS_KERNEL_MAX_ROWS`` rows run the compiled fp32 kernel where
it builds, else chunks of ``INT8MM_MAX_ROWS`` rows
``torch._weight_int8pack_mm`` with bf16 activations (the path of decode and
of a question after a resume), 512-token chunks the dequantized fp32 GEMM
(the path of prefill). int4 runs on int8 activations at three chunk sizes: under
:data:`kvchat.model.int4_scheme.INT4_LANE_MIN_TOKENS` tokens its group kernel (that of decode), at
``GROUPS_KERNEL_MAX_ROWS`` the channel-lanes kernel in the compiled decoder layers (a question after a resume), at
512 the channel-lanes kernel (:class:`kvchat.model.quant.Int4GroupLinear`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvchat.bench.teacher_forced import SCORE_CHUNK_TOKENS, FidelityResult, compare_to_reference
from kvchat.model.int4_scheme import INT4_LANE_MIN_TOKENS
from kvchat.model.int8_scheme import GROUPS_KERNEL_MAX_ROWS, INT8MM_MAX_ROWS

POOLS = ("fp8", "bf16")


COMPILED_LABEL = "compiled, groups of 32 (fp32 activations)"


def kernel_chunks(weight_format: str = "int8") -> dict[str, int]:
    """``{kernel label: chunk tokens that run it}`` for this process's ``weight_format`` scheme (``int8`` or
    ``int4``, :mod:`kvchat.model.quant`)."""
    from kvchat.kernels import cpu_int8

    if weight_format == "int4":  # the group kernel of decode rows runs chunks under INT4_LANE_MIN_TOKENS tokens
        return {"group kernel (decode rows)": INT4_LANE_MIN_TOKENS - 1,
                "channel-lanes kernel, compiled layers": GROUPS_KERNEL_MAX_ROWS,
                "channel-lanes kernel": SCORE_CHUNK_TOKENS}
    if cpu_int8.available():
        few = {COMPILED_LABEL: GROUPS_KERNEL_MAX_ROWS}
    else:
        few = {"int8mm, per channel (bf16 activations)": INT8MM_MAX_ROWS}
    return {**few, "dequantized fp32 GEMM": SCORE_CHUNK_TOKENS}


def weight_formats() -> tuple[str, ...]:
    """The quantized formats this process measures: int8, and int4 where its compiled kernel builds."""
    from kvchat.kernels import cpu_int4

    return ("int8", "int4") if cpu_int4.available() else ("int8",)


@dataclass(slots=True)
class WeightRun:
    """A row label for :func:`compare_to_reference` (which only needs ``name`` and ``active()``)."""

    name: str

    def active(self):
        """Nothing to switch on: the engine itself carries the weight format."""
        return contextlib.nullcontext()


@dataclass(slots=True)
class WeightFidelity:
    """Quantized (``weights``: int8 or int4) vs fp32 weights on one text (or pooled texts) with one pool and
    one kernel."""

    weights: str
    pool: str
    kernel: str
    chunk_tokens: int
    result: FidelityResult  # its ``ppl_ref`` is the fp32-weights perplexity

    def as_dict(self) -> dict:
        """JSON-ready figures (``ppl_bf16`` of the shared protocol renamed ``ppl_fp32_weights``)."""
        d = self.result.as_dict()
        d["ppl_fp32_weights"] = d.pop("ppl_bf16")
        return {"weights": self.weights, "pool": self.pool, "kernel": self.kernel, "chunk_tokens": self.chunk_tokens, **d}


def compare_weights(info, weights, calibration, docs: Sequence[tuple[str, list[int]]],
                    pools: Sequence[str] = POOLS, formats: Sequence[str] | None = None) -> list[WeightFidelity]:
    """Quantized vs fp32 weights on every text of ``docs``, for each pool, quantized format and its kernels.

    Args:
        info: the model (:class:`kvchat.model.registry.ModelInfo`).
        weights: its Hugging Face-named tensors (:func:`kvchat.model.registry.load_weights`).
        calibration: its fp8 K-centring calibration (used by the fp8 pools of both engines).
        docs: ``(text name, token ids)`` pairs, at least 2 ids each.
        pools: KV pool dtypes to run.
        formats: ``int8`` / ``int4`` (None: :func:`weight_formats`); each runs its :func:`kernel_chunks`.
    Returns:
        one :class:`WeightFidelity` per (pool, format, kernel, text), then, with several texts, one per
        (pool, format, kernel) pooled over them.
    """
    from kvchat.engine.kv_pool import KVCacheSpec
    from kvchat.engine.runner import Engine

    cfg = info.config
    formats = tuple(formats or weight_formats())
    blocks = max(len(ids) for _, ids in docs) // 16 + 3  # + the sink's one-token forward
    out, pooled = [], []
    for kv in pools:
        nbytes = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv).bytes_per_block * blocks
        ref = Engine(cfg, weights, info.fingerprint, kv_dtype=kv, pool_bytes=nbytes, device="cpu",
                     calibration=calibration, weight_format="fp32")
        for fmt in formats:
            engine = Engine(cfg, weights, info.fingerprint, kv_dtype=kv, pool_bytes=nbytes, device="cpu",
                            calibration=calibration, weight_format=fmt)
            for label, chunk in kernel_chunks(fmt).items():
                total = FidelityResult("all texts", fmt)
                for name, ids in docs:
                    (res,) = compare_to_reference(ref, [(WeightRun(fmt), engine)], ids, name, chunk)
                    out.append(WeightFidelity(fmt, kv, label, chunk, res))
                    total.add(res)
                if len(docs) > 1:
                    pooled.append(WeightFidelity(fmt, kv, label, chunk, total))
            del engine
        del ref
    return out + pooled
