"""A decode step's kernel launches (kvchat/bench/launch_count.py) on the GPU path: the Triton kernels,
fused (kvchat/kernels/triton_fused.py), fp8 pool with K centring and the exact sink.

A tiny random-weight Llama runs under the Triton interpreter on a CPU (fp32 compute: the interpreter
computes bf16 wrongly; the model takes the same branches in every dtype but fp32's one-op RMSNorm,
which the fused path does not run) and on CUDA in bf16 where there is one.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)
CUDA = torch.cuda.is_available()
if not CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported (see tests/kernels/test_kernels_triton.py)

import transformers  # noqa: E402
from turn_helpers import prefill  # noqa: E402

from kvchat.bench.launch_count import LaunchCounter, decode_step_launches  # noqa: E402
from kvchat.engine.block_manager import SeqBlocks  # noqa: E402
from kvchat.engine.calibration import make_calibration  # noqa: E402
from kvchat.engine.runner import Engine  # noqa: E402
from kvchat.kernels import dispatch, triton_fused  # noqa: E402
from kvchat.kernels.reference import dequantize_fp8  # noqa: E402
from kvchat.model.config import ModelConfig  # noqa: E402

if not CUDA and not triton_fused.INTERPRETED:
    pytest.skip("Triton was imported earlier in this process without TRITON_INTERPRET=1", allow_module_level=True)

MAX_LAUNCHES_PER_LAYER = 14


@pytest.fixture(scope="module")
def tiny():
    hf_cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      initializer_range=0.25)
    torch.manual_seed(0)
    weights = dict(transformers.AutoModelForCausalLM.from_config(hf_cfg).state_dict())
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    k_mean = torch.randn(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, generator=torch.Generator().manual_seed(1))
    return cfg, weights, make_calibration(k_mean, "test")


@pytest.fixture
def engine(tiny, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    cfg, weights, cal = tiny
    return Engine(cfg, weights, "tiny", kv_dtype="fp8", pool_bytes=2**20, device="cuda" if CUDA else "cpu",
                  dtype="bf16" if CUDA else "fp32", calibration=cal)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_decode_step_runs_in_at_most_14_launches_per_layer_and_reads_no_setting(engine, monkeypatch):
    assert engine.model.kernels.backend == "triton" and engine.model.kernels.fused is triton_fused
    ids = _ids(20, 1)
    seq = SeqBlocks()
    prefill(engine, seq, ids)
    ids.append(5)
    engine.decode(seq, ids)  # the row's block table and sink uploaded
    monkeypatch.setenv(dispatch.ENV_VAR, "no-such-backend")  # read during the step, it would raise
    ids.append(6)
    counter, logits = decode_step_launches(engine, seq, ids)
    assert counter.layers_run == engine.cfg.num_layers
    assert counter.per_layer <= MAX_LAUNCHES_PER_LAYER, dict(counter.layer_ops)
    # the fused kernels ran, the operators they replace did not
    assert {"_add_rms_norm_kernel", "_rope_write_kernel", "_silu_mul_kernel"} <= set(counter.layer_ops)
    assert not {"_write_kv_kernel", "rsqrt", "addcmul", "silu", "pow"} & set(counter.layer_ops)
    # nothing copied that did not change: the step's ids/positions/slots/lengths upload and the lengths' cast
    assert counter.outside_ops["copy_"] == 2, dict(counter.outside_ops)
    assert logits.isfinite().all()


def test_fused_decode_matches_the_operators_within_the_documented_tolerance(engine):
    """Twin sequences (a fork of one prefill) decode 3 steps, one on the fused kernels and one on the
    operators they replace (the same engine with ``fused`` off); the steps' logits agree to 1e-4 of their
    range in fp32 (the kernels differ from the operators by one ulp at most, triton_fused's module doc) and
    the K/V they store agree within one fp8 step."""
    if engine.decode_graphs is not None:  # eager steps: a graph's replay would run neither choice of kernels
        engine.decode_graphs.enabled = False
    ids = _ids(40, 2)
    seq = SeqBlocks()
    prefill(engine, seq, ids[:-1])
    twin = engine.blocks.fork(seq, len(ids) - 1)
    fused = engine.model.kernels
    plain = dispatch.KernelChoice(fused.backend)
    pool, bs = engine.pool, engine.spec.block_size
    for _ in range(3):
        engine.model.kernels = fused
        with LaunchCounter(engine.model.layers) as counter:
            a = engine.decode(seq, ids)
        engine.model.kernels = plain
        with LaunchCounter(engine.model.layers) as unfused:
            b = engine.decode(twin, ids)
        assert "_rope_write_kernel" in counter.layer_ops and "_rope_write_kernel" not in unfused.layer_ops
        span = float(b.max() - b.min())
        assert float((a - b).abs().max()) <= (1e-4 if engine.dtype == torch.float32 else 2e-2) * span
        n = len(ids)
        for cache, scale in ((pool.k, pool.k_scale), (pool.v, pool.v_scale)):  # [layers, kv_heads, head_dim]
            got, want = (dequantize_fp8(cache[:, s // bs, s % bs], scale[:, s // bs, s % bs])
                         for s in (engine.blocks.slots(x, n - 1, n)[0] for x in (seq, twin)))
            assert bool(((got - want).abs() <= want.abs() * 2**-3 + scale.max() * 2**-9).all())
        ids.append(int(b.argmax()))
