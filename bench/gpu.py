"""The one device script: kvchat on a GPU, random weights, every section's JSON written as soon as it ends.

Run from a checkout on the GPU machine (torch + triton + safetensors +
transformers + xxhash + numpy; no platformdirs, sqlite-utils, textual or gguf
needed except by section (e), see below), at most ~8 minutes on an H200::

    python bench/gpu.py --json gpu.json [--wheels DIR]
    TRITON_INTERPRET=1 python bench/gpu.py --tiny --json out.json   # CPU: the same code paths, tiny sizes

Sections (a)-(e):

(a) every Triton kernel against the PyTorch reference at SmolLM2's and a
    Llama-3.1-8B layer's shape (``bench/gpu_kernels.py``'s checks);
(b) device copy bandwidth;
(c) decode attention 1K..128K tokens x fp8/bf16 x batch 1/16: ms, GB/s, fraction of
    copy bandwidth; cache-write bandwidth (``bench/gpu_kernels.py``'s tables);
(d) the real engine end to end at SmolLM2's and Llama-3.1-8B's shape: a random bf16
    checkpoint written to disk, then loaded (time, peak device memory against the bf16
    weight bytes + 10%, peak host RSS), prefill tok/s and decode tok/s at 4K and 32K
    tokens, fp8 and bf16 pools; decode with CUDA graphs on and off (``decode_tok_s`` and
    ``decode_tok_s_eager``; ``decode_graphs`` says whether graphs ran: ``captured``, or why not);
    the kernel launches of one eager decode step (``launches_per_layer`` inside each decoder layer,
    ``launches_outside_layers`` for the rest of the step, ``kvchat.bench.launch_count``);
(e) a 32K-token chat snapshotted to disk (the real ``KVPersist`` writer) and restored
    in a fresh engine: restore ms with the page cache dropped and warm, TTFT of a
    15-token question after the restore, and cold prefill for comparison. It needs
    sqlite-utils (the chunk index): on a machine without it pass ``--wheels DIR``
    holding pure-Python wheels (made elsewhere with ``python -m pip download
    --only-binary :all: -d DIR sqlite-utils``); each ``*.whl`` goes on ``sys.path``.
    Without them the section records why it did not run.

The JSON (``--json``) is rewritten after every section, so a crash keeps what
was measured; a section that fails records its error and the next one runs.
Exit status 1 when a correctness check of (a) fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ENGINE_SHAPES = {"smollm2-135m": "smollm2-135m", "llama-3.1-8b": "llama-3.1-8b"}  # random_checkpoint shapes
QUESTION_TOKENS = 15


def _kernels_bench():
    """``bench/gpu_kernels.py`` as a module (its checks and tables are sections (a)-(c))."""
    spec = importlib.util.spec_from_file_location("kvchat_bench_kernels", ROOT / "bench" / "gpu_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class Report:
    """The JSON result, written after every section."""

    def __init__(self, path: Path | None, meta: dict):
        self.path, self.data = path, {"meta": meta, "sections": {}}

    def section(self, name: str, fn, *args) -> object:
        """Run ``fn(*args)`` as section ``name``: its result or its error goes into the JSON, written now."""
        t0 = time.perf_counter()
        try:
            result, status = fn(*args), "ok"
        except Exception as exc:  # a crash of one section must not lose the others
            result, status = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}, "error"
            print(f"section {name}: {result['error']}", file=sys.stderr)
        self.data["sections"][name] = {"status": status, "seconds": round(time.perf_counter() - t0, 2), "result": result}
        self.write()
        return result

    def failed(self) -> list[str]:
        """The sections whose code raised (their errors are in the JSON)."""
        return [name for name, s in self.data["sections"].items() if s["status"] == "error"]

    def write(self) -> None:
        """Write the JSON (no-op without ``--json``)."""
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=2, default=str))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _status_bytes(key: str) -> int | None:
    """A ``/proc/self/status`` field in bytes (Linux), else None."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_host_peak() -> None:
    """Reset VmHWM (peak RSS) to the current RSS (proc(5), Linux >= 4.0); ignored elsewhere."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def load_engine(model_dir: Path, device: torch.device, kv_dtype: str, pool_tokens: int):
    """Load a checkpoint into an :class:`Engine` (bf16 compute) and measure it.

    Returns:
        ``(engine, stats)``; stats: ``load_s``, ``weight_bytes``, ``device_peak_bytes`` (CUDA: the most
        allocated during the load, beyond what was before), ``device_bound_bytes`` (weights x 1.1),
        ``host_rss_before``/``host_peak_rss`` (bytes).
    """
    from kvchat.engine.kv_pool import KVCacheSpec
    from kvchat.engine.runner import Engine
    from kvchat.model.config import ModelConfig
    from kvchat.model.weights import CheckpointReader

    cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    reader = CheckpointReader(model_dir)
    weight_bytes = sum(e.end - e.begin for e in reader.entries.values())
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    rss_before = _status_bytes("VmRSS")
    _reset_host_peak()
    t0 = time.perf_counter()
    engine = Engine(cfg, reader, "gpu-bench-random", kv_dtype=kv_dtype, device=device, dtype="bf16",
                    pool_bytes=spec.bytes_per_block * (pool_tokens // spec.block_size + 2))
    _sync(device)
    stats = {"load_s": time.perf_counter() - t0, "weight_bytes": weight_bytes,
             "host_rss_before": rss_before, "host_peak_rss": _status_bytes("VmHWM"),
             "pool_bytes": engine.pool.nbytes, "scale_scheme": engine.scale_scheme,
             "device_bound_bytes": int(weight_bytes * 1.1)}
    if device.type == "cuda":  # the pool is allocated last: the peak before it is the weights' load
        stats["device_peak_bytes"] = torch.cuda.max_memory_allocated(device) - base - engine.pool.nbytes
        stats["device_load_within_bound"] = stats["device_peak_bytes"] <= stats["device_bound_bytes"]
    return engine, stats


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _decode_tok_s(engine, seq, ids: list[int], logits, decode_steps: int):
    """``(tok/s, last logits)`` of ``decode_steps`` greedy steps timed as the chat app runs them (device
    argmax, one sync per token), after 3 untimed ones (a graph's capture happens in the first)."""
    from kvchat.engine.sampling import Sampler, SamplingParams

    sampler, warm = Sampler(SamplingParams()), 3
    for step in range(warm + decode_steps):
        if step == warm:
            _sync(engine.device)
            t0 = time.perf_counter()
        ids.append(sampler(logits))
        logits = engine.decode(seq, ids)
    _sync(engine.device)
    return decode_steps / (time.perf_counter() - t0), logits


def prefill_decode(engine, context: int, decode_steps: int) -> dict:
    """Prefill ``context`` random tokens (tok/s from the engine's synced ``prefill_ms``), then decode tok/s with
    CUDA graphs (where the engine captures them) and without (``engine.decode_graphs.enabled = False``), then
    one more step's kernel launches."""
    from kvchat.bench.launch_count import decode_step_launches
    from kvchat.engine.block_manager import SeqBlocks
    from kvchat.engine.loop import run_alone

    ids = _ids(context, engine.cfg.vocab_size, 1)
    seq = SeqBlocks()
    res = run_alone(engine, engine.prefill_steps(seq, ids))
    graphs = engine.decode_graphs
    tok_s, logits = _decode_tok_s(engine, seq, ids, res.logits, decode_steps)
    if graphs is not None:
        graphs.enabled = False
        eager, logits = _decode_tok_s(engine, seq, ids, logits, decode_steps)
        graphs.enabled = True
        state = graphs.failed and f"eager: capture failed ({graphs.failed})" or "captured"
    else:
        eager, state = tok_s, f"eager: no graphs on {engine.device.type} (KVCHAT_CUDA_GRAPHS, the Triton backend)"
    ids.append(int(logits.argmax()))
    launches, _ = decode_step_launches(engine, seq, ids)
    engine.release(seq)
    return {"context": context, "prefill_tok_s": context / (res.prefill_ms / 1e3), "prefill_ms": res.prefill_ms,
            "decode_tok_s": tok_s, "decode_tok_s_eager": eager, "decode_steps": decode_steps,
            "decode_graphs": state, "launches_per_layer": launches.per_layer,
            "launches_outside_layers": launches.outside, "layer_launch_ops": dict(launches.layer_ops)}


def section_engine(device: torch.device, tiny: bool, workdir: Path) -> dict:
    """(d): per shape, a random bf16 checkpoint loaded and run with fp8 and bf16 pools."""
    from kvchat.bench.random_checkpoint import write_checkpoint

    shapes = {"tiny": "tiny"} if tiny else ENGINE_SHAPES
    contexts = [64, 160] if tiny else [4096, 32768]
    steps = 3 if tiny else 32
    out = {}
    for label, shape in shapes.items():
        ck = workdir / f"ck-{label}"
        t0 = time.perf_counter()
        file_bytes = write_checkpoint(ck, shape, device=str(device) if device.type == "cuda" else "cpu",
                                      max_position=max(contexts) + 1024)
        entry = {"checkpoint_bytes": file_bytes, "write_s": time.perf_counter() - t0, "pools": {}}
        for kv_dtype in _kv_dtypes(device):
            engine, stats = load_engine(ck, device, kv_dtype, max(contexts) + 64)
            runs = [prefill_decode(engine, n, steps) for n in contexts]
            entry["pools"][kv_dtype] = {"load": stats, "runs": runs}
            print(f"engine {label:13s} {kv_dtype:5s} load {stats['load_s']:.1f} s"
                  + (f", device peak {stats['device_peak_bytes'] / 1e9:.2f} GB (bound {stats['device_bound_bytes'] / 1e9:.2f})"
                     if "device_peak_bytes" in stats else "")
                  + "".join(f" | {r['context']}: prefill {r['prefill_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.1f}"
                            f" tok/s (graphs off {r['decode_tok_s_eager']:.1f}), {r['launches_per_layer']:g} launches/layer"
                            for r in runs))
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
        out[label] = entry
        if not tiny and label != "smollm2-135m":
            for f in ck.glob("*.safetensors"):
                f.unlink()  # 16 GB: the disk is small
    return out


def _kv_dtypes(device: torch.device) -> list[str]:
    """fp8 where this device has it (CPU interpreter, CUDA >= 8.9), then the 16-bit pool (bf16; fp16 on CPU)."""
    fp8 = device.type == "cpu" or torch.cuda.get_device_capability(device) >= (8, 9)
    return (["fp8"] if fp8 else []) + (["bf16"] if device.type == "cuda" else ["fp16"])


def section_restore(device: torch.device, tiny: bool, workdir: Path) -> dict:
    """(e): a long chat saved by the real snapshot writer, restored in a fresh engine (dropped and warm page cache)."""
    os.environ["KVCHAT_HOME"] = str(workdir / "home")
    os.environ["KVCHAT_MODELS"] = str(workdir / "models")
    try:
        from kvchat.engine.persistence import KVPersist
        from kvchat.engine.read_speed import ReadSpeed
    except ImportError as exc:
        return {"status": "not run", "reason": f"{exc} (pass --wheels DIR with sqlite-utils' wheels)"}
    from kvchat.bench.page_cache import drop_file_cache
    from kvchat.engine.block_manager import SeqBlocks
    from kvchat.engine.loop import EngineLoop, run_alone
    from kvchat.store.snapshot import kv_dir

    ck = workdir / ("ck-tiny" if tiny else "ck-smollm2-135m")
    tokens = 300 if tiny else 32768
    kv = _kv_dtypes(device)[0]
    ids = _ids(tokens, 256 if tiny else 49152, 2)
    question = _ids(QUESTION_TOKENS, 256 if tiny else 49152, 3)
    engine, _ = load_engine(ck, device, kv, tokens + 2 * QUESTION_TOKENS + 64)
    persist = KVPersist(engine)
    seq = SeqBlocks()
    cold = run_alone(engine, engine.prefill_steps(seq, ids))
    persist.save(seq, ids, [], owner=None)
    persist.flush()
    persist.close()
    del engine, persist
    files = sorted(kv_dir(Path(os.environ["KVCHAT_HOME"])).rglob("*.safetensors"))
    out = {"tokens": tokens, "kv_dtype": kv, "cold_prefill_ms": cold.prefill_ms,
           "snapshot_bytes": sum(f.stat().st_size for f in files), "snapshot_files": len(files)}
    for mode in ("dropped", "warm"):
        if mode == "dropped":
            out["resident_after_drop"] = [drop_file_cache(f) for f in files][:1]
        engine, _ = load_engine(ck, device, kv, tokens + 2 * QUESTION_TOKENS + 64)
        persist = KVPersist(engine)
        persist.read_speed = ReadSpeed.fixed(float("inf"))  # always read: the measurement, not the engine's choice
        seq, loop = SeqBlocks(), EngineLoop(engine, thread=False, snapshots=False)  # TTFT: restore + prefill
        t0 = time.perf_counter()
        res = persist.restore(seq, ids + question)
        first = loop.run(engine.prefill_steps(seq, ids + question))
        int(first.logits.argmax())  # the first token on the host: TTFT ends here
        ttft_ms = (time.perf_counter() - t0) * 1e3
        loop.close()
        out[mode] = {"restore_ms": res.restore_ms, "from_disk": res.from_disk, "bytes_read": res.bytes_read,
                     "ttft_ms": ttft_ms, "prefilled_after_restore": first.prefilled_tokens}
        persist.close()
        del engine, persist
    out["cold_over_ttft_dropped"] = out["cold_prefill_ms"] / out["dropped"]["ttft_ms"]
    print(f"restore {tokens} tokens ({kv}): dropped {out['dropped']['restore_ms']:.1f} ms, warm {out['warm']['restore_ms']:.1f} ms; "
          f"TTFT {out['dropped']['ttft_ms']:.1f} ms vs cold prefill {out['cold_prefill_ms']:.0f} ms")
    return out


def main(argv: list[str] | None = None) -> int:
    """Run (a)-(e); 1 if a check of (a) failed or a section raised (after the JSON is written), 2 without
    a GPU or the interpreter, else 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (CPU run under TRITON_INTERPRET=1)")
    ap.add_argument("--json", type=Path, help="write the results here (after every section)")
    ap.add_argument("--wheels", type=Path, help="folder of pure-Python wheels put on sys.path (section (e))")
    ap.add_argument("--only", action="append", choices=["a", "b", "c", "d", "e"], help="run only these sections")
    args = ap.parse_args(argv)
    if args.wheels:
        sys.path[:0] = [str(w) for w in sorted(args.wheels.glob("*.whl"))]
    kb = _kernels_bench()
    kernels = kb.load_kernels()  # also maps ``kvchat`` to this checkout (never its root on sys.path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not kernels.decode.INTERPRETED:
        print("no GPU: run with TRITON_INTERPRET=1 (and --tiny) to execute the kernels on CPU", file=sys.stderr)
        return 2
    if device.type == "cpu":
        os.environ.setdefault("KVCHAT_ATTENTION", "triton")  # the engine sections run the Triton kernels too
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    meta = {"device": gpu, "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
            "torch": torch.__version__, "triton": kb._triton_version(), "tiny": args.tiny,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(f"kvchat GPU bench: {gpu}, torch {torch.__version__}, triton {meta['triton']}")
    report = Report(args.json, meta)
    want = set(args.only or "abcde")
    checks_ok = True
    if "a" in want:
        checks = report.section("a_checks", lambda: [kb.asdict(c) | {"ok": c.ok} for c in kb.run_checks(kernels, device, args.tiny)])
        checks_ok = isinstance(checks, list) and all(c["ok"] for c in checks)
        for c in checks if isinstance(checks, list) else []:
            print(f"check {c['shape']:10s} {c['pool']:8s} {c['kernel']:32s} {c['max_err']:10.3g} {'ok' if c['ok'] else 'FAIL'}")
    reps = 1 if args.tiny else 20
    copy = report.section("b_copy", lambda: {"gbps": kb.copy_bandwidth(device, (1 << 16) if args.tiny else (1 << 30), reps)}) \
        if want & {"b", "c"} else None
    copy_gbps = copy.get("gbps") if isinstance(copy, dict) else None
    if "c" in want and copy_gbps:
        contexts = [40] if args.tiny else [1 << k for k in range(10, 18)]
        batches = [1, 2] if args.tiny else [1, 16]
        shape = "llama3-8b"

        def tables():
            rows = kb.decode_table(kernels, device, contexts, batches, shape, copy_gbps, reps)
            rows += kb.write_rows(kernels, device, 16 if args.tiny else 16 * 4096, shape, copy_gbps, reps)
            return [kb.asdict(r) for r in rows]

        for r in report.section("c_attention", tables) or []:
            if isinstance(r, dict) and "what" in r:
                print(f"{r['what']:7s} {r['kv_dtype']:8s} {r['context']:8d} {r['batch']:5d} {r['ms']:9.4f} ms "
                      f"{r['gbps']:8.1f} GB/s {r['frac_copy']:7.1%}")
    with tempfile.TemporaryDirectory(prefix="kvchat-gpu-bench-") as tmp:
        if want & {"d", "e"}:
            report.section("d_engine", section_engine, device, args.tiny, Path(tmp))
        if "e" in want:
            report.section("e_restore", section_restore, device, args.tiny, Path(tmp))
    if report.failed():
        print(f"failed sections: {', '.join(report.failed())}", file=sys.stderr)
    return 0 if checks_ok and not report.failed() else 1


if __name__ == "__main__":
    sys.exit(main())
