"""int8 and int4 weights, teacher-forced against fp32 weights on a real seed article:
the protocol of ``kvchat bench fidelity``, the default fp8 pool, every kernel of each format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kvchat.bench.fidelity import GOAL_PPL_DELTA_PCT
from kvchat.bench.weight_fidelity import compare_weights, kernel_chunks, weight_formats
from kvchat.kernels import cpu_int8
from kvchat.model.registry import load_weights
from kvchat.runtime import ensure_calibration

SEEDS = Path(__file__).resolve().parents[3] / "shared" / "seeds"
TOKENS = 2048
# measured here on 000_*.txt, fp8 pool: groups of 32 on the compiled kernel (where it builds): Δppl +0.06% / -0.24%,
# mean KL 0.0034 / 0.0034, top-1 0.967 / 0.962 (32-token / 512-token chunks); per channel on torch's kernel (where
# it does not): -0.27% / -0.22%, KL 0.0102 / 0.0089, top-1 0.926 / 0.943; bounds with room for that scheme, thread
# counts and machines
BOUNDS = {True: (0.006, 0.95), False: (0.02, 0.90)}  # compiled groups scheme or not: (max mean KL, min top-1)
INT4_GOAL_PPL_DELTA_PCT = 1.0  # the int4 target: within +1% perplexity of fp32 weights
# measured: see docs/performance.md ("4-bit weights"); the imported weights are Q4_1 blocks, which int4 groups of 32
# hold exactly, so the weights cost nearly nothing, but int4 layers multiply int8-quantized activations (llama.cpp's
# Q8_1): on 000's first 1,024 tokens mean KL 0.0059 / 0.0057 and top-1 0.953 / 0.951 (32- / 512-token chunks),
# over the five texts measured KL 0.0049-0.0063, top-1 0.946-0.966; bounds with room for thread counts and machines
INT4_BOUNDS = (0.009, 0.93)


def test_int8_and_int4_weights_within_their_goals_of_fp32_perplexity(smol_info):
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(smol_info.path))
        paths = sorted(SEEDS.glob("*.txt")) if SEEDS.is_dir() else []
        if not paths:
            pytest.skip(f"seed articles not found at {SEEDS} (CI keeps shared/ beside the clone)")
        ids = tokenizer(paths[0].read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"][:TOKENS]
        assert len(ids) == TOKENS
        weights = load_weights(smol_info)
        calibration = ensure_calibration(smol_info, weights, tokenizer)
        rows = compare_weights(smol_info, weights, calibration, [(paths[0].name, ids)], pools=("fp8",))
    finally:
        torch.set_num_threads(old)
    assert {(r.weights, r.kernel) for r in rows} == {(f, k) for f in weight_formats() for k in kernel_chunks(f)}
    for r in rows:
        res = r.result
        goal, (max_kl, min_top1) = ((INT4_GOAL_PPL_DELTA_PCT, INT4_BOUNDS) if r.weights == "int4"
                                    else (GOAL_PPL_DELTA_PCT, BOUNDS[cpu_int8.available()]))
        assert res.positions == TOKENS - 1
        assert res.ppl_delta_pct <= goal, r.as_dict()
        assert 0 < res.mean_kl <= max_kl and res.top1_agreement >= min_top1, r.as_dict()
