"""CUDA graphs of decode (kvchat/engine/decode_graphs.py): the graph/eager choice everywhere; on a GPU
(skipped without one) replay against eager logits and the step's host syncs."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from turn_helpers import prefill

from kvchat import settings
from kvchat.engine.block_manager import SeqBlocks
from kvchat.engine.decode_graphs import DecodeGraphs, graphs_wanted
from kvchat.engine.sampling import Sampler, SamplingParams, sample_rows
from kvchat.engine.sequence import DecodeStep, Sequence

CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
gpu_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with Triton")


def test_graphs_only_on_cuda_with_triton_and_when_switched_on():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert graphs_wanted(cuda, "triton", True)
    assert not graphs_wanted(cuda, "triton", False)
    assert not graphs_wanted(cuda, "torch", True)  # the reference reads lengths on the host
    assert not graphs_wanted(cpu, "triton", True) and not graphs_wanted(cpu, "torch", True)


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False), ("", True)])
def test_the_switch(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("KVCHAT_CUDA_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("KVCHAT_CUDA_GRAPHS", value)
    assert settings.cuda_graphs() is on


def test_a_bad_switch_is_one_line(monkeypatch):
    monkeypatch.setenv("KVCHAT_CUDA_GRAPHS", "yes")
    with pytest.raises(settings.SettingError, match="KVCHAT_CUDA_GRAPHS must be one of 1, 0, got 'yes'"):
        settings.check()


def test_a_failed_capture_falls_back_to_eager_once(caplog):
    """On a CPU a capture cannot start (no CUDA): the step runs eagerly, the failure is said once."""
    calls = []

    def step(rows, width):
        calls.append((rows, width))
        return torch.full((rows, 3), float(len(calls)))

    graphs = DecodeGraphs(step)
    if torch.cuda.is_available():
        pytest.skip("a capture can start here")
    first = graphs(2, 16)
    assert graphs.failed is not None and graphs.captured == []
    second = graphs(2, 16)
    assert first.shape == second.shape == (2, 3) and float(second[0, 0]) == len(calls)
    assert sum("CUDA graph capture" in r.getMessage() for r in caplog.records) == 1


# ------------------------------------------------------------------ GPU only

@pytest.fixture(scope="module")
def gpu_engine(smol_info):
    from kvchat.engine.runner import Engine
    from kvchat.model.registry import load_weights

    return Engine(smol_info.config, load_weights(smol_info), smol_info.fingerprint, kv_dtype="fp8",
                  pool_bytes=2**26, device="cuda", dtype="bf16")


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@gpu_only
def test_graph_replay_equals_eager_logits(gpu_engine, smol_info):
    engine = gpu_engine
    assert engine.decode_graphs is not None, "graphs should be on by default on CUDA with Triton"
    graphs = engine.decode_graphs
    vocab = smol_info.config.vocab_size
    for batch in (1, 3):  # 3 runs padded to bucket 4
        seqs, twins = [], []
        for i in range(batch):
            p = _ids(200 + 90 * i, i, vocab)  # up to 380 tokens: context buckets 256 and 512
            for group in (seqs, twins):
                s = Sequence(token_ids=list(p))
                prefill(engine, s.blocks, p[:-1])
                group.append(s)
        for _ in range(4):
            graphs.enabled = True
            on = engine.decode_batch([DecodeStep(s, s.token_ids) for s in seqs])
            graphs.enabled = False
            off = engine.decode_batch([DecodeStep(s, s.token_ids) for s in twins])
            assert torch.equal(on, off), float((on - off).abs().max())
            for s, t, row in zip(seqs, twins, on):
                s.token_ids.append(int(row.argmax()))
                t.token_ids.append(int(row.argmax()))
        graphs.enabled = True
        for s in (*seqs, *twins):
            engine.release(s.blocks)
    assert graphs.failed is None and len(graphs.captured) >= 2


@gpu_only
def test_a_decode_step_does_not_sync_and_sampling_syncs_once(gpu_engine, smol_info):
    """CUDA's sync debug mode raises on any synchronizing call (a device-to-host read, a stream sync)."""
    engine = gpu_engine
    ids = _ids(300, 7, smol_info.config.vocab_size)
    seq = SeqBlocks()
    logits = prefill(engine, seq, ids).logits
    samplers = [Sampler(SamplingParams()), Sampler(SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=3))]
    for sampler in samplers:
        ids.append(sampler(logits))
        engine.decode(seq, ids)  # capture (if not yet) outside the check
        torch.cuda.synchronize()
        for _ in range(3):
            torch.cuda.set_sync_debug_mode("error")
            try:
                logits = engine.decode(seq, ids)
                token = sampler.pick(logits)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            ids.append(int(token.item()))  # the one read back
    batch = torch.stack([logits, logits])
    assert sample_rows([samplers[0], samplers[0]], batch) == [int(logits.argmax())] * 2
    engine.release(seq)


@gpu_only
def test_seeded_sampling_on_the_gpu_repeats(gpu_engine):
    logits = torch.randn(49152, device="cuda")
    samplers = [Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=s)) for s in (5, 5, 6)]
    picks = [[sampler(logits) for _ in range(8)] for sampler in samplers]
    assert picks[0] == picks[1] != picks[2]
