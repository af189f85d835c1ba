"""The persistent decode buffers (kvchat/engine/decode_buffers.py) on the real SmolLM2 model.

Decode through the buffers gives logits bit-identical to the per-step tensors path it replaced
(``_per_step_decode`` / ``_per_step_batch`` below: the engine's earlier ``decode`` and
``decode_batch`` bodies, fresh tensors for every input of every step), on the CPU read path, the
paged torch path and the paged Triton path under the interpreter; the buffers keep their storage
across steps, a block-table row is uploaded only when it changes, padded rows write and read nothing,
and a decode step plus its sampling reads one value back from the device.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules and importlib.util.find_spec("triton"):
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported (see tests/kernels/test_kernels_triton.py)

from turn_helpers import prefill

from kvchat.engine.block_manager import SeqBlocks  # noqa: E402
from kvchat.engine.decode_buffers import batch_bucket, context_bucket, context_buckets  # noqa: E402
from kvchat.engine.dense_kv import DenseKV  # noqa: E402
from kvchat.engine.inference import inference
from kvchat.engine.runner import Engine  # noqa: E402
from kvchat.engine.sampling import Sampler, SamplingParams  # noqa: E402
from kvchat.engine.sequence import DecodeStep, Sequence  # noqa: E402
from kvchat.kernels import cpu_attention  # noqa: E402
from kvchat.model.registry import load_weights  # noqa: E402
from kvchat.model.transformer import AttnMetadata  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _triton_interpreted() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    from kvchat.kernels import triton_decode

    return triton_decode.INTERPRETED


# ------------------------------------------------------------------ buckets (pure)

def test_batch_buckets_pad_only_when_asked():
    assert [batch_bucket(n, padded=True) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [batch_bucket(n, padded=False) for n in range(1, 9)] == list(range(1, 9))
    for bad in (0, 9):
        with pytest.raises(ValueError, match="1..8 sequences"):
            batch_bucket(bad, padded=True)


def test_context_buckets_fix_the_decode_split_count_within_a_bucket():
    from kvchat.kernels.warmup import DecodeLaunch

    max_width = 8192 // 16
    assert context_buckets(max_width) == [16, 32, 64, 128, 256, 512]
    assert context_buckets(100) == [16, 32, 64, 100]
    assert [context_bucket(w, 100) for w in (1, 16, 17, 33, 65, 100)] == [16, 16, 32, 64, 100, 100]
    with pytest.raises(ValueError):
        context_bucket(101, 100)
    if importlib.util.find_spec("triton") is None:
        return
    from kvchat.kernels.triton_decode import splits_for
    from kvchat.kernels.warmup import plan_warmup

    for sms in (1, 108, 132):  # every width of a bucket launches what the bucket's own width launches
        for w in range(1, max_width + 1):
            assert context_bucket(w, max_width) in context_buckets(max_width)
        plan = plan_warmup(3, 16, 8192, sms, (1, 2, 4, 8), context_buckets(max_width), max_width)
        decode = {launch.variant for launch in plan if isinstance(launch, DecodeLaunch)}
        for w in context_buckets(max_width):
            for b in (1, 2, 4, 8):
                assert DecodeLaunch(b, w, splits_for(b, 3, w * 16, sms), max_width).variant in decode


# ------------------------------------------------------------------ the real model

@pytest.fixture(scope="module")
def weights(smol_info):
    return load_weights(smol_info)


def _engine(smol_info, weights, dense: bool) -> Engine:
    return Engine(smol_info.config, weights, smol_info.fingerprint, kv_dtype="fp8", pool_bytes=2**22, device="cpu",
                  dense_kv=dense)


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@inference()
def _per_step_decode(engine: Engine, seq: SeqBlocks, ids: list[int], dense: DenseKV | None) -> torch.Tensor:
    """The earlier ``Engine.decode``: one forward (a decode step: provisional) with fresh ``slot_mapping``,
    ``block_table`` (exactly the sequence's width), ``seq_lens`` and positions tensors."""
    n = len(ids)
    sink = engine.sink_kv(ids[0]) if engine.exact_sink else None
    engine.prepare_write(seq, n - 1, n, dense, sink)
    meta = AttnMetadata(
        slot_mapping=torch.tensor(engine.blocks.slots(seq, n - 1, n), dtype=torch.long),
        block_table=torch.tensor([seq.block_table], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), is_decode=True, dense=dense, q_start=n - 1, sink=sink,
        provisional=True)
    hidden = engine.model(torch.tensor([ids[-1]]), torch.tensor([n - 1]), meta, engine.pool)
    if dense is not None:
        dense.finish(seq, n)
    engine.blocks.commit(seq, ids, n, register=False)
    return engine.model.logits(hidden)[0]


@inference()
def _per_step_batch(engine: Engine, steps: list[DecodeStep]) -> torch.Tensor:
    """The earlier ``Engine.decode_batch`` body for two or more steps (fresh tensors every step)."""
    denses = [s.sequence.dense for s in steps] if engine.dense is not None else None
    sinks = [engine.sink_kv(s.token_ids[0]) if engine.exact_sink else None for s in steps]
    for i, s in enumerate(steps):
        n = len(s.token_ids)
        engine.prepare_write(s.sequence.blocks, n - 1, n, denses[i] if denses else None, sinks[i])
    lens = [len(s.token_ids) for s in steps]
    slots = [engine.blocks.slots(s.sequence.blocks, n - 1, n)[0] for s, n in zip(steps, lens)]
    width = max(len(s.sequence.blocks.block_table) for s in steps)
    table = [s.sequence.blocks.block_table + [0] * (width - len(s.sequence.blocks.block_table)) for s in steps]
    sink = None
    if engine.exact_sink and denses is None:
        sink = (torch.stack([k for k, _ in sinks]), torch.stack([v for _, v in sinks]))
    meta = AttnMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long), block_table=torch.tensor(table, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), cu_seqlens_q=torch.arange(len(steps) + 1, dtype=torch.int32),
        is_decode=True, sink=sink, dense_batch=None if denses is None else [(d, n - 1) for d, n in zip(denses, lens)],
        provisional=True)  # a decode step, as Engine.decode_batch's
    ids = torch.tensor([s.token_ids[-1] for s in steps], dtype=torch.long)
    hidden = engine.model(ids, torch.tensor([n - 1 for n in lens]), meta, engine.pool)
    for i, (s, n) in enumerate(zip(steps, lens)):
        if denses is not None:
            denses[i].finish(s.sequence.blocks, n)
        engine.blocks.commit(s.sequence.blocks, s.token_ids, n, register=False)
    return engine.model.logits(hidden)


PATHS = ["dense", "paged-torch", "paged-compiled", "paged-triton"]


def _setup_path(path: str, monkeypatch) -> None:
    if path == "paged-triton":
        if not _triton_interpreted():
            pytest.skip("needs Triton under TRITON_INTERPRET=1 (set before Triton was imported)")
        monkeypatch.setenv("KVCHAT_ATTENTION", "triton")
    elif path == "paged-compiled":  # the CPU default: kvchat.kernels.cpu_attention
        if cpu_attention._library() is None:
            pytest.skip("the compiled CPU decode attention does not build here")
        monkeypatch.delenv("KVCHAT_ATTENTION", raising=False)
    else:
        monkeypatch.setenv("KVCHAT_ATTENTION", "torch")


@pytest.mark.parametrize("path", PATHS)
def test_single_decode_is_bit_identical_to_the_per_step_tensors_path(smol_info, weights, monkeypatch, path):
    """Twin sequences (a fork of one prefill): one decodes through the buffers, the other as before;
    3 steps, the last one opening a new block (positions 46, 47, 48)."""
    _setup_path(path, monkeypatch)
    engine = _engine(smol_info, weights, dense=path == "dense")
    ids = _ids(47, 0, smol_info.config.vocab_size)
    seq = SeqBlocks()
    prefill(engine, seq, ids[:-1])
    twin = engine.blocks.fork(seq, len(ids) - 1)
    twin_dense = DenseKV(engine.pool, engine.blocks) if path == "dense" else None
    for _ in range(3):
        new = engine.decode(seq, ids)
        old = _per_step_decode(engine, twin, ids, twin_dense)
        assert torch.equal(new, old), float((new - old).abs().max())
        ids.append(int(new.argmax()))


@pytest.mark.parametrize("path", ["dense", "paged-compiled", "paged-triton"])
def test_batched_decode_is_bit_identical_to_the_per_step_tensors_path(smol_info, weights, monkeypatch, path):
    _setup_path(path, monkeypatch)
    engine = _engine(smol_info, weights, dense=path == "dense")
    vocab = smol_info.config.vocab_size
    prompts = [_ids(30, 1, vocab), _ids(47, 2, vocab)]
    seqs, twins = [], []
    for p in prompts:
        for group in (seqs, twins):
            s = Sequence(token_ids=list(p))
            if path == "dense":
                s.dense = DenseKV(engine.pool, engine.blocks)
            prefill(engine, s.blocks, p[:-1], dense_kv=s.dense)
            group.append(s)
    for _ in range(2):
        new = engine.decode_batch([DecodeStep(s, s.token_ids) for s in seqs])
        old = _per_step_batch(engine, [DecodeStep(s, s.token_ids) for s in twins])
        assert torch.equal(new, old), float((new - old).abs().max())
        for s, t, row in zip(seqs, twins, new):
            s.token_ids.append(int(row.argmax()))
            t.token_ids.append(int(row.argmax()))


def test_buffers_keep_their_storage_and_upload_only_new_blocks(smol_info, weights, monkeypatch):
    monkeypatch.setenv("KVCHAT_ATTENTION", "torch")
    engine = _engine(smol_info, weights, dense=True)
    buf = engine.decode_buffers
    ptrs = lambda: [buf.step.data_ptr(), buf.seq_lens.data_ptr(), buf.block_table.data_ptr()]  # noqa: E731
    before = ptrs()
    ids = _ids(45, 3, smol_info.config.vocab_size)
    seq = SeqBlocks()
    prefill(engine, seq, ids[:-1])
    uploads = []
    for _ in range(6):  # positions 44..49: a new block at 48
        ids.append(int(engine.decode(seq, ids).argmax()))
        uploads.append(buf.uploads)
        assert ptrs() == before
    blocks_at_44 = -(-45 // 16)
    assert uploads[0] == blocks_at_44  # the whole row once
    assert [b - a for a, b in zip(uploads, uploads[1:])] == [0, 0, 0, 1, 0]  # then only the new block
    other = SeqBlocks()  # a different sequence in row 0: its row from the start
    prefill(engine, other, ids[:20])
    engine.decode(other, ids[:21])
    assert buf.uploads - uploads[-1] == 2
    assert buf.block_table[0, :2].tolist() == other.block_table


@pytest.mark.parametrize("path", ["paged-triton"])  # padding runs only where graphs do: CUDA with Triton
def test_padded_rows_write_nothing_and_the_real_rows_match(smol_info, weights, monkeypatch, path):
    """A batch of 3 in bucket 4 (as on a GPU, where graphs need fixed shapes): the padded row writes no
    K/V and its logits are dropped; the real rows match the unpadded batch up to the last bits (a
    4-row matmul on this CPU's BLAS rounds differently from a 3-row one, measured; the tolerance is
    tests/kernels/test_kernels_triton.py's fp8 one, 5e-3 of the logit range)."""
    _setup_path(path, monkeypatch)
    engine = _engine(smol_info, weights, dense=False)
    vocab = smol_info.config.vocab_size
    prompts = [_ids(20 + 7 * i, 10 + i, vocab) for i in range(3)]
    padded, plain = [], []
    for p in prompts:
        for group in (padded, plain):
            s = Sequence(token_ids=list(p))
            prefill(engine, s.blocks, p[:-1])
            group.append(s)
    ref = engine.decode_batch([DecodeStep(s, s.token_ids) for s in plain])
    engine.plan = replace(engine.plan, pad_decode=True)  # as on a GPU with the Triton kernels (graphs or not), run eagerly
    pool = [t.clone() for t in (engine.pool.k, engine.pool.v, engine.pool.k_scale, engine.pool.v_scale)]
    out = engine.decode_batch([DecodeStep(s, s.token_ids) for s in padded])
    assert out.shape == ref.shape == (3, vocab)
    assert engine.decode_buffers.step[2, 3].item() == -1 and engine.decode_buffers.seq_lens[3].item() == 0
    span = float(ref.max() - ref.min())
    assert float((out - ref).abs().max()) <= 5e-3 * span
    written = {engine.blocks.slots(s.blocks, len(s.token_ids) - 1, len(s.token_ids))[0] for s in padded}
    for now, was in zip((engine.pool.k, engine.pool.v, engine.pool.k_scale, engine.pool.v_scale), pool):
        changed = (now.view(torch.uint8) != was.view(torch.uint8)).flatten(3).any(-1).flatten(1).any(0)
        assert set(changed.nonzero().flatten().tolist()) <= written  # per slot, over all layers


SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _count_host_reads(monkeypatch, roots: tuple[str, ...]) -> list[tuple[str, str, int]]:
    """Record each call of a device-to-host read (``SYNCS``) made from code under ``roots``."""
    calls = []
    for name in SYNCS:
        orig = getattr(torch.Tensor, name)

        def wrapper(self, *args, _orig=orig, _name=name, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(roots):
                calls.append((_name, frame.f_code.co_filename, frame.f_lineno))
            return _orig(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    return calls


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_decode_step_and_its_sampling_read_one_value_back(smol_info, weights, monkeypatch, temperature):
    """The engine and model code of a step (kvchat/engine, kvchat/model) read nothing from the device but
    the sampled id. The CPU reference kernels (kernels/) read lengths on the host: on a GPU the Triton
    kernels run instead (the GPU-only test in tests/engine/test_decode_graphs.py checks with CUDA's sync
    debug mode)."""
    monkeypatch.setenv("KVCHAT_ATTENTION", "torch")
    engine = _engine(smol_info, weights, dense=True)
    ids = _ids(40, 4, smol_info.config.vocab_size)
    seq = SeqBlocks()
    logits = prefill(engine, seq, ids).logits
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=50, top_p=0.9, seed=1))
    ids.append(sampler(logits))
    engine.decode(seq, ids)  # the first step of a sequence syncs its dense copy; count the steady state
    calls = _count_host_reads(monkeypatch, (str(ROOT / "kvchat" / "engine"), str(ROOT / "kvchat" / "model")))
    for step in range(3):
        ids.append(sampler(engine.decode(seq, ids)))
        assert len(calls) == step + 1, calls
    assert all(c[1].endswith("sampling.py") for c in calls), calls


def test_more_sequences_than_the_largest_bucket_run_in_groups(smol_info, weights, monkeypatch):
    """9 sequences: a forward of 8 and a forward of 1 (the buffers hold 8 rows); the ninth row is exactly
    a lone decode of the same sequence."""
    monkeypatch.setenv("KVCHAT_ATTENTION", "torch")
    engine = _engine(smol_info, weights, dense=True)
    vocab = smol_info.config.vocab_size
    seqs = []
    for i in range(10):
        p = _ids(12 + i, 20 + min(i, 8), vocab) if i < 9 else _ids(20, 28, vocab)  # the 10th: the 9th's twin
        s = Sequence(token_ids=list(p), dense=DenseKV(engine.pool, engine.blocks))
        prefill(engine, s.blocks, p[:-1], dense_kv=s.dense)
        seqs.append(s)
    logits = engine.decode_batch([DecodeStep(s, s.token_ids) for s in seqs[:9]])
    assert logits.shape == (9, vocab)
    assert torch.equal(logits[8], engine.decode(seqs[9].blocks, seqs[9].token_ids, seqs[9].dense))
