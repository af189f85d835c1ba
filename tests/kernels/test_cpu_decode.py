"""The compiled decode layers (kvchat.kernels.cpu_decode, kvchat.model.compiled_decode) against the torch
layers they replace, on small random-weight engines, and where they run."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import transformers
from turn_helpers import prefill

from kvchat.engine.block_manager import SeqBlocks
from kvchat.engine.calibration import make_calibration
from kvchat.engine.runner import Engine
from kvchat.engine.sequence import DecodeStep, Sequence
from kvchat.kernels import cpu_decode
from kvchat.model.compiled_decode import compiled_decode
from kvchat.model.config import ModelConfig
from kvchat.model.int8_scheme import COMPILED_LAYER_MAX_TOKENS

needs_kernel = pytest.mark.skipif(not cpu_decode.available(), reason="the compiled CPU decode layer does not build here")


def _model(kind: str = "llama", **extra):
    torch.manual_seed(0)
    shape = dict(vocab_size=97, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1) | extra
    hf_cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
              "qwen3": transformers.Qwen3Config}[kind](**shape)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    if kind == "qwen2":  # transformers initialises biases to zero: give them values, so a missed bias shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    return ModelConfig.from_hf(hf_cfg.to_dict()), dict(model.state_dict())


@pytest.fixture(autouse=True)
def models_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_MODELS", str(tmp_path / "models"))  # the int8 weights are stored there


def _engine(model, kv_dtype="fp8", calibration=None, **kw) -> Engine:
    cfg, weights = model
    return Engine(cfg, weights, "tiny", kv_dtype=kv_dtype, pool_bytes=2**21, device="cpu", weight_format="int8",
                  calibration=calibration, **kw)


class _Counted:
    """The engine's compiled decode step, counting its decode calls and its chunks (so a test knows which path
    ran)."""

    def __init__(self, step):
        self.step, self.calls, self.chunks = step, 0, []

    def __call__(self, *args):
        self.calls += 1
        return self.step(*args)

    def chunk(self, input_ids, start, *args):
        self.chunks.append((start, start + input_ids.shape[0]))
        return self.step.chunk(input_ids, start, *args)


def _shifted_engine(model, kv_dtype: str, **kw) -> Engine:
    """:func:`_engine` with, for an fp8 pool, a random K shift of the calibration's shape: the compiled layer
    must subtract it too."""
    cal = None
    if kv_dtype == "fp8":
        cfg = model[0]
        cal = make_calibration(torch.randn(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) * 0.3, "test")
    return _engine(model, kv_dtype, cal, **kw)


@contextlib.contextmanager
def _layers(engine: Engine, compiled: bool):
    """Within the block ``engine`` runs its compiled decode layers (``compiled``) or the torch ones; yields the
    :class:`_Counted` compiled step, which counts nothing in the second case."""
    saved = engine.compiled_decode
    counted = _Counted(saved)
    engine.compiled_decode = counted if compiled else None
    try:
        yield counted
    finally:
        engine.compiled_decode = saved


def _stored_k(engine: Engine, seq: SeqBlocks, start: int, end: int) -> torch.Tensor:
    """Tokens ``[start, end)`` of ``seq`` as layer 1 of the pool stores their K, dequantized: ``[end - start,
    kv_heads, head_dim]`` float32."""
    slots = torch.tensor(engine.blocks.slots(seq, start, end))
    layer = engine.pool.layer(1)
    k_cache, k_scale = layer.k_cache, layer.k_scale
    bs = k_cache.shape[1]
    k = k_cache[slots // bs, slots % bs].float()
    return k if k_scale is None else k * k_scale[slots // bs, slots % bs][..., None]


def _decode_once(engine: Engine, ids: list[int], compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``ids[:-1]`` on a fresh sequence, decode ``ids[-1]``: (logits, the stored K of that token in
    layer 1, dequantized); the decode on the compiled layers (checked) or on the torch layers."""
    with _layers(engine, compiled) as counted:
        seq = SeqBlocks()
        prefill(engine, seq, ids[:-1])
        logits = engine.decode(seq, ids)
        k = _stored_k(engine, seq, len(ids) - 1, len(ids))[0]
        engine.release(seq)
        assert counted.calls == (1 if compiled else 0)
        return logits, k


@needs_kernel
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("length", [2, 17, 130, 300])
def test_a_compiled_step_is_the_torch_layers_step_to_fp32_rounding(kind, kv_dtype, length):
    engine = _shifted_engine(_model(kind), kv_dtype)
    assert engine.compiled_decode is not None
    ids = torch.randint(0, 97, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    got, got_k = _decode_once(engine, ids, compiled=True)
    want, want_k = _decode_once(engine, ids, compiled=False)
    # fp32 throughout on both sides; they differ in summation order (norms, matmul pairs) and in the exp
    # (a degree-7 polynomial, ~1e-7 relative): measured up to ~3e-6 relative here
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-4 * scale, (got - want).abs().max()
    # the token's stored K: the same up to one step of the pool's rounding (e4m3: 2**-3 relative; bf16: 2**-8)
    step = 2**-3 if kv_dtype == "fp8" else 2**-8
    assert ((got_k - want_k).abs() <= want_k.abs() * step + 1e-3).all()


def _chunk_once(engine: Engine, ids: list[int], start: int, compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``ids[:start]``, then ``ids[start:]`` as one chunk: (its hidden states, its tokens' stored K in
    layer 1, dequantized ``[T, kv_heads, head_dim]``); the chunk on the compiled layers (checked) or the torch ones."""
    with _layers(engine, compiled) as counted:
        seq = SeqBlocks()
        prefill(engine, seq, ids[:start])
        with torch.inference_mode():  # as the engine loop runs prefill chunks
            hidden = engine._forward(seq, ids, start, len(ids))
        k = _stored_k(engine, seq, start, len(ids))
        engine.release(seq)
        assert counted.chunks == ([(start, len(ids))] if compiled else [])
        return hidden, k


@needs_kernel
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("start, tokens", [(1, 2), (17, 5), (120, 16), (130, 32), (300, 16)])  # 120: across a range
def test_a_compiled_chunk_is_the_torch_layers_chunk_to_fp32_rounding(kind, kv_dtype, start, tokens):
    """A short chunk (a question after a resume) on the compiled layers: each token attends causally to the
    cached tokens and to the chunk's tokens up to itself, read from the pool once for all of them."""
    model = _model(kind)
    engine = _shifted_engine(model, kv_dtype, exact_sink=kv_dtype == "fp8")
    assert engine.runs_compiled(start, start + tokens)
    ids = torch.randint(0, 97, (start + tokens,), generator=torch.Generator().manual_seed(start)).tolist()
    got, got_k = _chunk_once(engine, ids, start, compiled=True)
    want, want_k = _chunk_once(engine, ids, start, compiled=False)
    assert got.shape == want.shape == (tokens, model[0].hidden_size)
    # fp32 on both sides, another summation order and exp (see the decode step's test); a causal mask off by
    # one token moves rows by far more (measured on SmolLM2: cosine 0.93-0.99, before the mask was right)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (got - want).abs().max()
    step = 2**-3 if kv_dtype == "fp8" else 2**-8
    assert ((got_k - want_k).abs() <= want_k.abs() * step + 1e-3).all()


@needs_kernel
def test_a_chunk_runs_compiled_by_its_bounds_alone():
    engine = _engine(_model(), exact_sink=True)
    limit = COMPILED_LAYER_MAX_TOKENS
    assert engine.runs_compiled(1, 1 + limit) and engine.runs_compiled(4000, 4001)
    assert not engine.runs_compiled(0, 5)  # position 0: the sink's own forward and a prompt's first chunk
    assert not engine.runs_compiled(10, 11 + limit)  # longer: the torch layers over the dense copy
    engine.compiled_decode = counted = _Counted(engine.compiled_decode)
    ids = torch.randint(0, 97, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    seq = SeqBlocks()
    prefill(engine, seq, ids, boundaries=[40, 40 + limit, 41 + 2 * limit])  # chunks 0-40, 40-72, 72-105, 105-120
    engine.release(seq)
    assert counted.chunks == [(40, 40 + limit), (41 + 2 * limit, 120)]


@needs_kernel
@pytest.mark.parametrize("kv_dtype, question", [("fp8", 9), ("bf16", 9), ("fp8", 40)])
def test_after_a_restore_the_question_reads_the_pool_and_equals_a_cold_run(kv_dtype, question, monkeypatch):
    """With the compiled layers a restore leaves the dense copy alone (no dequantized float32 copy of the
    chat), and the question, a short chunk, reads the restored pool: the same logits and K/V bits as a cold
    prefill of the whole token list (same chunk plan). A longer question (torch layers) gets the copy filled."""
    from kvchat.engine import dense_kv
    from kvchat.engine.persistence import CHUNK_TOKENS, KVPersist

    model = _model()
    ids = torch.randint(0, 97, (CHUNK_TOKENS + 37 + question,), generator=torch.Generator().manual_seed(5)).tolist()
    history, cut = ids[:-question], CHUNK_TOKENS + 37
    short = question <= COMPILED_LAYER_MAX_TOKENS
    saver = _engine(model, kv_dtype, exact_sink=kv_dtype == "fp8")
    persist, seq = KVPersist(saver), SeqBlocks()
    prefill(saver, seq, history, boundaries=[cut])
    persist.save(seq, history, [], owner="chat")
    persist.close()

    cold_engine = _engine(model, kv_dtype, exact_sink=kv_dtype == "fp8")
    cold = SeqBlocks()
    want = prefill(cold_engine, cold, ids, boundaries=[cut]).logits

    engine = _engine(model, kv_dtype, exact_sink=kv_dtype == "fp8")
    engine.compiled_decode = counted = _Counted(engine.compiled_decode)
    read = []
    real = dense_kv.dispatch.read_slots
    monkeypatch.setattr(dense_kv.dispatch, "read_slots", lambda *a, **k: (read.append(1), real(*a, **k))[1])
    persist, resumed = KVPersist(engine), SeqBlocks()
    assert persist.restore(resumed, ids).from_disk == cut
    assert engine.dense.length == (0 if short else cut)  # nothing dequantized into the copy for a short question
    got = prefill(engine, resumed, ids, boundaries=[cut]).logits
    persist.close()
    if short:  # the question on the compiled layers, off the pool
        assert counted.chunks == [(cut, len(ids))] and read == []
    else:  # on the torch layers over the filled copy: only its new tokens read back, layer by layer
        assert counted.chunks == [] and len(read) == 2 * model[0].num_layers
    assert torch.equal(got, want)
    pos = torch.arange(len(ids))
    slots_got = torch.tensor(resumed.block_table)[pos // 16] * 16 + pos % 16
    slots_want = torch.tensor(cold.block_table)[pos // 16] * 16 + pos % 16
    for name in ("k", "v", "k_scale", "v_scale"):  # every stored byte, the question's included
        a, b = getattr(engine.pool, name), getattr(cold_engine.pool, name)
        if a is not None:
            assert torch.equal(a.flatten(1, 2)[:, slots_got].view(torch.uint8),
                               b.flatten(1, 2)[:, slots_want].view(torch.uint8)), name


@needs_kernel
def test_the_cache_fingerprint_says_whether_chunks_ran_on_the_compiled_layers(monkeypatch):
    """Short chunks' K/V differ between the compiled and the torch layers, so engines that run them on either
    never share cached chunks; the fingerprint predicted without a model agrees with the engine's."""
    from kvchat.engine.cache_identity import expected_identity

    model = _model()
    compiled = _engine(model)
    assert compiled.compiled_decode is not None
    monkeypatch.setenv("KVCHAT_ATTENTION", "torch")
    reference = _engine(model)
    assert reference.compiled_decode is None and reference.int8_kernel == compiled.int8_kernel == "avx2"
    assert reference.cache_fingerprint != compiled.cache_fingerprint
    assert expected_identity("tiny", "fp8", "cpu", "int8", num_params=0).fingerprint == reference.cache_fingerprint
    monkeypatch.delenv("KVCHAT_ATTENTION")
    assert expected_identity("tiny", "fp8", "cpu", "int8", num_params=0).fingerprint == compiled.cache_fingerprint


@needs_kernel
def test_a_chunks_bits_do_not_depend_on_the_thread_count():
    engine = _engine(_model(), exact_sink=True)
    ids = torch.randint(0, 97, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    before = torch.get_num_threads()
    got = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            got.append(_chunk_once(engine, ids, 180, compiled=True))
        finally:
            torch.set_num_threads(before)
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


@needs_kernel
def test_a_rows_bits_depend_on_the_row_alone_not_the_batch_or_threads():
    engine = _engine(_model(), exact_sink=True)
    engine.compiled_decode = counted = _Counted(engine.compiled_decode)
    gen = torch.Generator().manual_seed(1)
    texts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 140, 37)]

    def step(rows: list[list[int]], threads: int) -> torch.Tensor:
        seqs = []
        for ids in rows:
            s = Sequence(list(ids))
            prefill(engine, s.blocks, ids[:-1])
            seqs.append(s)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            logits = engine.decode_batch([DecodeStep(s, s.token_ids) for s in seqs])
        finally:
            torch.set_num_threads(before)
        for s in seqs:
            engine.release(s.blocks)
        return logits

    batched = step(texts, 2)
    for i, ids in enumerate(texts):
        assert torch.equal(step([ids], 1)[0], batched[i])
    assert counted.calls == 1 + len(texts)


@needs_kernel
def test_it_runs_for_int8_group_weights_in_fp32_only():
    model = _model()
    assert _engine(model).compiled_decode is not None
    cfg, weights = model
    fp32 = Engine(cfg, weights, "tiny", kv_dtype="fp8", pool_bytes=2**21, device="cpu", weight_format="fp32")
    assert fp32.compiled_decode is None and compiled_decode(fp32.model, fp32.pool) is None
    qwen3 = _engine(_model("qwen3", head_dim=32))  # per-head q/k norms: the torch layers
    assert qwen3.compiled_decode is None
    fp16_pool = _engine(model, kv_dtype="fp16")
    assert fp16_pool.compiled_decode is not None  # every pool dtype the compiled attention reads
    ragged = _engine(_model(intermediate_size=100))  # down's 100 inputs are no groups of 32: a per-channel layer
    assert ragged.compiled_decode is None


def test_turned_off_it_does_not_run():
    code = "from kvchat.kernels import cpu_decode; print(cpu_decode.available())"
    off = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVCHAT_CPU_KERNEL": "0"},
                         capture_output=True, text=True, timeout=120)
    assert off.stdout.split() == ["False"], off.stderr


@needs_kernel
def test_a_length_past_the_table_or_a_slot_outside_the_pool_is_refused():
    engine = _engine(_model())
    cfg = engine.cfg
    layers = engine.compiled_decode.layers
    x = torch.zeros(1, cfg.hidden_size)
    cos = sin = torch.zeros(1, 1, cfg.head_dim)
    table = torch.zeros(1, 2, dtype=torch.int32)
    ok_slot, ok_len = torch.tensor([0]), torch.tensor([32], dtype=torch.int32)
    layers.run(x, cos, sin, ok_slot, table, ok_len, None)  # two blocks of 16 tokens: in range
    with pytest.raises(ValueError, match="past a block table"):
        layers.run(x, cos, sin, ok_slot, table, torch.tensor([33], dtype=torch.int32), None)
    slots = engine.pool.k[0].shape[0] * engine.pool.k[0].shape[1]
    with pytest.raises(ValueError, match="outside a pool"):
        layers.run(x, cos, sin, torch.tensor([slots]), table, ok_len, None)
    with pytest.raises(ValueError, match="not what it takes"):
        layers.run(x.double(), cos, sin, ok_slot, table, ok_len, None)
    x3, cos3 = torch.zeros(3, cfg.hidden_size), torch.zeros(3, 1, cfg.head_dim)
    slots3 = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="not what it takes"):  # 3 rows are no whole number of 2-token sequences
        layers.run(x3, cos3, cos3, slots3, table, ok_len, None, tokens=2)
    with pytest.raises(ValueError, match="under 3 new tokens"):  # 2 tokens in all cannot hold 3 new ones
        layers.run(x3, cos3, cos3, slots3, table, torch.tensor([2], dtype=torch.int32), None, tokens=3)
    layers.run(x3, cos3, cos3, slots3, table, torch.tensor([3], dtype=torch.int32), None, tokens=3)
    x4, cos4, table2 = torch.zeros(4, cfg.hidden_size), torch.zeros(4, 1, cfg.head_dim), torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="not what it takes"):  # chunks of several sequences at once: not a mix it runs
        layers.run(x4, cos4, cos4, torch.arange(4), table2, torch.tensor([2, 2], dtype=torch.int32), None, tokens=2)


@needs_kernel
def test_on_the_real_model_it_decodes_the_torch_layers_greedy_answer(smol_info):
    from kvchat.runtime import load_runtime

    engine = load_runtime(None, "fp8").engine
    assert engine.compiled_decode is not None  # the default model and format take it
    ids = torch.randint(100, 40000, (700,), generator=torch.Generator().manual_seed(3)).tolist()

    def greedy(compiled: bool) -> tuple[list[int], torch.Tensor]:
        saved = engine.compiled_decode
        engine.compiled_decode = saved if compiled else None
        try:
            seq, toks = SeqBlocks(), list(ids)
            toks.append(int(prefill(engine, seq, toks).logits.argmax()))
            first = None
            for _ in range(24):
                logits = engine.decode(seq, toks)
                first = logits if first is None else first
                toks.append(int(logits.argmax()))
            engine.release(seq)
            return toks[len(ids):], first
        finally:
            engine.compiled_decode = saved

    counted = engine.compiled_decode = _Counted(engine.compiled_decode)
    got, got_first = greedy(True)
    assert counted.calls == 24
    want, want_first = greedy(False)
    assert got == want
    # the first step reads the same pool on both sides (later ones read each side's own provisional K/V)
    assert (got_first - want_first).abs().max() <= 1e-4 * want_first.abs().max()
