"""``kvchat bench load``: peak memory and time of loading a model, and fingerprint speed.

Writes a random-weight checkpoint (:mod:`kvchat.bench.random_checkpoint`,
default the ~0.84B-parameter shape, 1.67 GB in bf16) unless ``--dir`` names
one, then in a fresh process runs :func:`kvchat.runtime.load_runtime` on it
(``KVCHAT_DTYPE`` = ``--dtype``, ``--kv-dtype`` pool of ``--pool-mb``) and
reports the process's peak resident set (``ru_maxrss``) against the target
``1.3 x weight file bytes + 1.5 GB`` (a load that builds the model in fp32 first
took 6.1 GB for a 1.64 GB file). The fingerprint is computed before the measured
load (and cached), then the weight bytes are read and hashed once more per
hash (page cache warm): sequential read GB/s, blake2b-256 (fingerprint
version 1) and xxh3-128 (version 2) GB/s.

    kvchat bench load [--shape 0.8b|test] [--dir DIR] [--dtype bf16] [--kv-dtype bf16] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RSS_FACTOR, RSS_EXTRA_BYTES = 1.3, 1.5e9  # the target: peak RSS <= 1.3 x file bytes + 1.5 GB

_CHILD = r"""
import json, resource, sys, time
from kvchat.runtime import load_runtime
from transformers import AutoTokenizer  # imported before the baseline: the load, not the imports, is measured
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
if len(sys.argv) > 3:  # a tiny checkpoint first: imports and one-time set-up land before the baseline
    load_runtime(sys.argv[3], sys.argv[2])
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM (the peak RSS) to the current RSS (proc(5), Linux >= 4.0)
t0 = time.perf_counter()
rt = load_runtime(sys.argv[1], sys.argv[2])
seconds = time.perf_counter() - t0
print(json.dumps({"rss_before_load": before, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "load_peak_rss": status("VmHWM"),
                  "rss_after_load": status("VmRSS"), "load_s": seconds, "dtype": str(rt.engine.dtype),
                  "pool_bytes": rt.engine.pool.nbytes, "pool": rt.engine.pool_plan.text}))
"""


def add_load_args(p: argparse.ArgumentParser) -> None:
    """The ``kvchat bench load`` options."""
    p.add_argument("--shape", default="0.8b", help="random checkpoint shape (kvchat.bench.random_checkpoint.SHAPES)")
    p.add_argument("--dir", metavar="DIR", help="load this checkpoint instead of writing a random one")
    p.add_argument("--pool-mb", type=float, default=64.0, help="KV pool, MiB (KVCHAT_KV_BUDGET_MB)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def weight_bytes(model_dir: Path) -> int:
    """Total bytes of the checkpoint's safetensors files."""
    from kvchat.model.fingerprint import weight_files

    return sum(p.stat().st_size for p in weight_files(model_dir))


def measure_load(model_dir: Path, kv_dtype: str = "bf16", dtype: str = "bf16", pool_mb: float = 64.0,
                 models_dir: Path | None = None, warm_dir: Path | None = None) -> dict:
    """Load ``model_dir`` with :func:`load_runtime` in a fresh process; its memory and time.

    ``warm_dir``: a (tiny) checkpoint loaded first in that process, so ``rss_before_load`` already
    counts the imports and one-time set-up a load does (``peak_rss`` is the whole process's either way).

    Returns:
        ``{"rss_before_load", "peak_rss"`` (the whole process's, ``ru_maxrss``), ``"load_peak_rss"`` (the peak
        during the load alone: ``VmHWM`` reset just before it), ``"rss_after_load"`` (bytes),
        ``"load_s", "dtype", "pool_bytes", "pool"}``.
    Raises:
        RuntimeError: the child failed (its stderr in the message).
    """
    env = {**os.environ, "KVCHAT_DTYPE": dtype, "KVCHAT_KV_BUDGET_MB": str(pool_mb), "KVCHAT_DEVICE": "cpu"}
    if models_dir is not None:
        env["KVCHAT_MODELS"] = str(models_dir)
    argv = [sys.executable, "-c", _CHILD, str(model_dir), kv_dtype] + ([str(warm_dir)] if warm_dir else [])
    proc = subprocess.run(argv, capture_output=True, text=True,
                          env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"loading {model_dir} failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def hash_speeds(model_dir: Path, block: int = 8 << 20) -> dict[str, float]:
    """GB/s of reading the weight files (page cache warm after a first pass), and of blake2b-256 and xxh3-128 over them."""
    import xxhash

    from kvchat.model.fingerprint import weight_files

    files = weight_files(model_dir)
    buf = memoryview(bytearray(block))

    def run(h) -> float:
        t0, n = time.perf_counter(), 0
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while k := f.readinto(buf):
                    if h is not None:
                        h.update(buf[:k])
                    n += k
        return n / (time.perf_counter() - t0) / 1e9

    run(None)  # warm the page cache
    return {"read_GBps": run(None), "blake2b_GBps": run(hashlib.blake2b(digest_size=32)),
            "xxh3_128_GBps": run(xxhash.xxh3_128())}


def cmd_bench_load(args: argparse.Namespace) -> int:
    """Run the benchmark and print its table (see module doc). Returns 0, or 1 when the target is missed.

    ``args.dtype`` (the CLI's ``--dtype``; None: bf16) and ``args.kv_dtype`` (default fp8) choose the load.
    """
    from kvchat.bench.run_info import run_info, write_json
    from kvchat.model.fingerprint import cached_fingerprint

    with tempfile.TemporaryDirectory(prefix="kvchat-bench-load-") as tmp:
        model_dir = Path(args.dir) if args.dir else Path(tmp) / "ckpt"
        written_s = None
        from kvchat.bench.random_checkpoint import write_checkpoint

        if not args.dir:
            t0 = time.perf_counter()
            write_checkpoint(model_dir, args.shape)
            written_s = time.perf_counter() - t0
        dtype = getattr(args, "dtype", None) or "bf16"
        models = Path(tmp) / "models"
        models.mkdir()
        os.environ["KVCHAT_MODELS"] = str(models)
        t0 = time.perf_counter()
        cached_fingerprint(model_dir, progress=False)  # cached for the child: the load alone is measured
        fingerprint_s = time.perf_counter() - t0
        size = weight_bytes(model_dir)
        write_checkpoint(Path(tmp) / "warm", "tiny")
        load = measure_load(model_dir, args.kv_dtype, dtype, args.pool_mb, models, Path(tmp) / "warm")
        speeds = hash_speeds(model_dir)
    bound = RSS_FACTOR * size + RSS_EXTRA_BYTES
    result = {"run": run_info(), "shape": None if args.dir else args.shape, "weight_bytes": size,
              "write_s": written_s, "fingerprint_s": fingerprint_s, **load, **speeds,
              "rss_bound": bound, "met": load["peak_rss"] <= bound}
    gb = 1e9
    print(f"checkpoint: {size / gb:.2f} GB of weights ({result['shape'] or args.dir}); load with KVCHAT_DTYPE={dtype}, "
          f"--kv-dtype {args.kv_dtype}, {load['pool']}")
    print("| RSS before load | peak during load | after load | process peak | target 1.3 x file + 1.5 GB | load | fingerprint (first) |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {load['rss_before_load'] / gb:.2f} GB | {load['load_peak_rss'] / gb:.2f} GB | {load['rss_after_load'] / gb:.2f} GB "
          f"| {load['peak_rss'] / gb:.2f} GB "
          f"| {bound / gb:.2f} GB ({'met' if result['met'] else 'MISSED'}) | {load['load_s']:.1f} s | {fingerprint_s:.1f} s |")
    print(f"weights read {speeds['read_GBps']:.2f} GB/s (page cache); blake2b-256 {speeds['blake2b_GBps']:.2f} GB/s, "
          f"xxh3-128 {speeds['xxh3_128_GBps']:.2f} GB/s (read + hash)")
    if args.json:
        write_json(args.json, result)
    return 0 if result["met"] else 1
