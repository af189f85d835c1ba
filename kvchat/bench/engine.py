"""``kvchat bench engine``: prefill and decode tokens/s against transformers, and model load time.

One process, one model, one thread count, one prompt for every backend:

- kvchat's engine with each weight format (fp32 — backends ``kvchat-POOL`` —
  and int8, ``kvchat-POOL-int8``, plus ``--weights bf16`` when asked for:
  ``kvchat-POOL-bf16``) and each KV pool dtype measured (fp8 and bf16, plus
  ``--kv-dtype`` if it is another one): :meth:`Engine.prefill_steps` of the first
  ``L`` prompt tokens (in its usual 512-token chunks), then greedy
  :meth:`Engine.decode` of ``--decode-tokens`` tokens; the matmul ceiling
  once per weight format;
- transformers' own forward loop on the same imported weights, cast to the
  fp32 engine's compute dtype, with a ``DynamicCache``: one forward over the ``L``
  tokens computing only the last position's logits (``logits_to_keep=1``, as
  ``generate()`` does), then one forward per greedy token. No ``generate()``,
  so neither side pays for sampling machinery the other skips;
- the same loop with transformers' ``QuantizedCache(backend="fp8")`` when the
  installed transformers has it (``transformers-fp8-cache``): fp8 K/V with one
  per-tensor scale, dequantized in full at every step.

Repeats are interleaved (every backend once per repeat, in turn), so slow
phases of a shared machine hit all backends; ratios are taken per repeat and
reported as median (min-max). llama.cpp figures are external reference
figures measured earlier on the development machine, not in this run.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvchat.bench.ceiling import matmul_ceiling
from kvchat.bench.run_info import print_report, run_info
from kvchat.bench.stats import Spread, format_table, ratios
from kvchat.engine.inference import inference
from kvchat.texts import BenchText, stdlib_text

LLAMA_CPP_REFERENCE = {
    "prefill_tok_s": 282.0,
    "decode_tok_s": 57.0,
    "threads": 2,
    "context": 4096,
    "note": "external reference figures for llama.cpp on SmolLM2-135M, measured earlier on the 2-core "
            "development machine; not measured in this run",
}
TARGET_VS_TRANSFORMERS = 1.5
TARGET_BEST_DECODE_VS_TRANSFORMERS = 2.0  # the best kvchat decode at 512 tokens
TARGET_FP8_VS_BF16_DECODE = 0.8
TARGET_LOAD_S = 3.0
WARMUP_TOKENS = 64
TRANSFORMERS_FP8 = "transformers-fp8-cache"  # QuantizedCache(backend="fp8"), where transformers has it


def has_fp8_quantized_cache() -> bool:
    """True when this transformers' ``QuantizedCache`` has an ``fp8`` backend (no extra package needed)."""
    from transformers import cache_utils

    return hasattr(cache_utils, "Fp8QuantizedLayer")


class BenchConfigError(ValueError):
    """Benchmark settings that cannot run (e.g. a context longer than the model allows)."""


@dataclass(slots=True)
class RunSamples:
    """Tokens/s of one backend at one context length, one sample per repeat."""

    backend: str
    context: int
    prefill_tok_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)


# A backend runs (prompt ids, decode tokens) and returns (prefill seconds, decode seconds).
RunFn = Callable[[list[int], int], tuple[float, float]]


def kvchat_runner(engine) -> RunFn:
    """Prefill ``ids`` in a fresh sequence of ``engine`` (on an engine loop driven by the caller's thread),
    decode greedily, release the blocks."""
    from kvchat.engine.block_manager import SeqBlocks
    from kvchat.engine.loop import EngineLoop

    loop = EngineLoop(engine, thread=False, snapshots=False)

    def run(ids: list[int], decode_tokens: int) -> tuple[float, float]:
        seq, tokens = SeqBlocks(), list(ids)
        t0 = time.perf_counter()
        next_id = int(loop.run(engine.prefill_steps(seq, tokens)).logits.argmax())
        t1 = time.perf_counter()
        for _ in range(decode_tokens):
            tokens.append(next_id)
            next_id = int(engine.decode(seq, tokens).argmax())
        t2 = time.perf_counter()
        engine.release(seq)
        return t1 - t0, t2 - t1

    return run


def transformers_runner(model, fp8_cache: bool = False) -> RunFn:
    """transformers' forward loop with a fresh ``DynamicCache`` (see module docstring).

    ``fp8_cache``: its ``QuantizedCache(backend="fp8")`` instead (per-tensor
    scale fixed at the first update; needs a transformers that has it).
    """
    from transformers import DynamicCache, QuantizedCache

    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
    new_cache = (lambda: QuantizedCache("fp8", model.config)) if fp8_cache else DynamicCache

    @inference()
    def run(ids: list[int], decode_tokens: int) -> tuple[float, float]:
        cache = new_cache()
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        next_id = out.logits[0, -1].argmax()
        t1 = time.perf_counter()
        for _ in range(decode_tokens):
            out = model(input_ids=next_id.view(1, 1), use_cache=True, **{cache_kw: cache})
            next_id = out.logits[0, -1].argmax()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    return run


def measure_load(model: str | None, repeats: int) -> dict[str, Spread]:
    """Model load times in seconds, ``repeats`` samples each.

    ``load_runtime_s``: :func:`kvchat.runtime.load_runtime` end to end (resolve,
    read weights, build the engine with its default pool, tokenizer);
    ``weights_read_s`` + ``engine_build_s``: the same split into
    :func:`load_weights` and ``Engine(...)`` (weights to a ready model and pool).
    """
    from kvchat.engine.calibration import load_calibration
    from kvchat.engine.runner import Engine
    from kvchat.model.registry import load_weights, resolve_model
    from kvchat.runtime import load_runtime

    samples: dict[str, list[float]] = {"load_runtime_s": [], "weights_read_s": [], "engine_build_s": []}
    info = resolve_model(model)
    k_mean_shape = (info.config.num_layers, info.config.num_kv_heads, info.config.head_dim)
    for _ in range(repeats):
        t0 = time.perf_counter()
        rt = load_runtime(model, "fp8")
        samples["load_runtime_s"].append(time.perf_counter() - t0)
        del rt
        t0 = time.perf_counter()
        weights = load_weights(info)
        t1 = time.perf_counter()
        engine = Engine(info.config, weights, info.fingerprint, kv_dtype="fp8", name=info.name,
                        calibration=load_calibration(info.fingerprint, k_mean_shape))
        t2 = time.perf_counter()
        samples["weights_read_s"].append(t1 - t0)
        samples["engine_build_s"].append(t2 - t1)
        del weights, engine
    return {k: Spread.of(v) for k, v in samples.items()}


def weight_formats(asked: str, num_params: int) -> list[str]:
    """The weight formats measured: fp32 (the baseline's) and int8, plus what ``asked`` (``KVCHAT_WEIGHTS`` /
    ``--weights``) gives a model of ``num_params`` stored parameters on the CPU
    (:func:`kvchat.engine.cache_identity.resolve_weight_format`) when that is bf16 (slow on CPUs without bf16
    units, so only on request) or int4 (``auto`` for a large model)."""
    from kvchat.engine.cache_identity import resolve_weight_format

    fmt = resolve_weight_format(asked, "cpu", num_params=num_params)
    return ["fp32", "int8"] + ([fmt] if fmt in ("bf16", "int4") else [])


def backend_name(kv_dtype: str, weight_format: str) -> str:
    """``kvchat-POOL`` for fp32 weights (the names of earlier runs), ``kvchat-POOL-FORMAT`` otherwise."""
    return f"kvchat-{kv_dtype}" + ("" if weight_format == "fp32" else f"-{weight_format}")


def prompt_ids(tokenizer, text: BenchText, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` ids of ``text`` (no special tokens).

    Raises:
        BenchConfigError: the text is shorter than ``num_tokens`` tokens.
    """
    ids = tokenizer(text.text, add_special_tokens=False)["input_ids"]
    if len(ids) < num_tokens:
        raise BenchConfigError(f"prompt text {text.name} has {len(ids)} tokens; {num_tokens} needed")
    return ids[:num_tokens]


def run_benchmark(args: argparse.Namespace, *, quick: bool = False) -> dict:
    """Run everything ``cmd_bench_engine`` reports; returns the JSON-ready result (``quick``: recorded in ``run``).

    Raises:
        BenchConfigError: bad lengths/repeats or a context beyond the model's limit.
    """
    from transformers import AutoTokenizer

    from kvchat import settings
    from kvchat.engine.kv_pool import KVCacheSpec
    from kvchat.engine.runner import Engine
    from kvchat.model.registry import load_weights, resolve_model
    from kvchat.model.weights import CheckpointReader
    from kvchat.runtime import ensure_calibration, set_threads

    lengths = sorted(set(args.lengths))
    if min(lengths) < 1 or args.repeats < 1 or args.decode_tokens < 1:
        raise BenchConfigError("--lengths, --repeats and --decode-tokens must be positive")
    set_threads(args.threads)
    info = resolve_model(args.model)
    cfg = info.config
    longest = max(lengths) + args.decode_tokens
    if longest > cfg.max_position_embeddings:
        raise BenchConfigError(
            f"--lengths {max(lengths)} + --decode-tokens {args.decode_tokens} = {longest} tokens exceeds "
            f"{info.name}'s context of {cfg.max_position_embeddings} tokens"
        )
    text = stdlib_text()
    tokenizer = AutoTokenizer.from_pretrained(str(info.path))
    ids = prompt_ids(tokenizer, text, max(lengths))
    pools = ["fp8", "bf16"] + ([args.kv_dtype] if args.kv_dtype not in ("fp8", "bf16") else [])

    load = measure_load(args.model, args.repeats)
    weights = load_weights(info)
    calibration = ensure_calibration(info, weights, tokenizer)
    runners: dict[str, RunFn] = {}
    specs = {kv: KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv) for kv in pools}
    ceilings = {}
    for fmt in weight_formats(settings.weights(), CheckpointReader(info.path).num_params()):
        for kv, spec in specs.items():
            pool_bytes = spec.bytes_per_block * (longest // spec.block_size + 3)  # + the sink's one-token forward
            engine = Engine(cfg, weights, info.fingerprint, kv_dtype=kv, pool_bytes=pool_bytes, name=info.name,
                            calibration=calibration, weight_format=fmt)
            runners[backend_name(kv, fmt)] = kvchat_runner(engine)
            if kv == "fp8":
                scale_scheme = engine.scale_scheme
            if fmt == "fp32":
                compute_dtype = engine.dtype
        ceilings[fmt] = matmul_ceiling(engine.model, repeats=max(3, args.repeats))
    ceiling = ceilings["fp32"]
    del weights, engine
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a bar per load would bury the table
        hf_load = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            hf = AutoModelForCausalLM.from_pretrained(str(info.path), dtype=compute_dtype).eval()
            hf_load.append(time.perf_counter() - t0)
        load["transformers_load_s"] = Spread.of(hf_load)
        runners["transformers"] = transformers_runner(hf)
        if has_fp8_quantized_cache():
            runners[TRANSFORMERS_FP8] = transformers_runner(hf, fp8_cache=True)

    for run in runners.values():  # first-call overheads (allocator, kernels) stay out of the figures
        run(ids[:WARMUP_TOKENS], 2)
    samples = {(b, n): RunSamples(b, n) for n in lengths for b in runners}
    for rep in range(args.repeats):
        for n in lengths:
            for backend, run in runners.items():
                prefill_s, decode_s = run(ids[:n], args.decode_tokens)
                samples[backend, n].prefill_tok_s.append(n / prefill_s)
                samples[backend, n].decode_tok_s.append(args.decode_tokens / decode_s)
                print(f"[repeat {rep + 1}/{args.repeats}] {backend} @{n}: prefill {n / prefill_s:.1f} tok/s, "
                      f"decode {args.decode_tokens / decode_s:.1f} tok/s", file=sys.stderr, flush=True)

    return {
        "benchmark": "engine",
        "run": run_info(threads=torch.get_num_threads(), quick=quick),
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "transformers": _version("transformers"),
                    "kvchat": _version("kvchat")},
        "model": info.name,
        "model_fingerprint": info.fingerprint,
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "scale_scheme": scale_scheme,
        "prompt": {"name": text.name, "sha256": text.sha256, "tokens": len(ids)},
        "repeats": args.repeats,
        "decode_tokens": args.decode_tokens,
        "bytes_per_token": {kv: spec.bytes_per_token for kv, spec in specs.items()},
        "load": {k: v.as_dict() for k, v in load.items()},
        "runs": [{"backend": s.backend, "context": s.context,
                  "prefill_tok_s": Spread.of(s.prefill_tok_s).as_dict(),
                  "decode_tok_s": Spread.of(s.decode_tok_s).as_dict()} for s in samples.values()],
        "ratios": _ratios(samples, lengths, list(runners)),
        "llama_cpp_reference": LLAMA_CPP_REFERENCE,
        "matmul_ceiling": ceiling,
        "matmul_ceiling_per_weight_format": ceilings,
        "targets": _targets(samples, lengths, load, list(runners)),
    }


def _ratios(samples: dict, lengths: list[int], backends: list[str]) -> list[dict]:
    """kvchat ÷ transformers (per-repeat pairs), fp8 ÷ bf16, and kvchat ÷ llama.cpp's reference figures."""
    out = []
    ours = [b for b in backends if b.startswith("kvchat-")]
    for n in lengths:
        pairs = [(b, "transformers") for b in ours if "transformers" in backends]
        pairs += [("kvchat-fp8", TRANSFORMERS_FP8)] if TRANSFORMERS_FP8 in backends else []
        pairs += [("kvchat-fp8", "kvchat-bf16")]
        pairs += [(b, b.rsplit("-", 1)[0]) for b in ours if b.count("-") == 2]  # each weight format vs fp32
        for num, den in pairs:
            a, b = samples[num, n], samples[den, n]
            out.append({"num": num, "den": den, "context": n,
                        "prefill": ratios(a.prefill_tok_s, b.prefill_tok_s).as_dict(),
                        "decode": ratios(a.decode_tok_s, b.decode_tok_s).as_dict()})
        if n == LLAMA_CPP_REFERENCE["context"]:
            for num in ours:
                a = samples[num, n]
                out.append({"num": num, "den": "llama.cpp (external reference)", "context": n,
                            "prefill": Spread.of([x / LLAMA_CPP_REFERENCE["prefill_tok_s"] for x in a.prefill_tok_s]).as_dict(),
                            "decode": Spread.of([x / LLAMA_CPP_REFERENCE["decode_tok_s"] for x in a.decode_tok_s]).as_dict()})
    return out


def _targets(samples: dict, lengths: list[int], load: dict[str, Spread], backends: list[str]) -> list[dict]:
    """The issue's goals, judged on medians: each ``{name, value, goal, met}``."""
    out = []

    def add(name: str, value: float, goal: float) -> None:
        out.append({"name": name, "value": round(value, 3), "goal": goal, "met": value >= goal})

    for n in lengths:
        if "transformers" in backends:
            for b in (x for x in backends if x.startswith("kvchat-")):
                for phase in ("prefill", "decode"):
                    r = ratios(getattr(samples[b, n], f"{phase}_tok_s"), getattr(samples["transformers", n], f"{phase}_tok_s"))
                    add(f"{b} {phase} / transformers @{n}", r.median, TARGET_VS_TRANSFORMERS)
        if "transformers" in backends:
            best = max((b for b in backends if b.startswith("kvchat-")),
                       key=lambda b: statistics.median(samples[b, n].decode_tok_s))
            r = ratios(samples[best, n].decode_tok_s, samples["transformers", n].decode_tok_s)
            add(f"best kvchat decode ({best}) / transformers fp32 @{n}", r.median, TARGET_BEST_DECODE_VS_TRANSFORMERS)
    n = max(lengths)
    r = ratios(samples["kvchat-fp8", n].decode_tok_s, samples["kvchat-bf16", n].decode_tok_s)
    add(f"fp8 decode / bf16 decode @{n}", r.median, TARGET_FP8_VS_BF16_DECODE)
    load_s = load["load_runtime_s"].median
    out.append({"name": "load_runtime seconds", "value": round(load_s, 3), "goal": TARGET_LOAD_S, "met": load_s <= TARGET_LOAD_S})
    return out


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def format_report(res: dict) -> str:
    """The human-readable tables of a :func:`run_benchmark` result."""
    def fmt(d, digits=1):
        return f"{d['median']:.{digits}f} ({d['min']:.{digits}f}-{d['max']:.{digits}f})"

    head = (f"kvchat bench engine: {res['model']}, {res['compute_dtype']} compute (int8 backends: int8 weights, "
            "bf16 activations at the int8 matmuls up to 256 rows), "
            f"{res['threads']} threads, prompt {res['prompt']['name']} (sha256 {res['prompt']['sha256'][:12]}), "
            f"fp8 scheme {res['scale_scheme']}, {res['repeats']} repeats, {res['decode_tokens']} decode tokens; "
            "median (min-max); shared machine, expect noise")
    speed = [("backend", "context", "prefill tok/s", "decode tok/s")]
    speed += [(r["backend"], str(r["context"]), fmt(r["prefill_tok_s"]), fmt(r["decode_tok_s"])) for r in res["runs"]]
    ratio = [("ratio (per repeat)", "context", "prefill", "decode")]
    ratio += [(f"{r['num']} / {r['den']}", str(r["context"]), fmt(r["prefill"], 2), fmt(r["decode"], 2)) for r in res["ratios"]]
    load = [("load", "seconds")] + [(k, fmt(v, 2)) for k, v in res["load"].items()]
    targets = [("target", "value", "goal", "met")]
    targets += [(t["name"], f"{t['value']:.2f}", f"{t['goal']}", "yes" if t["met"] else "NO") for t in res["targets"]]
    ref = res["llama_cpp_reference"]
    note = (f"llama.cpp: {ref['prefill_tok_s']:.0f} tok/s prefill, {ref['decode_tok_s']:.0f} tok/s decode, "
            f"{ref['threads']} threads, {ref['context']} context: {ref['note']}.")
    ceiling = "matmul ceiling (the weight matmuls alone, same format and threads; no torch runner can beat it):"
    for fmt, c in res["matmul_ceiling_per_weight_format"].items():
        ceiling += (f"\n  {fmt} weights: decode {c['decode_ceiling_tok_s']:.1f} tok/s ({c['decode_ms']:.1f} ms/token, "
                    f"{c['weight_gb_s']:.1f} GB/s of weights), prefill {c['prefill_ceiling_tok_s']:.0f} tok/s "
                    f"({c['gemm_gflop_s']:.0f} GFLOP/s)")
    return "\n\n".join([head, format_table(speed), format_table(ratio), note, ceiling, format_table(load), format_table(targets)])


def cmd_bench_engine(args: argparse.Namespace) -> int:
    """``kvchat bench engine``: print the tables; write JSON to ``args.json`` if set. Returns 0.

    Raises:
        BenchConfigError: see :func:`run_benchmark`.
    """
    res = run_benchmark(args)
    return print_report(res, format_report(res), args.json)
