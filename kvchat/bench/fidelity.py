"""``kvchat bench fidelity``: what FP8 KV schemes cost in quality, teacher-forced, against the bf16 pool.

Why teacher-forced: greedy continuations of a 135M model drift apart after a
few tokens under any quantization, so comparing generated text measures
chaos, not quality. Instead a real text runs through the engine twice, with
a bf16 pool (the reference) and with an fp8 pool, every chunk attending
through its pool (:meth:`kvchat.engine.runner.Engine.score`), and the next-token
distributions are compared position by position:

- perplexity on the text for both, and its change in percent;
- mean KL(reference ‖ fp8) over positions, in nats;
- top-1 agreement: share of positions whose argmax token is the same.

Schemes (see :mod:`kvchat.bench.kv_schemes`), each run by its own fp8
engine: the engine's default (per-token scales, K centring with the model's
stored calibration, computed on standard-library text disjoint from the
evaluation text, and the attention sink read exact), per-token scales alone,
a fixed scale of 1.0 (vLLM's default), and K centring without the exact sink.
The kvchat goal is a perplexity within +0.5% of bf16. The same protocol
then compares int8 and int4 weights with fp32 weights, per pool and kernel
(:mod:`kvchat.bench.weight_fidelity`; key ``"weights"``, goal also +0.5%; the int4 target is +1%).
Perplexity deltas over
~2k tokens move by several tenths of a percent under any small perturbation;
mean KL is the steadier figure, and pooling several texts steadies both.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch

from kvchat.bench.kv_schemes import all_schemes
from kvchat.bench.retrieval import DEFAULT_DEPTHS, DEFAULT_DOC_TOKENS, format_retrieval, run_retrieval
from kvchat.bench.run_info import print_report, run_info
from kvchat.bench.stats import format_table
from kvchat.bench.teacher_forced import SCORE_CHUNK_TOKENS, FidelityResult, compare_to_reference
from kvchat.bench.weight_fidelity import compare_weights
from kvchat.texts import EVAL_MODULES, BenchText, stdlib_text

GOAL_PPL_DELTA_PCT = 0.5
DEFAULT_TOKENS = 2048


def read_text(path: str) -> BenchText:
    """A UTF-8 text file as a :class:`BenchText` named by its file name.

    Raises:
        OSError: unreadable; ValueError: not UTF-8.
    """
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    return BenchText(Path(path).name, text, hashlib.sha256(data).hexdigest())


def joined_text(texts: Sequence[BenchText]) -> BenchText:
    """``texts`` as one text (blank line between them), named ``a+b+...``, sha256 of the joined UTF-8 bytes."""
    if len(texts) == 1:
        return texts[0]
    text = "\n\n".join(t.text for t in texts)
    return BenchText("+".join(t.name for t in texts), text, hashlib.sha256(text.encode()).hexdigest())


def run_fidelity(args: argparse.Namespace, *, quick: bool = False) -> dict:
    """Everything ``cmd_bench_fidelity`` reports, JSON-ready.

    With ``args.retrieval_tokens`` > 0 it also runs the long-context retrieval
    probe (:mod:`kvchat.bench.retrieval`) at ``args.depths`` in a document of
    that many tokens of the evaluation texts, bf16 vs fp8 pools (key ``"retrieval"``).

    Raises:
        ValueError: bad ``--tokens``, an unreadable or non-UTF-8 ``--text``.
    """
    from transformers import AutoTokenizer

    from kvchat.engine.kv_pool import KVCacheSpec
    from kvchat.engine.runner import Engine
    from kvchat.model.registry import load_weights, resolve_model
    from kvchat.runtime import ensure_calibration, set_threads

    if args.tokens < 2:
        raise ValueError("--tokens must be at least 2")
    texts = [read_text(p) for p in args.text] or [stdlib_text(EVAL_MODULES)]
    set_threads(args.threads)
    info = resolve_model(args.model)
    cfg = info.config
    tok = AutoTokenizer.from_pretrained(str(info.path))
    docs = [(t, tok(t.text, add_special_tokens=False)["input_ids"][: args.tokens]) for t in texts]

    weights = load_weights(info)
    calibration = ensure_calibration(info, weights, tok)
    def spec(kv):
        return KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv)

    blocks = max(len(ids) for _, ids in docs) // spec("bf16").block_size + 3  # + the sink's one-token forward
    ref = Engine(cfg, weights, info.fingerprint, kv_dtype="bf16", pool_bytes=spec("bf16").bytes_per_block * blocks)
    schemes = all_schemes()
    runs = [(s, s.engine(cfg, weights, info.fingerprint, calibration, pool_bytes=spec("fp8").bytes_per_block * blocks))
            for s in schemes]
    for scheme, engine in runs:
        if scheme.fixed_scale is None and engine.scale_scheme != scheme.name:
            raise RuntimeError(f"scheme {scheme.name} ran as {engine.scale_scheme}")  # a mislabelled row

    per_text = []
    for text, ids in docs:
        per_text += compare_to_reference(ref, runs, ids, text.name)
    compute = str(ref.dtype).removeprefix("torch.")
    del ref, runs
    weight_rows = [r.as_dict() for r in compare_weights(info, weights, calibration, [(t.name, ids) for t, ids in docs])]
    del weights
    retrieval_tokens = getattr(args, "retrieval_tokens", DEFAULT_DOC_TOKENS)
    retrieval = None
    if retrieval_tokens > 0:
        depths = getattr(args, "depths", None) or DEFAULT_DEPTHS
        retrieval = run_retrieval(info, tok, joined_text(texts), retrieval_tokens, depths)
    pooled = [FidelityResult("all texts", s.name) for s in schemes]
    for i, res in enumerate(per_text):
        pooled[i % len(schemes)].add(res)
    return {
        "benchmark": "fidelity",
        "run": run_info(quick=quick),
        "model": info.name,
        "model_fingerprint": info.fingerprint,
        "compute_dtype": compute,
        "threads": torch.get_num_threads(),
        "reference_pool": "bf16",
        "chunk_tokens": SCORE_CHUNK_TOKENS,
        "texts": [{"name": t.name, "sha256": t.sha256, "tokens": len(ids)} for t, ids in docs],
        "calibration": {"source": calibration.source, "digest": calibration.digest,
                        "k_mean_abs_max": round(calibration.k_mean.abs().max().item(), 3)},
        "default_scheme": schemes[0].name,
        "goal_ppl_delta_pct": GOAL_PPL_DELTA_PCT,
        "results": [r.as_dict() for r in per_text + (pooled if len(docs) > 1 else [])],
        "retrieval": retrieval,
        "weights": weight_rows,
    }


def format_report(res: dict) -> str:
    """Human-readable table of a :func:`run_fidelity` result."""
    head = (f"kvchat bench fidelity: {res['model']}, {res['compute_dtype']} compute, teacher-forced against the "
            f"{res['reference_pool']} pool, {res['chunk_tokens']}-token chunks; default scheme "
            f"{res['default_scheme']}; K centring calibrated on {res['calibration']['source']}")
    rows = [("text", "scheme", "positions", "ppl bf16", "ppl", "Δppl %", "mean KL", "top-1")]
    for r in res["results"]:
        rows.append((r["text"], r["scheme"], str(r["positions"]), f"{r['ppl_bf16']:.3f}", f"{r['ppl']:.3f}",
                     f"{r['ppl_delta_pct']:+.2f}", f"{r['mean_kl']:.4f}", f"{r['top1_agreement']:.3f}"))
    out = f"{head}\n\n{format_table(rows)}\n\ngoal: Δppl ≤ +{res['goal_ppl_delta_pct']}% vs bf16"
    if res.get("weights"):
        w = [("vs fp32 weights: text", "weights", "pool", "kernel", "ppl fp32 w", "ppl", "Δppl %", "mean KL", "top-1")]
        w += [(r["text"], r["weights"], r["pool"], f"{r['kernel']} ({r['chunk_tokens']}-token chunks)", f"{r['ppl_fp32_weights']:.3f}",
               f"{r['ppl']:.3f}", f"{r['ppl_delta_pct']:+.2f}", f"{r['mean_kl']:.4f}", f"{r['top1_agreement']:.3f}")
              for r in res["weights"]]
        out += f"\n\n{format_table(w)}\n\ngoal: Δppl ≤ +{res['goal_ppl_delta_pct']}% vs fp32 weights"
    if res.get("retrieval"):
        out += "\n\n" + format_retrieval(res["retrieval"])
    return out


def cmd_bench_fidelity(args: argparse.Namespace) -> int:
    """``kvchat bench fidelity``: print the table; write JSON to ``args.json`` if set. Returns 0.

    Raises:
        ValueError, OSError: see :func:`run_fidelity`.
    """
    res = run_fidelity(args)
    return print_report(res, format_report(res), args.json)
