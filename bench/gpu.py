"""The one device script: kvchat on a GPU, random weights, every section's JSON written as soon as it ends.

Run from a checkout on the GPU machine (torch + triton + safetensors +
transformers + xxhash + numpy; no platformdirs, sqlite-utils, textual or gguf
needed except by section (e), see below), at most ~8 minutes on an H200::

    python bench/gpu.py --json gpu.json [--wheels DIR]
    TRITON_INTERPRET=1 python bench/gpu.py --tiny --json out.json   # CPU: the same code paths, tiny sizes

Sections (a)-(h):

(a) every Triton kernel against the PyTorch reference at SmolLM2's and a
    Llama-3.1-8B layer's shape (``bench/gpu_kernels.py``'s checks);
(b) device copy bandwidth;
(c) decode attention 1K..128K tokens x fp8/bf16 (and fp8 by bit conversion, the path below sm_89) x batch
    1/16: device ms (CUDA graph replay), one call's ms, GB/s, fraction of copy bandwidth; cache-write
    bandwidth; a sweep of the split kernel's tiling, warps, stages and split waves at 4K and 32K
    (``bench/gpu_kernels.py``'s tables);
(d) the real engine end to end at SmolLM2's and Llama-3.1-8B's shape: a random bf16
    checkpoint written to disk, then loaded (time, peak device memory against the bf16
    weight bytes + 10%, peak host RSS), prefill tok/s and decode tok/s at 4K and 32K
    tokens, fp8 and bf16 pools; decode with CUDA graphs on and off (``decode_tok_s`` and
    ``decode_tok_s_eager``; ``decode_graphs`` says whether graphs ran: ``captured``, or why not);
    the kernel launches of one eager decode step (``launches_per_layer`` inside each decoder layer,
    ``launches_outside_layers`` for the rest of the step, ``kvchat.bench.launch_count``);
    at 4K, the device time of one decode step by kernel kind (``torch.profiler``, graph replay and eager)
    and 8 chats decoded as one batch (aggregate tok/s);
(e) a 32K-token chat snapshotted to disk (the real ``KVPersist`` writer) and restored
    in a fresh engine: restore ms with the page cache dropped and warm, TTFT of a
    15-token question after the restore, and cold prefill for comparison;
(f) the same at the Llama-3.1-8B shape, 4K and 32K tokens: cold prefill, restore ms and GB/s with the page
    cache dropped (4 and 8 reader threads) and warm, TTFT, against the disk's sequential and parallel read
    GB/s measured in the same run;
(g) a 24 GB GPU: a filler tensor leaves 24 GiB free, then the real load path of the 8B checkpoint directory
    (``load_runtime``: tokenizer, fingerprint hash, weights from a cold page cache, calibration, the default
    pool) and a 32K-token chat in it;
(h) the same load again: the start of a second run (kernels compiled, calibration stored, page cache warm).
(e)-(h) need sqlite-utils and platformdirs: on a machine without them pass ``--wheels DIR``
    holding pure-Python wheels (made elsewhere with ``python -m pip download
    --only-binary :all: -d DIR sqlite-utils platformdirs``); each ``*.whl`` goes on ``sys.path``.
    Without them the sections record why they did not run.

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
LARGE = "llama-3.1-8b"  # the shape users run: profiled, batched, resumed, fitted into 24 GB
QUESTION_TOKENS = 15
BATCH = 8
FIT_GIB = 24


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


def _prefill(engine, seq, ids: list[int]):
    """Prefill ``ids`` into ``seq`` as the engine loop runs a lone request: the :class:`PrefillResult`."""
    from kvchat.engine.loop import run_alone

    return run_alone(engine, engine.prefill_steps(seq, ids))


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


def prefill_decode(engine, context: int, decode_steps: int, profile: bool = False) -> dict:
    """Prefill ``context`` random tokens (tok/s from the engine's synced ``prefill_ms``), then decode tok/s with
    CUDA graphs (where the engine captures them) and without (``engine.decode_graphs.enabled = False``), then
    one more step's kernel launches; ``profile``: the device time of a step by kernel kind too (CUDA)."""
    from kvchat.bench.launch_count import decode_step_launches
    from kvchat.engine.block_manager import SeqBlocks

    ids = _ids(context, engine.cfg.vocab_size, 1)
    seq = SeqBlocks()
    res = _prefill(engine, seq, ids)
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
    out = {"context": context, "prefill_tok_s": context / (res.prefill_ms / 1e3), "prefill_ms": res.prefill_ms,
           "decode_tok_s": tok_s, "decode_tok_s_eager": eager, "decode_steps": decode_steps,
           "decode_graphs": state, "launches_per_layer": launches.per_layer,
           "launches_outside_layers": launches.outside, "layer_launch_ops": dict(launches.layer_ops)}
    if profile and engine.device.type == "cuda":
        for mode in ("graph", "eager"):
            if graphs is not None:
                graphs.enabled = mode == "graph"
            try:
                out[f"step_device_us_{mode}"] = _step_device_us(engine, seq, ids)
            except Exception as exc:  # the profiler is a diagnosis: its failure must not lose the figures above
                out[f"step_device_us_{mode}"] = {"error": f"{type(exc).__name__}: {exc}"}
        if graphs is not None:
            graphs.enabled = True
    engine.release(seq)
    return out


KERNEL_KINDS = (("_decode_split_kernel", "attention"), ("_merge_kernel", "attention merge"),
                ("_add_rms_norm", "add+rmsnorm"), ("_rope_write", "rope+cache write"), ("_silu_mul", "silu*mul"),
                ("gemm", "matmul"), ("gemv", "matmul"), ("nvjet", "matmul"), ("cutlass", "matmul"),
                ("xmma", "matmul"), ("splitKreduce", "matmul"))


def _step_device_us(engine, seq, ids: list[int], steps: int = 4) -> dict:
    """Device microseconds per decode step by kernel kind (:data:`KERNEL_KINDS`, else the kernel's name), from
    ``torch.profiler``'s CUDA activity over ``steps`` greedy steps; ``total`` is their sum, ``top`` the five
    longest kernels by name."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    ids.append(int(engine.decode(seq, ids).argmax()))  # outside the profile: a first replay, a capture
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            ids.append(int(engine.decode(seq, ids).argmax()))
        _sync(engine.device)
    kinds, names = Counter(), Counter()
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        us = us if us is not None else getattr(ev, "cuda_time_total", 0)
        if not us or ev.key.startswith("ProfilerStep"):
            continue
        kind = next((k for pat, k in KERNEL_KINDS if pat in ev.key), "other")
        kinds[kind] += us / steps
        names[ev.key[:80]] += us / steps
    return {"total": sum(kinds.values()), **{k: round(v, 1) for k, v in kinds.most_common()},
            "top": {k: round(v, 1) for k, v in names.most_common(5)}}


def batch_decode(engine, context: int, batch: int, decode_steps: int) -> dict:
    """``batch`` chats of ``context`` random tokens (each its own prefill) decoded together, as the server's
    scheduler batches them: aggregate tok/s over ``decode_steps`` steps after 3 untimed ones."""
    from kvchat.engine.block_manager import SeqBlocks

    seqs, rows = [], []
    for b in range(batch):
        ids = _ids(context, engine.cfg.vocab_size, 100 + b)
        seq = SeqBlocks()
        rows.append(int(_prefill(engine, seq, ids).logits.argmax()))
        seqs.append((seq, ids))
    warm = 3
    for step in range(warm + decode_steps):
        if step == warm:
            _sync(engine.device)
            t0 = time.perf_counter()
        for (seq, ids), tok in zip(seqs, rows):
            ids.append(tok)
        logits = engine._decode_rows(seqs, None)  # the batched forward of Engine.decode_batch, paged
        rows = logits.argmax(-1).tolist()
    _sync(engine.device)
    tok_s = batch * decode_steps / (time.perf_counter() - t0)
    for seq, _ in seqs:
        engine.release(seq)
    return {"context": context, "batch": batch, "decode_tok_s_total": tok_s, "decode_steps": decode_steps}


def section_engine(device: torch.device, tiny: bool, workdir: Path) -> dict:
    """(d): per shape, a random bf16 checkpoint loaded and run with fp8 and bf16 pools."""
    from kvchat.bench.random_checkpoint import write_checkpoint

    shapes = {"tiny": "tiny"} if tiny else ENGINE_SHAPES
    contexts = [64, 160] if tiny else [4096, 32768]
    steps = 3 if tiny else 32
    batch = 2 if tiny else BATCH
    out = {}
    for label, shape in shapes.items():
        ck = workdir / f"ck-{label}"
        t0 = time.perf_counter()
        file_bytes = write_checkpoint(ck, shape, device=str(device) if device.type == "cuda" else "cpu",
                                      max_position=max(contexts) + 1024)
        entry = {"checkpoint_bytes": file_bytes, "write_s": time.perf_counter() - t0, "pools": {}}
        big = label == "tiny" or label == LARGE
        for kv_dtype in _kv_dtypes(device):
            engine, stats = load_engine(ck, device, kv_dtype, max(max(contexts), batch * (contexts[0] + 64)) + 64)
            runs = [prefill_decode(engine, n, steps, profile=big and n == contexts[0]) for n in contexts]
            entry["pools"][kv_dtype] = {"load": stats, "runs": runs}
            if big:
                entry["pools"][kv_dtype]["batch"] = [batch_decode(engine, contexts[0], b, steps) for b in (1, batch)]
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
    return out


def _kv_dtypes(device: torch.device) -> list[str]:
    """fp8 where this device has it (CPU interpreter, CUDA >= 8.9), then the 16-bit pool (bf16; fp16 on CPU)."""
    fp8 = device.type == "cpu" or torch.cuda.get_device_capability(device) >= (8, 9)
    return (["fp8"] if fp8 else []) + (["bf16"] if device.type == "cuda" else ["fp16"])


def _persist_modules():
    """``(KVPersist, ReadSpeed, persistence module)``, or the reason they cannot be imported (no sqlite-utils)."""
    try:
        from kvchat.engine import persistence
        from kvchat.engine.read_speed import ReadSpeed
    except ImportError as exc:
        return f"{exc} (pass --wheels DIR with sqlite-utils' and platformdirs' wheels)"
    return persistence.KVPersist, ReadSpeed, persistence


def _use_home(workdir: Path) -> None:
    """The data dir (chunk index, snapshots, calibrations) and models dir of (e)-(h), under ``workdir``."""
    os.environ["KVCHAT_HOME"] = str(workdir / "home")
    os.environ["KVCHAT_MODELS"] = str(workdir / "models")


def _forget(engine) -> None:
    """Empty the engine's in-memory prefix cache, so the next chat finds its tokens on disk only."""
    engine.blocks.cached.clear()


def _snapshot_files() -> list[Path]:
    from kvchat.store.snapshot import kv_dir

    return sorted(kv_dir(Path(os.environ["KVCHAT_HOME"])).rglob("*.safetensors"))


def resume_runs(engine, contexts: list[int], readers: list[int], vocab: int) -> list[dict]:
    """Per context: a chat of that many random tokens prefilled (cold), saved by the real snapshot writer,
    forgotten in memory, then resumed from disk with a 15-token question: with the page cache dropped (once per
    reader count of ``readers``) and warm. Each: restore ms and GB/s, TTFT (restore, the question's prefill,
    the first token on the host), and the question's prefill alone."""
    from kvchat.bench.page_cache import drop_file_cache
    from kvchat.engine.block_manager import SeqBlocks

    persist_cls, speed_cls, persistence = _persist_modules()
    persist = persist_cls(engine)
    default_readers = persistence.READ_THREADS
    out = []
    try:
        for n in contexts:
            ids, question = _ids(n, vocab, 10 + n), _ids(QUESTION_TOKENS, vocab, 11)
            seq = SeqBlocks()
            cold = _prefill(engine, seq, ids)
            persist.save(seq, ids, [], owner=None)
            persist.flush()
            engine.release(seq)
            rows = persist.find(ids)
            run = {"tokens": n, "cold_prefill_ms": cold.prefill_ms, "snapshot_bytes": sum(r.bytes for r in rows),
                   "snapshot_files": len(rows)}
            for mode in [f"dropped_r{r}" for r in readers] + ["warm"]:
                _forget(engine)
                if mode.startswith("dropped"):
                    persistence.READ_THREADS = int(mode.split("_r")[1])
                    run.setdefault("resident_after_drop", max(drop_file_cache(Path(r.path)) or 0.0 for r in rows))
                else:
                    persistence.READ_THREADS = default_readers
                persist.read_speed = speed_cls.fixed(float("inf"))  # always read: the measurement, not the choice
                seq = SeqBlocks()
                _sync(engine.device)
                t0 = time.perf_counter()
                res = persist.restore(seq, ids + question)
                first = _prefill(engine, seq, ids + question)
                int(first.logits.argmax())  # the first token on the host: TTFT ends here
                ttft_ms = (time.perf_counter() - t0) * 1e3
                run[mode] = {"restore_ms": res.restore_ms, "from_disk": res.from_disk, "bytes_read": res.bytes_read,
                             "restore_gbps": res.bytes_read / max(res.restore_ms, 1e-6) / 1e6, "ttft_ms": ttft_ms,
                             "question_prefill_ms": first.prefill_ms, "prefilled_after_restore": first.prefilled_tokens}
                engine.release(seq)
            run["cold_over_ttft_warm"] = run["cold_prefill_ms"] / run["warm"]["ttft_ms"]
            print(f"resume {n} tokens: cold prefill {run['cold_prefill_ms']:.0f} ms; "
                  + "; ".join(f"{m} restore {run[m]['restore_ms']:.1f} ms ({run[m]['restore_gbps']:.2f} GB/s), "
                              f"TTFT {run[m]['ttft_ms']:.1f} ms" for m in run if isinstance(run[m], dict)))
            out.append(run)
    finally:
        persistence.READ_THREADS = default_readers
        persist.close()
    return out


def resume_pool_tokens(contexts: list[int]) -> int:
    """A pool for :func:`resume_runs`: twice the longest chat and question, since a resumed chat whose length
    is not a chunk edge recomputes from the edge below it into copies of the restored blocks."""
    return 2 * (max(contexts) + 2 * QUESTION_TOKENS) + 64


def section_restore(device: torch.device, tiny: bool, workdir: Path) -> dict:
    """(e): a 32K-token chat of the SmolLM2-shaped checkpoint saved and resumed (:func:`resume_runs`)."""
    _use_home(workdir)
    if isinstance(mods := _persist_modules(), str):
        return {"status": "not run", "reason": mods}
    ck = workdir / ("ck-tiny" if tiny else "ck-smollm2-135m")
    tokens = 300 if tiny else 32768
    kv = _kv_dtypes(device)[0]
    engine, _ = load_engine(ck, device, kv, resume_pool_tokens([tokens]))
    try:
        return {"kv_dtype": kv, "runs": resume_runs(engine, [tokens], [mods[2].READ_THREADS], engine.cfg.vocab_size)}
    finally:
        del engine


def disk_read(workdir: Path, nbytes: int, threads: int) -> dict:
    """The disk's read speed in this run: a fresh file of ``nbytes`` random bytes, dropped from the page cache,
    read sequentially (one thread, 8 MiB reads), then dropped again and read by ``threads`` threads at once
    (each a contiguous part), as a restore's readers read its files. GB/s = 1e9 bytes per second."""
    from concurrent.futures import ThreadPoolExecutor

    from kvchat.bench.page_cache import READ_PIECE, drop_file_cache, read_file, write_random_file

    path = workdir / "disk-probe.bin"
    write_random_file(path, nbytes)
    try:
        resident = drop_file_cache(path)
        read, seconds = read_file(path)
        out = {"bytes": read, "sequential_gbps": read / seconds / 1e9, "resident_after_drop": resident}
        drop_file_cache(path)
        part = -(-nbytes // threads)

        def read_part(i: int) -> int:
            fd, buf, done = os.open(path, os.O_RDONLY), bytearray(READ_PIECE), 0
            try:
                while done < part and (n := os.preadv(fd, [memoryview(buf)[: min(READ_PIECE, part - done)]],
                                                      i * part + done)):
                    done += n
            finally:
                os.close(fd)
            return done

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            total = sum(ex.map(read_part, range(threads)))
        out[f"parallel_{threads}_gbps"] = total / (time.perf_counter() - t0) / 1e9
        return out
    finally:
        path.unlink()


def section_resume_large(device: torch.device, tiny: bool, workdir: Path) -> dict:
    """(f): the Llama-3.1-8B-shaped chat at 4K and 32K tokens resumed from disk (:func:`resume_runs`, 4 and 8
    readers dropped, warm) beside the disk's own read speed (:func:`disk_read`)."""
    _use_home(workdir)
    if isinstance(mods := _persist_modules(), str):
        return {"status": "not run", "reason": mods}
    ck = workdir / ("ck-tiny" if tiny else f"ck-{LARGE}")
    contexts = [100, 300] if tiny else [4096, 32768]
    out = {"disk": disk_read(workdir, (8 << 20) if tiny else (2 << 30), 8)}
    print(f"disk read: sequential {out['disk']['sequential_gbps']:.2f} GB/s, 8 threads {out['disk']['parallel_8_gbps']:.2f} GB/s")
    kv = _kv_dtypes(device)[0]
    engine, _ = load_engine(ck, device, kv, resume_pool_tokens(contexts))
    try:
        out["kv_dtype"] = kv
        out["runs"] = resume_runs(engine, contexts, [4, 8], engine.cfg.vocab_size)
    finally:
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for run in out["runs"]:  # the bound: the disk the only limit, plus twice the question's own prefill
        disk = max(out["disk"]["sequential_gbps"], out["disk"]["parallel_8_gbps"]) * 1e9
        run["ttft_bound_ms"] = run["snapshot_bytes"] / (0.7 * disk) * 1e3 + 2 * run["warm"]["question_prefill_ms"]
        run["best_dropped_fraction_of_disk"] = max(run[m]["restore_gbps"] for m in run if m.startswith("dropped_r")) \
            * 1e9 / disk
    return out


def _real_load(ck: Path, device: torch.device, drop: bool) -> tuple[object, dict]:
    """``load_runtime`` of the checkpoint directory ``ck`` (fp8 pool, the default pool size), its weight files
    dropped from the page cache first when ``drop``: ``(runtime, stats)``, stats with the seconds from the start
    at which each start step began (``kvchat.load_steps`` and the ``progress`` callback) and the total."""
    from kvchat.bench.page_cache import drop_file_cache
    from kvchat.runtime import load_runtime

    if drop:
        for f in ck.glob("*.safetensors"):
            drop_file_cache(f)
    from kvchat.load_steps import listening

    steps: dict[str, float] = {}
    t0 = time.perf_counter()

    def say(text: str, *_) -> None:
        steps.setdefault(text, round(time.perf_counter() - t0, 2))

    with listening(say):
        runtime = load_runtime(str(ck), "fp8" if _kv_dtypes(device)[0] == "fp8" else "bf16", device=device.type,
                               progress=say)
    _sync(device)
    engine = runtime.engine
    return runtime, {"load_s": time.perf_counter() - t0, "steps": steps, "pool_bytes": engine.pool.nbytes,
                     "pool_tokens": engine.pool.num_blocks * engine.spec.block_size,
                     "max_context": engine.max_context}


def section_fit(device: torch.device, tiny: bool, workdir: Path) -> dict:
    """(g): on a GPU holding only :data:`FIT_GIB` GiB free (a filler tensor takes the rest), the real load
    of the 8B checkpoint from a cold page cache with the default pool, then a 32K-token chat: prefill and 16
    decode steps. Records the pool the default gave, the peak device memory, and what failed if anything."""
    _use_home(workdir)
    if isinstance(mods := _persist_modules(), str):
        return {"status": "not run", "reason": mods}
    if device.type != "cuda":
        return {"status": "not run", "reason": "needs a CUDA GPU (the filler and the default pool are device memory)"}
    from kvchat.engine.block_manager import SeqBlocks

    ck = workdir / f"ck-{LARGE}"
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    filler = torch.empty(max(0, free - (FIT_GIB << 30)), dtype=torch.uint8, device=device)
    out = {"gpu_total_bytes": total, "free_before_load": torch.cuda.mem_get_info(device)[0]}
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    try:
        runtime, stats = _real_load(ck, device, drop=True)
        out["load"] = stats
        engine = runtime.engine
        ids = _ids(32768, engine.cfg.vocab_size, 5)
        seq = SeqBlocks()
        res = _prefill(engine, seq, ids)
        tok_s, _ = _decode_tok_s(engine, seq, ids, res.logits, 16)
        out["chat"] = {"tokens": 32768, "prefill_ms": res.prefill_ms, "decode_tok_s": tok_s}
        engine.release(seq)
        del runtime, engine
    except Exception as exc:  # the point of this section: what a 24 GB card hits
        out["failed"] = f"{type(exc).__name__}: {exc}"
    out["device_peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
    del filler
    torch.cuda.empty_cache()
    print(f"fit {FIT_GIB} GiB: " + (f"failed: {out['failed']}" if "failed" in out else
          f"load {out['load']['load_s']:.1f} s, pool {out['load']['pool_tokens']:,} tokens, 32K prefill "
          f"{out['chat']['prefill_ms']:.0f} ms, decode {out['chat']['decode_tok_s']:.1f} tok/s, peak "
          f"{out['device_peak_bytes'] / 2**30:.1f} GiB"))
    return out


def section_warm_start(device: torch.device, tiny: bool, workdir: Path) -> dict:
    """(h): the real load of the same checkpoint again, as a second start finds it (kernels compiled in this
    process, calibration stored, weights in the page cache): the load time without compiles."""
    _use_home(workdir)
    if isinstance(mods := _persist_modules(), str):
        return {"status": "not run", "reason": mods}
    ck = workdir / ("ck-tiny" if tiny else f"ck-{LARGE}")
    runtime, stats = _real_load(ck, device, drop=False)
    del runtime
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"warm start: load {stats['load_s']:.1f} s, steps {stats['steps']}")
    return stats


def main(argv: list[str] | None = None) -> int:
    """Run (a)-(h); 1 if a check of (a) failed or a section raised (after the JSON is written), 2 without
    a GPU or the interpreter, else 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (CPU run under TRITON_INTERPRET=1)")
    ap.add_argument("--json", type=Path, help="write the results here (after every section)")
    ap.add_argument("--wheels", type=Path, help="folder of pure-Python wheels put on sys.path (sections (e)-(h))")
    ap.add_argument("--only", action="append", choices=list("abcdefgh"), help="run only these sections")
    ap.add_argument("--no-sweep", action="store_true", help="(c) without the sweep of launch tilings")
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
    want = set(args.only or "abcdefgh")
    checks_ok = True
    if "a" in want:
        checks = report.section("a_checks", lambda: [kb.asdict(c) | {"ok": c.ok} for c in kb.run_checks(kernels, device, args.tiny)])
        checks_ok = isinstance(checks, list) and all(c["ok"] for c in checks)
        for c in checks if isinstance(checks, list) else []:
            print(f"check {c['shape']:10s} {c['pool']:8s} {c['kernel']:40s} {c['max_err']:10.3g} {'ok' if c['ok'] else 'FAIL'}")
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
                call = f" (call {r['ms_call']:.4f} ms)" if r.get("ms_call") else ""
                print(f"{r['what']:7s} {r['kv_dtype']:8s} {r['context']:8d} {r['batch']:5d} {r['ms']:9.4f} ms "
                      f"{r['gbps']:8.1f} GB/s {r['frac_copy']:7.1%}{call}")
        if not args.no_sweep:
            sweep = report.section("c_sweep", lambda: [kb.asdict(r) for r in kb.decode_sweep(
                kernels, device, [40] if args.tiny else [4096, 32768], [1, 2] if args.tiny else [1, BATCH], shape,
                copy_gbps, reps, kb.SWEEP_TILES[:2] if args.tiny else kb.SWEEP_TILES, (1, 2) if args.tiny else kb.SWEEP_WAVES)])
            _print_sweep(sweep if isinstance(sweep, list) else [])
    with tempfile.TemporaryDirectory(prefix="kvchat-gpu-bench-") as tmp:
        if want & set("defgh"):  # the checkpoints of (e)-(h) are written by (d)
            report.section("d_engine", section_engine, device, args.tiny, Path(tmp))
        for key, name, fn in (("e", "e_restore", section_restore), ("f", "f_resume_large", section_resume_large),
                              ("g", "g_fit_24gb", section_fit), ("h", "h_warm_start", section_warm_start)):
            if key in want:
                report.section(name, fn, device, args.tiny, Path(tmp))
    if report.failed():
        print(f"failed sections: {', '.join(report.failed())}", file=sys.stderr)
    return 0 if checks_ok and not report.failed() else 1


def _print_sweep(rows: list[dict]) -> None:
    """Per (kv dtype, context, batch) of the sweep: the fastest launch beside the default one."""
    default = "n128w4s3x2"  # triton_decode.DEFAULT_TILES, SPLIT_WAVES
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["kv_dtype"], r["context"], r["batch"]), []).append(r)
    for (kv, context, batch), rs in groups.items():
        best = min(rs, key=lambda r: r["ms"])
        base = next((r for r in rs if r["tiles"] == default), None)
        base_text = f"default {base['ms']:.4f} ms ({base['frac_copy']:.1%})" if base else "default failed"
        print(f"sweep {kv:8s} {context:7d} {batch:3d}: best {best['tiles']} {best['ms']:.4f} ms "
              f"({best['frac_copy']:.1%} of copy), {base_text}")


if __name__ == "__main__":
    sys.exit(main())
