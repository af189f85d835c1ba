"""Run the compiled CPU kernels on fixed random inputs and save every output (``torch.save``), for
test_cpu_variants.py to compare one build's bits with another's: ``python kernel_outputs.py OUT.pt``.

Covers the int8 and int4 matmuls (int4: both kernels; row counts 1-17, channel counts with odd tails), the paged decode attention
(fp8, bf16, fp16 pools; head dims 16, 32, 64, 128; odd and even query heads per KV head; lengths around the
128-token ranges; with and without the exact sink) and a random-weight engine's compiled chunk and decode
step (fp8 and bf16 pools, int8 and int4 weights, 3 query heads per KV head): their hidden states, logits and every
pool byte.
The libraries that ran are saved by file name under ``"libraries"`` (their names say the build).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

from kvchat.engine.block_manager import SeqBlocks
from kvchat.engine.loop import run_alone
from kvchat.engine.runner import Engine
from kvchat.kernels import cpu_attention, cpu_decode, cpu_int4, cpu_int8
from kvchat.kernels import reference as ref
from kvchat.kernels.layout import KVLayer
from kvchat.model.config import ModelConfig

POOL_DTYPES = {"fp8": ref.FP8_DTYPE, "bf16": torch.bfloat16, "fp16": torch.float16}


def _int8(out: dict) -> None:
    gen = torch.Generator().manual_seed(0)
    for m in range(1, 18):
        for n, groups in ((13, 3), (40, 18), (7, 1)):
            x = torch.randn(m, 32 * groups, generator=gen)
            q = torch.randint(-128, 128, (n, 32 * groups), dtype=torch.int8, generator=gen)
            scale, offset = torch.rand(n, groups, generator=gen), torch.randn(n, groups, generator=gen)
            out[f"int8 {m}x{n}x{groups}"] = cpu_int8.int8_matmul(x, q, scale, offset)


def _int4(out: dict) -> None:
    gen = torch.Generator().manual_seed(3)
    for m in range(1, 18):
        for n, groups in ((13, 3), (40, 18), (7, 1)):
            x = torch.randn(m, 32 * groups, generator=gen)
            packed = torch.randint(0, 256, (n, 16 * groups), dtype=torch.uint8, generator=gen)
            scale, minimum = torch.rand(n, groups, generator=gen).half(), torch.randn(n, groups, generator=gen).half()
            out[f"int4 {m}x{n}x{groups}"] = cpu_int4.int4_matmul(x, packed, scale, minimum)
        for n, groups in ((16, 3), (48, 18)):  # the channel-lanes kernel: blocks of 16 output channels
            x = torch.randn(m, 32 * groups, generator=gen)
            packed = torch.randint(0, 256, (n, 16 * groups), dtype=torch.uint8, generator=gen)
            scale, minimum = torch.rand(n, groups, generator=gen).half(), torch.randn(n, groups, generator=gen).half()
            out[f"int4 lanes {m}x{n}x{groups}"] = cpu_int4.int4_matmul(x, packed, scale, minimum, lanes=True)


def _attention(out: dict) -> None:
    gen = torch.Generator().manual_seed(1)
    for kv_dtype, dtype in POOL_DTYPES.items():
        for heads, hkv, d in ((9, 3, 64), (4, 4, 32), (8, 2, 16), (16, 2, 128)):
            shape = (90, 16, hkv, d)
            scales = (torch.zeros(shape[:3]), torch.zeros(shape[:3])) if kv_dtype == "fp8" else (None, None)
            pool = KVLayer(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), *scales)
            slots = torch.arange(90 * 16)
            ref.write_kv(torch.randn(len(slots), hkv, d, generator=gen) * 2, torch.randn(len(slots), hkv, d, generator=gen),
                         pool, slots)
            lengths = [1, 127, 129, 300, 7]
            perm = torch.randperm(90, generator=gen).tolist()
            table = torch.zeros(len(lengths), 20, dtype=torch.int32)
            used = 0
            for i, length in enumerate(lengths):
                nb = -(-length // 16)
                table[i, :nb] = torch.tensor(perm[used : used + nb], dtype=torch.int32)
                used += nb
            lens = torch.tensor(lengths, dtype=torch.int32)
            q = torch.randn(len(lengths), heads, d, generator=gen)
            for sink in (None, (torch.randn(len(lengths), hkv, d, generator=gen), torch.randn(len(lengths), hkv, d, generator=gen))):
                got = cpu_attention.decode_attention(q, pool, table, lens, d**-0.5, sink)
                out[f"attention {kv_dtype} {heads}/{hkv}x{d} sink={sink is not None}"] = got


def _engine(out: dict) -> None:
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=384, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
                                      initializer_range=0.1)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    cfg, weights = ModelConfig.from_hf(hf_cfg.to_dict()), dict(model.state_dict())
    ids = torch.randint(0, 97, (230,), generator=torch.Generator().manual_seed(2)).tolist()
    for kv_dtype, fmt in (("fp8", "int8"), ("bf16", "int8"), ("fp8", "int4")):
        engine = Engine(cfg, weights, "tiny", kv_dtype=kv_dtype, pool_bytes=2**22, device="cpu", weight_format=fmt)
        tag = kv_dtype if fmt == "int8" else f"{kv_dtype} {fmt}"
        assert engine.compiled_decode is not None, "the compiled layers do not run"
        seq = SeqBlocks()
        run_alone(engine, engine.prefill_steps(seq, ids[:200]))
        with torch.inference_mode():
            out[f"engine {tag} chunk"] = engine._forward(seq, ids[:215], 200, 215)
            engine.blocks.commit(seq, ids[:215], 215)
            out[f"engine {tag} decode"] = engine.decode(seq, ids[:216])
        for name, t in (("k", engine.pool.k), ("v", engine.pool.v), ("k_scale", engine.pool.k_scale),
                        ("v_scale", engine.pool.v_scale)):
            if t is not None:
                out[f"engine {tag} pool {name}"] = t.view(torch.uint8).clone()
        engine.release(seq)


def main(path: str) -> None:
    out: dict = {}
    _int8(out)
    _int4(out)
    _attention(out)
    _engine(out)
    out["libraries"] = sorted(Path(m._library()._name).name for m in (cpu_int8, cpu_int4, cpu_attention, cpu_decode))
    torch.save(out, path)


if __name__ == "__main__":
    main(sys.argv[1])
