"""The fp8 scheme's two refinements: K centring (kvchat.engine.calibration) and the exact attention sink.

Their effect on quality is measured by test_fidelity.py on the real model;
here: the mechanics, the identity (fingerprints), determinism and storage.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from turn_helpers import prefill

from kvchat.engine.block_manager import SeqBlocks
from kvchat.engine.calibration import calibration_path, load_calibration, make_calibration
from kvchat.engine.inference import inference
from kvchat.engine.runner import Engine
from kvchat.engine.scratch import calibrate_k_mean
from kvchat.kernels import dispatch
from kvchat.kernels import reference as ref
from kvchat.model.config import ModelConfig
from kvchat.runtime import ensure_calibration


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                                      initializer_range=0.25)
    weights = dict(transformers.AutoModelForCausalLM.from_config(hf_cfg).state_dict())
    return ModelConfig.from_hf(hf_cfg.to_dict()), weights


def _engine(tiny, **kw) -> Engine:
    cfg, weights = tiny
    kw = {"kv_dtype": "fp8", "pool_bytes": 2**20, "device": "cpu"} | kw
    return Engine(cfg, weights, "tiny", **kw)


def _stored_k(engine: Engine, seq: SeqBlocks, n: int) -> torch.Tensor:
    """Dequantized K ``[layers, n, kv_heads, head_dim]`` as the pool holds them."""
    table = torch.tensor(seq.block_table)
    return torch.stack([ref.gather_kv(engine.pool.k[i], engine.pool.k_scale[i], table, n)
                        for i in range(engine.cfg.num_layers)])


def test_k_centring_stores_k_minus_the_calibrated_mean(tiny):
    ids = torch.randint(0, 97, (120,)).tolist()
    k_mean = calibrate_k_mean(_engine(tiny, kv_dtype="bf16"), torch.randint(0, 97, (200,)).tolist())
    cal = make_calibration(k_mean * 0 + 3.0 + k_mean, "test")  # a large offset, so the subtraction shows
    centred, plain = _engine(tiny, calibration=cal, exact_sink=False), _engine(tiny, exact_sink=False)
    seqs = [SeqBlocks(), SeqBlocks()]
    logits = [prefill(e, s, ids).logits for e, s in zip((centred, plain), seqs)]
    # Layer 0's K depend on the token embeddings alone, so both engines computed the same K there
    # (later layers see attention outputs that carry each scheme's own rounding).
    got, uncentred = _stored_k(centred, seqs[0], len(ids))[0], _stored_k(plain, seqs[1], len(ids))[0]
    want = uncentred - cal.k_mean[0]
    # Both sides are e4m3 (3 mantissa bits): relative error <= 2**-4 each, plus the row scale's subnormal step.
    assert ((got - want).abs() <= (got.abs() + uncentred.abs()) * 2**-4 + 1e-2).all()
    assert not torch.allclose(got, uncentred, atol=1.0)
    assert all(x.isfinite().all() for x in logits)


def test_shifting_every_k_by_one_vector_leaves_attention_unchanged():
    """Why centring is free: each query's scores all move by q . m, which softmax ignores."""
    torch.manual_seed(2)
    q, k, v = torch.randn(7, 6, 16), torch.randn(2, 40, 16), torch.randn(2, 40, 16)
    m = torch.randn(2, 1, 16) * 5
    torch.testing.assert_close(ref.dense_attention(q, k - m, v, 33, 0.25), ref.dense_attention(q, k, v, 33, 0.25),
                               rtol=0, atol=1e-5)
    assert not torch.allclose(ref.dense_attention(q, k, v - m, 33, 0.25), ref.dense_attention(q, k, v, 33, 0.25))


def test_calibration_only_shapes_fp8_pools_and_enters_the_fingerprint(tiny):
    cfg = tiny[0]
    cal = make_calibration(torch.randn(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim), "a")
    other = make_calibration(cal.k_mean + 1e-3, "b")
    fps = {name: _engine(tiny, **kw) for name, kw in {
        "plain": {"exact_sink": False}, "kc": {"calibration": cal, "exact_sink": False},
        "kc-other": {"calibration": other, "exact_sink": False}, "kc+sink": {"calibration": cal}}.items()}
    assert [e.scale_scheme for e in fps.values()] == ["pth1", "pth1+kc", "pth1+kc", "pth1+kc+sink"]
    assert len({e.cache_fingerprint for e in fps.values()}) == 4  # a new calibration never restores old K/V
    bf16 = [_engine(tiny, kv_dtype="bf16", calibration=c) for c in (None, cal)]
    assert bf16[0].cache_fingerprint == bf16[1].cache_fingerprint and bf16[1].scale_scheme == "none"
    assert bf16[1].model.layers[0].self_attn.k_shift is None


def test_exact_sink_is_deterministic_close_to_the_stored_value_and_read_by_both_paths(tiny):
    ids = torch.randint(0, 97, (70,)).tolist()
    a, b = _engine(tiny, dense_kv=True), _engine(tiny, dense_kv=False)
    sink = a.sink_kv(ids[0])
    assert all(torch.equal(x, y) for x, y in zip(sink, b.sink_kv(ids[0])))  # any process, any read path
    seqs = [SeqBlocks(), SeqBlocks()]
    logits = [prefill(e, s, ids).logits for e, s in zip((a, b), seqs)]
    stored = _stored_k(a, seqs[0], 1)[:, 0]
    assert not torch.equal(stored, sink[0])
    assert ((stored - sink[0]).abs() <= sink[0].abs() * 2**-4 + 1e-2).all()
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-4 * logits[1].abs().max().item())
    # Both paths read the sink, not the pool: change it and the next step changes.
    before = [e.decode(s, ids + [5]) for e, s in zip((a, b), seqs)]
    for e, s in zip((a, b), seqs):
        with inference():  # the engine makes its sink under inference mode: change it there
            e.sink_kv(ids[0])[1].mul_(3.0)
        s.num_computed -= 1
        e.decode_buffers.sink_rows[0] = None  # the decode buffers took the sink into row 0: make them copy it again
    a.dense.length = 0  # the dense copy took the sink when it read position 0: make it read again
    after = [e.decode(s, ids + [5]) for e, s in zip((a, b), seqs)]
    for x, y in zip(before, after):
        assert (x - y).abs().max() > 1e-3


def test_triton_engines_read_the_exact_sink_under_the_torch_fingerprint(tiny, monkeypatch):
    """Both backends run ``pth1+sink`` under one fingerprint (a chat made on one restores on the other),
    agree on the logits, and the Triton kernels read the sink, not the pool's position 0."""
    ids = torch.randint(0, 97, (40,)).tolist()
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    torch_engine = _engine(tiny)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    triton_engine = _engine(tiny)
    assert triton_engine.exact_sink and triton_engine.dense is None
    assert (triton_engine.scale_scheme, triton_engine.cache_fingerprint) == (
        torch_engine.scale_scheme, torch_engine.cache_fingerprint)
    assert triton_engine.scale_scheme == "pth1+sink"
    logits = []
    for backend, engine in (("torch", torch_engine), ("triton", triton_engine)):
        monkeypatch.setenv(dispatch.ENV_VAR, backend)
        logits.append(prefill(engine, SeqBlocks(), ids).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-4 * logits[0].abs().max().item())
    seq = SeqBlocks()
    prefill(triton_engine, seq, ids)
    before = triton_engine.decode(seq, ids + [5])
    with inference():  # the sink was made inside the prefill's inference mode
        triton_engine.sink_kv(ids[0])[1].mul_(3.0)
    seq.num_computed -= 1
    triton_engine.decode_buffers.sink_rows[0] = None  # the decode buffers took the sink into row 0: copy it again
    assert (triton_engine.decode(seq, ids + [5]) - before).abs().max() > 1e-3


def test_calibration_is_computed_once_stored_and_recomputed_if_damaged(smol_info, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from kvchat import runtime
    from kvchat.model.registry import load_weights

    monkeypatch.setenv("KVCHAT_MODELS", str(tmp_path / "models"))  # the shared models dir stays untouched
    weights, tok = load_weights(smol_info), AutoTokenizer.from_pretrained(str(smol_info.path))
    first = ensure_calibration(smol_info, weights, tok)
    path = calibration_path(smol_info.fingerprint)
    assert path.is_file() and path.stat().st_mode & 0o777 == 0o600
    cfg = smol_info.config
    assert first.k_mean.shape == (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    assert first.k_mean.abs().max() > 1.0  # SmolLM2's K do carry large steady offsets

    def no_recompute(*a, **k):
        raise AssertionError("recomputed a stored calibration")

    monkeypatch.setattr(runtime, "calibrate_k_mean", no_recompute)
    assert ensure_calibration(smol_info, weights, tok).digest == first.digest
    monkeypatch.undo()
    monkeypatch.setenv("KVCHAT_MODELS", str(tmp_path / "models"))
    path.write_bytes(path.read_bytes()[:100])  # truncated
    assert load_calibration(smol_info.fingerprint, tuple(first.k_mean.shape)) is None
    assert ensure_calibration(smol_info, weights, tok).digest == first.digest  # recomputed: deterministic
