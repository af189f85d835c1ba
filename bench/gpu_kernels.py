"""Check and time kvchat's Triton KV-cache kernels on one GPU (only torch and triton needed).

Run from a checkout, nothing installed, no network, under 5 minutes::

    python bench/gpu_kernels.py [--json out.json]
    TRITON_INTERPRET=1 python bench/gpu_kernels.py --tiny     # CPU smoke run of the same logic

It prints:
(a) each kernel against the PyTorch reference at SmolLM2-135M sizes (9 query
    heads, 3 KV heads, head_dim 64) and a Llama-3-8B-like layer (32/8/128);
(b) device-to-device copy bandwidth, (bytes read + bytes written) / time;
(c) decode attention on a Llama-3-8B-like layer for context 1K..128K x
    {fp8, bf16} x batch {1, 16}: ms per call, GB/s = (KV and scale bytes read
    + query/output bytes) / time, and the fraction of copy bandwidth; then
    cache-write bandwidth;
(d) end-to-end engine decode tokens/s with random SmolLM2-shaped weights
    (kvchat's own engine, imported from the checkout).

Targets: decode >= 80% of copy bandwidth at >= 32K context, fp8
>= 1.7x faster than bf16 there, cache write >= 70% of copy bandwidth.
Exit status 1 when a correctness check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # imported where needed, once load_kernels has mapped ``kvchat`` to this checkout
    from kvchat.kernels.layout import KVLayer

ROOT = Path(__file__).resolve().parents[1]
FP8 = torch.float8_e4m3fn
SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # num_heads, num_kv_heads, head_dim
BLOCK_SIZE = 16


@dataclass(slots=True)
class Kernels:
    """This checkout's reference and Triton kernel modules."""

    reference: ModuleType
    write: ModuleType
    decode: ModuleType
    extend: ModuleType


def kv_dtypes(device: torch.device, names: bool = False) -> list:
    """Pool dtypes to exercise: fp8 (where Triton supports it: CPU interpreter, CUDA >= 8.9) and 16-bit.

    The 16-bit pool is bf16 on a GPU, fp16 on CPU (the interpreter's bf16
    arithmetic is wrong). ``names``: kvchat's names (``fp8``, ``bf16``, ``fp16``) instead of torch dtypes.
    """
    fp8 = device.type == "cpu" or torch.cuda.get_device_capability(device) >= (8, 9)
    wide = torch.bfloat16 if device.type == "cuda" else torch.float16
    dtypes = ([FP8] if fp8 else []) + [wide]
    return [{FP8: "fp8", torch.bfloat16: "bf16", torch.float16: "fp16"}[d] for d in dtypes] if names else dtypes


def load_kernels() -> Kernels:
    """Import this checkout's ``kernels/`` as ``kvchat.kernels`` without installing anything.

    The checkout's ``kvchat`` package is loaded by path (unless an imported ``kvchat`` already
    comes from this checkout: an editable install, or a test importing this script); its
    ``__init__`` finds the kernels beside it. Loading by path keeps the checkout root off
    ``sys.path``.
    """
    package = sys.modules.get("kvchat")
    folder = ROOT / "kvchat"
    if package is None or Path(package.__file__).resolve().parent != folder:
        spec = importlib.util.spec_from_file_location("kvchat", folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        package = importlib.util.module_from_spec(spec)
        sys.modules["kvchat"] = package
        spec.loader.exec_module(package)
    names = ("reference", "triton_write", "triton_decode", "triton_extend")
    return Kernels(*(importlib.import_module(f"kvchat.kernels.{name}") for name in names))


@dataclass(slots=True)
class Paged:
    """A paged pool with one shuffled block table; tensors as in ``kvchat.kernels.layout``."""

    kv: KVLayer
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]

    def to(self, device: torch.device) -> Paged:
        return Paged(self.kv.to(device), self.block_table.to(device), self.seq_lens.to(device))

    def kv_bytes(self) -> int:
        """Bytes of K, V and scales that attention over all sequences reads."""
        tokens = int(self.seq_lens.sum())
        per_token = 2 * self.kv.k_cache[0, 0].numel() * self.kv.k_cache.element_size()
        if self.kv.k_scale is not None:
            per_token += 2 * self.kv.k_scale[0, 0].numel() * 4
        return tokens * per_token


def empty_pool(lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               device: torch.device, seed: int = 0) -> Paged:
    """Pool holding ``lens`` tokens per sequence behind a random block permutation (contents unset)."""
    from kvchat.kernels.layout import KVLayer

    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = max(1, sum(per_seq))
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(lens), max(1, max(per_seq)), dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        table[i, :n] = perm[start:start + n]
        start += n
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k = torch.empty(shape, dtype=dtype, device=device)
    scales = [torch.empty(shape[:3], device=device) for _ in range(2)] if dtype == FP8 else [None, None]
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    return Paged(KVLayer(k, torch.empty_like(k), *scales), table.to(device), lens_t)


def fill_random(pool: Paged) -> None:
    """Random finite contents without a quantization pass: fp8 bytes avoid the NaN codes 0x7F/0xFF."""
    for cache, scale in ((pool.kv.k_cache, pool.kv.k_scale), (pool.kv.v_cache, pool.kv.v_scale)):
        if cache.dtype == FP8:
            raw = torch.randint(0, 0x7F, cache.shape, dtype=torch.uint8, device=cache.device)
            raw |= torch.randint(0, 2, cache.shape, dtype=torch.uint8, device=cache.device) << 7
            cache.view(torch.uint8).copy_(raw)
            scale.uniform_(0.001, 0.01)
        else:
            cache.normal_()


def slots_of(pool: Paged, seq: int, positions: torch.Tensor) -> torch.Tensor:
    """int64 slots of token ``positions`` of sequence ``seq``."""
    table = pool.block_table[seq].long()
    return table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE


def write_sequences(kernels: Kernels, pool: Paged, act_dtype: torch.dtype) -> None:
    """Fill every sequence with random K/V through the Triton ``write_kv``."""
    _, _, num_kv_heads, head_dim = pool.kv.k_cache.shape
    device = pool.kv.k_cache.device
    for i, n in enumerate(pool.seq_lens.tolist()):
        slots = slots_of(pool, i, torch.arange(n, device=device))
        k = torch.randn(n, num_kv_heads, head_dim, device=device).to(act_dtype)
        kernels.write.write_kv(k, torch.randn_like(k), pool.kv, slots)


@dataclass(slots=True)
class Check:
    """One kernel-vs-reference comparison."""

    shape: str
    kernel: str
    pool: str
    max_err: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.max_err <= self.tol


def run_checks(kernels: Kernels, device: torch.device, tiny: bool) -> list[Check]:
    """(a): Triton kernels on ``device`` against the reference computed on CPU copies (tiny: SmolLM2 only)."""
    reference, triton_write, triton_decode, triton_extend = (
        kernels.reference, kernels.write, kernels.decode, kernels.extend)
    # the interpreter's bf16 arithmetic is wrong, so CPU runs check fp16 activations and pools
    act = torch.bfloat16 if device.type == "cuda" else torch.float16
    lens = [1, 17] if tiny else [1, 17, 1000, 4099]
    chunks = [(0, 9), (17, 3)] if tiny else [(0, 300), (1000, 77)]  # (cached prefix, new tokens)
    checks = []
    for shape in (["smollm2"] if tiny else SHAPES):
        num_heads, num_kv_heads, head_dim = SHAPES[shape]
        sm_scale = head_dim ** -0.5
        for pool_dtype in kv_dtypes(device):
            name = _name(pool_dtype)
            pool = empty_pool(lens, num_kv_heads, head_dim, pool_dtype, device)
            for cache in (pool.kv.k_cache, pool.kv.v_cache):
                cache.view(torch.uint8).zero_()
            mirror = pool.to("cpu")
            err = 0.0
            for i, n in enumerate(lens):
                k = torch.randn(n, num_kv_heads, head_dim, device=device).to(act)
                v = torch.randn_like(k)
                slots = slots_of(pool, i, torch.arange(n, device=device))
                triton_write.write_kv(k, v, pool.kv, slots)
                reference.write_kv(k.cpu(), v.cpu(), mirror.kv, slots.cpu())
            for mine, ref in ((pool.kv.k_cache, mirror.kv.k_cache), (pool.kv.v_cache, mirror.kv.v_cache),
                              (pool.kv.k_scale, mirror.kv.k_scale), (pool.kv.v_scale, mirror.kv.v_scale)):
                if mine is not None:
                    err += float((mine.cpu().view(torch.uint8) != ref.view(torch.uint8)).sum())
            checks.append(Check(shape, "write_kv (differing bytes)", name, err, 0.0))

            # bf16/fp16 outputs round to 2**-8 / 2**-11 relative; the kernels also round p*v_scale to that dtype
            tol = 2e-2 if act == torch.bfloat16 else 4e-3
            q = torch.randn(len(lens), num_heads, head_dim, device=device).to(act)
            out = triton_decode.decode_attention(q, pool.kv, pool.block_table, pool.seq_lens, sm_scale)
            ref = reference.decode_attention(q.cpu(), mirror.kv, mirror.block_table, mirror.seq_lens, sm_scale)
            checks.append(Check(shape, "decode_attention (max abs err)", name, _err(out, ref), tol))
            if pool.kv.k_scale is not None and device.type == "cuda":  # the bit conversion GPUs below sm_89 run
                out = triton_decode.paged_decode(q, pool.kv, pool.block_table, pool.seq_lens, sm_scale, fp8_bits=True)
                checks.append(Check(shape, "decode_attention fp8 bits (max abs err)", name, _err(out, ref), tol))

            ext = empty_pool([p + n for p, n in chunks], num_kv_heads, head_dim, pool_dtype, device, seed=1)
            write_sequences(kernels, ext, act)
            ext_cpu = ext.to("cpu")
            cu = torch.tensor([0] + [n for _, n in chunks], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            q = torch.randn(int(cu[-1]), num_heads, head_dim, device=device).to(act)
            out = triton_extend.extend_attention(q, ext.kv, ext.block_table, ext.seq_lens, cu.to(device), sm_scale)
            ref = reference.extend_attention(q.cpu(), ext_cpu.kv, ext_cpu.block_table, ext_cpu.seq_lens, cu, sm_scale)
            checks.append(Check(shape, "extend_attention (max abs err)", name, _err(out, ref), tol))
            if ext.kv.k_scale is not None and device.type == "cuda":
                out = triton_extend.extend_attention(q, ext.kv, ext.block_table, ext.seq_lens, cu.to(device), sm_scale,
                                                     fp8_bits=True)
                checks.append(Check(shape, "extend_attention fp8 bits (max abs err)", name, _err(out, ref), tol))
    return checks


def _name(dtype: torch.dtype) -> str:
    return "fp8" if dtype == FP8 else str(dtype).removeprefix("torch.")


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.cpu().float() - ref.float()).abs().max())


def time_ms(fn, device: torch.device, reps: int, graph: bool = False) -> float:
    """Median ms of ``fn()``; on CUDA with CUDA events and the L2 cache flushed before each call.

    ``graph``: time the replay of a CUDA graph of ``fn()`` instead of the call, as a decode step's graph runs
    it: the device time alone, without the Python and launch time of the call (which, for a kernel of tens of
    microseconds, the GPU otherwise waits on between the events).
    """
    fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    if graph:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()  # warm on the capturing stream (allocator pools, lazy inits)
        torch.cuda.current_stream(device).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
        fn()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> float:
    """(b): GB/s of ``dst.copy_(src)`` counting bytes read + bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_ms(lambda: dst.copy_(src), device, reps) / 1e6


@dataclass(slots=True)
class Row:
    """One timing: decode-attention or cache-write. ``ms``: the device time (a CUDA graph's replay on a GPU);
    ``ms_call``: one call from Python, its launch overhead included; ``gbps`` and ``frac_copy`` from ``ms``."""

    what: str
    kv_dtype: str
    context: int
    batch: int
    ms: float
    gbps: float
    frac_copy: float
    ms_call: float | None = None
    tiles: str = ""


def _decode_setup(kernels: Kernels, device: torch.device, shape: str, kv_dtype, batch: int, context: int):
    """A random pool of ``batch`` sequences of ``context`` tokens and a query: ``(args, bytes one call reads)``."""
    num_heads, num_kv_heads, head_dim = SHAPES[shape]
    act = torch.bfloat16 if device.type == "cuda" else torch.float16
    pool = empty_pool([context] * batch, num_kv_heads, head_dim, kv_dtype, device)
    fill_random(pool)
    q = torch.randn(batch, num_heads, head_dim, device=device).to(act)
    args = (q, pool.kv, pool.block_table, pool.seq_lens, head_dim**-0.5)
    return args, pool.kv_bytes() + 2 * q.numel() * q.element_size()


def decode_table(kernels: Kernels, device: torch.device, contexts: list[int], batches: list[int],
                 shape: str, copy_gbps: float, reps: int) -> list[Row]:
    """(c): time ``decode_attention`` over a random pool, all sequences at ``context`` tokens: the device time
    (graph replay on CUDA) and one call's time."""
    rows = []
    for kv_dtype in kv_dtypes(device):
        for batch in batches:
            for context in contexts:
                args, nbytes = _decode_setup(kernels, device, shape, kv_dtype, batch, context)
                fn = functools.partial(kernels.decode.decode_attention, *args)
                ms, call = time_ms(fn, device, reps, graph=device.type == "cuda"), time_ms(fn, device, reps)
                gbps = nbytes / ms / 1e6
                rows.append(Row("decode", _name(kv_dtype), context, batch, ms, gbps, gbps / copy_gbps, call))
                if kv_dtype == FP8 and device.type == "cuda":  # fp8-bits: the path of GPUs below sm_89 (3090, A100)
                    f16 = dataclasses.replace(kernels.decode.DEFAULT_TILES, f16_math=True)
                    for name, kw in (("fp8-bits", {"fp8_bits": True}), ("fp8-f16", {"tiles": f16}),
                                     ("fp8-bits-f16", {"fp8_bits": True, "tiles": f16})):
                        ms = time_ms(functools.partial(kernels.decode.paged_decode, *args, **kw), device, reps, graph=True)
                        gbps = nbytes / ms / 1e6
                        rows.append(Row("decode", name, context, batch, ms, gbps, gbps / copy_gbps))
    return rows


SWEEP_TILES = [(128, 4, 3), (64, 4, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3), (128, 4, 4), (128, 8, 2), (128, 8, 3)]
"""(block_n, num_warps, num_stages) of the sweep; the first is ``triton_decode.DEFAULT_TILES``."""
SWEEP_WAVES = (1, 2, 4)


def decode_sweep(kernels: Kernels, device: torch.device, contexts: list[int], batches: list[int],
                 shape: str, copy_gbps: float, reps: int, tilings=SWEEP_TILES, waves_list=SWEEP_WAVES) -> list[Row]:
    """(c): the split kernel's device time under other launches: tile size x warps x stages
    (``tilings``, ``triton_decode.DecodeTiles``) and split waves (``waves_list``: splits for that many
    programs per SM, ``triton_decode.splits_for``); ``tiles`` names each as ``n64w4s3x1``. fp8 pools also run
    each tiling at :data:`triton_decode.SPLIT_WAVES` with ``f16_math`` (named with an ``h``: ``n64w4s3x2h``)."""
    dec = kernels.decode
    sms = dec.num_sms(device)
    rows = []
    for kv_dtype in kv_dtypes(device):
        for batch in batches:
            for context in contexts:
                args, nbytes = _decode_setup(kernels, device, shape, kv_dtype, batch, context)
                _, kv, table, _, _ = args
                num_kv_heads, capacity = kv.k_cache.shape[2], table.shape[1] * kv.k_cache.shape[1]
                for block_n, warps, stages in tilings:
                    f16 = [(dec.SPLIT_WAVES, True)] if kv_dtype == FP8 else []
                    for waves, f16_math in [(w, False) for w in waves_list] + f16:
                        splits = dec.splits_for(batch, num_kv_heads, capacity, sms, waves)
                        fn = functools.partial(dec.paged_decode, *args, num_splits=splits,
                                               split_tokens=dec.MIN_TOKENS_PER_SPLIT,
                                               tiles=dec.DecodeTiles(block_n, warps, stages, f16_math))
                        name = f"n{block_n}w{warps}s{stages}x{waves}" + ("h" if f16_math else "")
                        try:
                            ms = time_ms(fn, device, reps, graph=device.type == "cuda")
                        except Exception as exc:  # e.g. a tiling over the SM's shared memory: that row says so
                            print(f"sweep {name}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
                            continue
                        gbps = nbytes / ms / 1e6
                        rows.append(Row("sweep", _name(kv_dtype), context, batch, ms, gbps, gbps / copy_gbps,
                                        tiles=name))
    return rows


def write_rows(kernels: Kernels, device: torch.device, num_tokens: int, shape: str,
               copy_gbps: float, reps: int) -> list[Row]:
    """Cache-write bandwidth: bytes = K/V read + pool (and scales) written + slot_mapping read."""
    _, num_kv_heads, head_dim = SHAPES[shape]
    act = torch.bfloat16 if device.type == "cuda" else torch.float16
    rows = []
    for kv_dtype in kv_dtypes(device):
        pool = empty_pool([num_tokens], num_kv_heads, head_dim, kv_dtype, device)
        k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(act)
        v = torch.randn_like(k)
        slots = slots_of(pool, 0, torch.arange(num_tokens, device=device))
        args = (k, v, pool.kv, slots)
        ms = time_ms(functools.partial(kernels.write.write_kv, *args), device, reps, graph=device.type == "cuda")
        nbytes = 2 * k.numel() * (k.element_size() + pool.kv.k_cache.element_size()) + slots.numel() * 8
        if pool.kv.k_scale is not None:
            nbytes += 2 * num_tokens * num_kv_heads * 4
        gbps = nbytes / ms / 1e6
        rows.append(Row("write", _name(kv_dtype), num_tokens, 1, ms, gbps, gbps / copy_gbps))
    return rows


SMOLLM2_HF = {  # SmolLM2-135M-Instruct's config.json numbers (weights are random here)
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
}


def random_weights(hf: dict, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face-named random weights (normal, std 0.02; norms 1) for a llama ``config.json`` dict."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = hf["hidden_size"], hf["intermediate_size"]
    head_dim = hidden // hf["num_attention_heads"]
    q, kv = hidden, hf["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (hf["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                       p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
    return {name: (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02).to(dtype)
            for name, shape in shapes.items()}


def engine_decode_tokens_per_s(device: torch.device, tiny: bool, kv_dtype: str = "fp8") -> tuple[float, int]:
    """(d): greedy decode tokens/s of kvchat's engine with random SmolLM2-shaped weights, batch 1.

    Prefills a random prompt (512 tokens; tiny: a 2-layer, 64-wide, 4/2-head model and
    20 tokens), runs 5 warm-up steps, then times the decode steps one by one
    as the chat app does (``Engine.decode`` + argmax). Attention goes through
    the ``kvchat.kernels`` dispatch (Triton on CUDA).

    Returns:
        ``(tokens_per_s, steps)``.
    """
    load_kernels()  # kvchat and kvchat.kernels from this checkout
    from kvchat.engine.block_manager import SeqBlocks
    from kvchat.engine.loop import run_alone
    from kvchat.engine.runner import Engine
    from kvchat.model.config import ModelConfig

    hf = dict(SMOLLM2_HF)
    if tiny:
        hf.update(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    prompt, steps = (20, 3) if tiny else (512, 200)
    cfg = ModelConfig.from_hf(hf)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    engine = Engine(cfg, random_weights(hf, dtype), "bench-random-weights", kv_dtype=kv_dtype,
                    pool_bytes=2**30 if device.type == "cuda" else 2**24, device=device)
    ids = torch.randint(0, cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = SeqBlocks()
    logits = run_alone(engine, engine.prefill_steps(seq, ids)).logits
    for step in range(5 + steps):
        if step == 5:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        ids.append(int(logits.argmax()))
        logits = engine.decode(seq, ids)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return steps / (time.perf_counter() - start), steps


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run (a)-(d), print the results; 1 if a check failed, 2 without GPU or interpreter, else 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke run under TRITON_INTERPRET=1)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b", help="layer shape of the timing table")
    ap.add_argument("--contexts", type=int, nargs="+", help="context lengths in tokens for the decode table")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="batch sizes for the decode table")
    ap.add_argument("--reps", type=int, help="timed repetitions per measurement")
    ap.add_argument("--json", type=Path, help="also write all results to this JSON file")
    args = ap.parse_args(argv)

    kernels = load_kernels()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not kernels.decode.INTERPRETED:
        print("no GPU: run with TRITON_INTERPRET=1 (and --tiny) to execute the kernels on CPU", file=sys.stderr)
        return 2
    contexts = args.contexts or ([40] if args.tiny else [1 << k for k in range(10, 18)])
    batches = [1, 2] if args.tiny else args.batches
    reps = args.reps or (1 if args.tiny else 20)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"kvchat kernel bench: {gpu}, torch {torch.__version__}, triton {_triton_version()}")

    checks = run_checks(kernels, device, args.tiny)
    for c in checks:
        print(f"check {c.shape:10s} {c.pool:8s} {c.kernel:32s} {c.max_err:10.3g} (tol {c.tol:g}) "
              f"{'ok' if c.ok else 'FAIL'}")
    copy_gbps = copy_bandwidth(device, (1 << 16) if args.tiny else (1 << 30), reps)
    print(f"copy bandwidth: {copy_gbps:.4g} GB/s (read + write)")
    rows = decode_table(kernels, device, contexts, batches, args.shape, copy_gbps, reps)
    rows += write_rows(kernels, device, 16 if args.tiny else 16 * 4096, args.shape, copy_gbps, reps)
    print(f"{'kernel':7s} {'kv':8s} {'context':>8s} {'batch':>5s} {'ms':>9s} {'GB/s':>8s} {'of copy':>7s}")
    for r in rows:
        print(f"{r.what:7s} {r.kv_dtype:8s} {r.context:8d} {r.batch:5d} {r.ms:9.4f} {r.gbps:8.1f} {r.frac_copy:7.1%}")
    engine = {}
    for kv_dtype in kv_dtypes(device, names=True):
        tps, steps = engine_decode_tokens_per_s(device, args.tiny, kv_dtype)
        engine[kv_dtype] = tps
        model = "tiny 2-layer" if args.tiny else "SmolLM2-135M-shaped"
        print(f"engine decode ({model} random weights, {kv_dtype} KV, batch 1): {tps:.1f} tokens/s, {steps} steps")
    if args.json:
        args.json.write_text(json.dumps({
            "device": gpu, "copy_gbps": copy_gbps, "checks": [asdict(c) | {"ok": c.ok} for c in checks],
            "rows": [asdict(r) for r in rows], "engine_decode_tokens_per_s": engine,
        }, indent=2))
    return 0 if all(c.ok for c in checks) else 1


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "absent"
    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
