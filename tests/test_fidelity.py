"""FP8 pool fidelity, teacher-forced against the bf16 pool on a real seed article (issue 2, "Measured").

Every position's K/V are read back from the pool (Engine.score attends
through it), and the next-token distributions of the fp8 and bf16 runs are
compared position by position.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kvchat.bench.fidelity import compare_to_reference
from kvchat.bench.kv_schemes import default_scheme
from kvchat.engine import Engine
from kvchat.kv_cache import KVCacheSpec
from kvchat.model_registry import load_weights

SEEDS = Path(__file__).resolve().parents[2] / "shared" / "seeds"
TOKENS = 2048
# Bounds from issue 2; measured here with pth1 on 000_*.txt: KL ~0.0065, top-1 ~0.95.
MAX_MEAN_KL = 0.02
MIN_TOP1 = 0.93


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def _seed_ids(tokenizer) -> tuple[str, list[int]]:
    """The first seed article with at least TOKENS tokens, cut to TOKENS."""
    if not SEEDS.is_dir():
        pytest.skip(f"seed articles not found at {SEEDS} (CI keeps shared/ beside the clone)")
    for path in sorted(SEEDS.glob("*.txt")):
        ids = tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        if len(ids) >= TOKENS:
            return path.name, ids[:TOKENS]
    pytest.skip(f"no seed article in {SEEDS} has {TOKENS} tokens")


def test_fp8_pool_close_to_bf16_teacher_forced(smol_info, two_threads):
    name, ids = _seed_ids(AutoTokenizer.from_pretrained(str(smol_info.path)))
    cfg = smol_info.config
    weights = load_weights(smol_info)
    engines = {}
    for kv in ("bf16", "fp8"):
        spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv)
        engines[kv] = Engine(cfg, weights, smol_info.fingerprint, kv_dtype=kv, device="cpu",
                             pool_bytes=spec.bytes_per_block * (TOKENS // spec.block_size + 1))
    del weights
    assert engines["fp8"].pool.k.dtype == torch.float8_e4m3fn

    (res,) = compare_to_reference(engines["bf16"], engines["fp8"], ids, [default_scheme()], name)

    print(f"\n{name}: {res.positions} positions, ppl bf16 {res.ppl_ref:.3f} fp8 {res.ppl:.3f} "
          f"({res.ppl_delta_pct:+.2f}%), mean KL {res.mean_kl:.5f}, top-1 {res.top1_agreement:.4f}")
    assert res.positions == TOKENS - 1
    assert res.mean_kl > 0, "fp8 and bf16 pools gave identical distributions: quantization was not applied"
    assert res.mean_kl <= MAX_MEAN_KL
    assert res.top1_agreement >= MIN_TOP1
