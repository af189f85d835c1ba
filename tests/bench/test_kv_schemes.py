"""The FP8 schemes ``kvchat bench fidelity`` compares (kvchat.bench.kv_schemes); no real model needed."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvchat.bench.kv_schemes import all_schemes, write_fixed_scale
from kvchat.engine.calibration import make_calibration
from kvchat.engine.kv_pool import KVCacheSpec, KVPool
from kvchat.kernels import dispatch, reference
from kvchat.model.config import ModelConfig

LAYERS, KV_HEADS, HEAD_DIM = 2, 3, 64
T = 40  # crosses block boundaries; the block table is deliberately out of order
TABLE = [5, 2, 7]


def _slots() -> torch.Tensor:
    return torch.tensor([TABLE[p // 16] * 16 + p % 16 for p in range(T)])


def test_fixed_scale_clamps_outliers_instead_of_nan():
    pool = KVPool(KVCacheSpec(LAYERS, KV_HEADS, HEAD_DIM, "fp8"), 8)
    k = torch.full((T, KV_HEADS, HEAD_DIM), 1e4)
    k[1] = 0.3
    kv = pool.layer(0)
    write_fixed_scale(k, -k, kv, _slots(), scale=1.0)
    got = reference.gather_kv(kv.k_cache, kv.k_scale, torch.tensor(TABLE), T)
    assert not got.isnan().any()
    assert got[0].eq(448.0).all() and got[1].sub(0.3).abs().max() < 0.3 / 8  # e4m3: 3 mantissa bits
    assert kv.k_scale[5, :2].eq(1.0).all()


def test_fixed_scale_dispatch_is_restored_after_an_error():
    fixed = next(s for s in all_schemes() if s.fixed_scale is not None)
    original = dispatch.write_kv
    with pytest.raises(RuntimeError), fixed.active():
        assert dispatch.write_kv is not original
        raise RuntimeError("leave the block early")
    assert dispatch.write_kv is original


def test_every_engine_scheme_runs_under_its_own_name():
    """The benchmark's row labels are the engines' own ``scale_scheme`` (fixed-1.0 is the write override)."""
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
    weights = dict(transformers.AutoModelForCausalLM.from_config(hf_cfg).state_dict())
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    cal = make_calibration(torch.randn(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim), "test")
    schemes = all_schemes()
    engines = [s.engine(cfg, weights, "test", cal, pool_bytes=2**20, device="cpu") for s in schemes]
    names = {s.name: e.scale_scheme for s, e in zip(schemes, engines)}
    assert names == {"pth1+kc+sink": "pth1+kc+sink", "pth1": "pth1", "fixed-1.0": "pth1", "pth1+kc": "pth1+kc"}
    assert len({e.cache_fingerprint for e in engines}) == 3  # fixed-1.0 is never stored, so it shares pth1's
