"""KVCHAT_* settings (kvchat.settings): each bad value is one SettingError line naming the variable, the
value and what is accepted, the CLI turns it into ``kvchat: error: …`` and exit 2 with no traceback, and a
lowered disk budget says how much it evicted (kvchat.engine.disk_budget.eviction_note)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from turn_helpers import prefill

from kvchat import settings
from kvchat.engine import disk_budget
from kvchat.index import get_db
from kvchat.kernels import dispatch
from kvchat.settings import SettingError
from kvchat.store import chunk_index as ci
from kvchat.store.db import close_thread_dbs
from kvchat.store.keys import chunk_key
from kvchat.store.snapshot import ChunkData
from kvchat.units import size_text

VARIABLES = [settings.HOME, settings.MODELS, settings.DEVICE, settings.ATTENTION, settings.KV_BUDGET_MB,
             settings.CACHE_BUDGET_GB, settings.PHASE_TRACE, settings.GPU_MEMORY]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No KVCHAT_* setting from the caller's shell leaks in (KVCHAT_HOME is the conftest's tmp dir)."""
    for name in VARIABLES[1:]:
        monkeypatch.delenv(name, raising=False)


BAD = [
    (settings.kv_budget_mb, settings.KV_BUDGET_MB, "-5", "KVCHAT_KV_BUDGET_MB must be a positive number of MiB, got '-5'"),
    (settings.kv_budget_mb, settings.KV_BUDGET_MB, "abc", "KVCHAT_KV_BUDGET_MB must be a positive number of MiB, got 'abc'"),
    (settings.kv_budget_mb, settings.KV_BUDGET_MB, "0", "KVCHAT_KV_BUDGET_MB must be a positive number of MiB, got '0'"),
    (settings.kv_budget_mb, settings.KV_BUDGET_MB, "nan", "KVCHAT_KV_BUDGET_MB must be a positive number of MiB, got 'nan'"),
    (settings.kv_budget_mb, settings.KV_BUDGET_MB, "inf", "KVCHAT_KV_BUDGET_MB must be a positive number of MiB, got 'inf'"),
    (settings.cache_budget_gb, settings.CACHE_BUDGET_GB, "0", "KVCHAT_CACHE_BUDGET_GB must be a positive number of GB, got '0'"),
    (settings.cache_budget_gb, settings.CACHE_BUDGET_GB, "-1", "KVCHAT_CACHE_BUDGET_GB must be a positive number of GB, got '-1'"),
    (settings.cache_budget_gb, settings.CACHE_BUDGET_GB, "lots", "KVCHAT_CACHE_BUDGET_GB must be a positive number of GB, got 'lots'"),
    (settings.device, settings.DEVICE, "foo", "KVCHAT_DEVICE must be cpu, cuda or cuda:N, got 'foo'"),
    (settings.device, settings.DEVICE, "cuda:x", "KVCHAT_DEVICE must be cpu, cuda or cuda:N, got 'cuda:x'"),
    (settings.device, settings.DEVICE, "mps", "KVCHAT_DEVICE must be cpu, cuda or cuda:N, got 'mps'"),
    (settings.attention, settings.ATTENTION, "foo",
     "KVCHAT_ATTENTION must be torch or triton (or unset: chosen by device), got 'foo'"),
    (settings.attention, settings.ATTENTION, "auto",
     "KVCHAT_ATTENTION must be torch or triton (or unset: chosen by device), got 'auto'"),
    (settings.gpu_memory, settings.GPU_MEMORY, "1.5",
     "KVCHAT_GPU_MEMORY must be a fraction of the GPU's memory, above 0 and at most 1, got '1.5'"),
    (settings.gpu_memory, settings.GPU_MEMORY, "0",
     "KVCHAT_GPU_MEMORY must be a fraction of the GPU's memory, above 0 and at most 1, got '0'"),
    (settings.gpu_memory, settings.GPU_MEMORY, "half",
     "KVCHAT_GPU_MEMORY must be a fraction of the GPU's memory, above 0 and at most 1, got 'half'"),
]


@pytest.mark.parametrize("accessor, name, value, message", BAD, ids=[f"{b[1]}={b[2]}" for b in BAD])
def test_bad_value_is_one_line_naming_variable_value_and_accepted(accessor, name, value, message, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingError) as exc:
        accessor()
    assert str(exc.value) == message
    assert isinstance(exc.value, ValueError), "the CLI maps ValueError to one line and exit 2"


@pytest.mark.parametrize("accessor, name, value, message", BAD, ids=[f"{b[1]}={b[2]}" for b in BAD])
def test_check_refuses_every_bad_value_without_torch(accessor, name, value, message, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingError, match=f"^{re.escape(message)}$"):
        settings.check()


def test_unset_empty_and_good_values(monkeypatch, tmp_path):
    settings.check()  # everything unset: nothing to refuse
    assert settings.kv_budget_mb() is None and settings.cache_budget_gb() is None and settings.attention() is None
    assert settings.phase_trace() is None
    assert settings.device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name in (settings.KV_BUDGET_MB, settings.CACHE_BUDGET_GB, settings.ATTENTION, settings.DEVICE):
        monkeypatch.setenv(name, "  ")
    assert settings.kv_budget_mb() is None and settings.cache_budget_gb() is None and settings.attention() is None
    monkeypatch.setenv(settings.KV_BUDGET_MB, " 1.5 ")
    monkeypatch.setenv(settings.CACHE_BUDGET_GB, "1e-9")
    monkeypatch.setenv(settings.ATTENTION, "Torch")
    monkeypatch.setenv(settings.DEVICE, "CPU")
    monkeypatch.setenv(settings.HOME, "~/kv-home")
    monkeypatch.setenv(settings.MODELS, str(tmp_path / "m"))
    assert settings.kv_budget_mb() == 1.5 and settings.cache_budget_gb() == 1e-9 and settings.attention() == "torch"
    assert settings.device() == torch.device("cpu")
    assert settings.home() == Path.home() / "kv-home" and settings.models() == tmp_path / "m"


def test_cuda_without_cuda_and_beyond_the_device_count(monkeypatch):
    monkeypatch.setenv(settings.DEVICE, "cuda")
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(SettingError) as exc:
        settings.device()
    assert str(exc.value) == (f"KVCHAT_DEVICE is 'cuda' but this torch ({torch.__version__}) is built without CUDA;"
                              " use cpu or unset it")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SettingError, match=r"^KVCHAT_DEVICE is 'cuda' but torch sees no CUDA device; use cpu or unset it$"):
        settings.device()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv(settings.DEVICE, "cuda:2")
    with pytest.raises(SettingError) as exc:
        settings.device()
    assert str(exc.value) == "KVCHAT_DEVICE is 'cuda:2' but torch sees 2 CUDA device(s), cuda:0 to cuda:1"


def test_triton_where_it_cannot_run_is_a_setting_error(monkeypatch):
    monkeypatch.setenv(settings.ATTENTION, "triton")
    monkeypatch.setattr(dispatch, "_triton_importable", lambda: False)
    with pytest.raises(SettingError) as exc:
        dispatch.backend_for(torch.empty(0))
    assert str(exc.value) == "KVCHAT_ATTENTION is 'triton' but Triton is not installed; use torch or unset it"
    if importlib.util.find_spec("triton") is None:
        return
    monkeypatch.undo()
    monkeypatch.setenv(settings.ATTENTION, "triton")
    from kvchat.kernels import triton_write

    monkeypatch.setattr(triton_write, "INTERPRETED", False)  # as if Triton was imported without TRITON_INTERPRET=1
    with pytest.raises(SettingError, match=r"^KVCHAT_ATTENTION is 'triton' but Triton cannot run on the CPU without "
                                           r"TRITON_INTERPRET=1 .*; use torch, a CUDA device, or unset it$"):
        dispatch.backend_for(torch.empty(0))


def test_disk_budget_reads_the_setting(monkeypatch):
    monkeypatch.setenv(settings.CACHE_BUDGET_GB, "0.5")
    assert disk_budget.budget_bytes(get_db()) == 500_000_000
    monkeypatch.setenv(settings.CACHE_BUDGET_GB, "0")
    with pytest.raises(SettingError, match="KVCHAT_CACHE_BUDGET_GB"):
        disk_budget.budget_bytes(get_db())


# ---------------------------------------------------------------- the real CLI

def _kvchat(args: list[str], env: dict[str, str | None], home) -> subprocess.CompletedProcess:
    """``python -m kvchat.cli ARGS`` on data dir ``home`` with no KVCHAT_* from outside, plus ``env`` (None: removed)."""
    full = {k: v for k, v in os.environ.items() if k not in VARIABLES} | {"KVCHAT_HOME": str(home)} | env
    full = {k: v for k, v in full.items() if v is not None}
    return subprocess.run([sys.executable, "-m", "kvchat.cli", *args], capture_output=True, text=True, env=full,
                          timeout=300, check=False)


CLI_CASES = [
    (["ask", "hi"], {settings.KV_BUDGET_MB: "-5"}, "KVCHAT_KV_BUDGET_MB must be a positive number of MiB, got '-5'"),
    (["cache", "ls"], {settings.CACHE_BUDGET_GB: "0"}, "KVCHAT_CACHE_BUDGET_GB must be a positive number of GB, got '0'"),
    (["cache", "stats"], {settings.DEVICE: "foo"}, "KVCHAT_DEVICE must be cpu, cuda or cuda:N, got 'foo'"),
    (["ask", "hi"], {settings.ATTENTION: "foo"},
     "KVCHAT_ATTENTION must be torch or triton (or unset: chosen by device), got 'foo'"),
    (["serve"], {settings.GPU_MEMORY: "nan"},
     "KVCHAT_GPU_MEMORY must be a fraction of the GPU's memory, above 0 and at most 1, got 'nan'"),
]


def test_gpu_memory_setting_and_flag(monkeypatch, kvchat_home):
    from kvchat.cli.main import main

    assert settings.gpu_memory() is None
    monkeypatch.setenv(settings.GPU_MEMORY, " 0.6 ")
    assert settings.gpu_memory() == 0.6
    assert main(["--gpu-memory", "0.7", "cache", "stats"]) == 0
    assert os.environ[settings.GPU_MEMORY] == "0.7", "the flag wins, for this process and its children"
    with pytest.raises(SystemExit) as exc:
        main(["ask", "hi", "--gpu-memory", "2"])
    assert exc.value.code == 2


@pytest.mark.parametrize("args, env, line", CLI_CASES, ids=[" ".join(c[0]) + " " + next(iter(c[1])) for c in CLI_CASES])
def test_cli_bad_setting_is_one_line_exit_2_before_any_work(args, env, line, kvchat_home):
    proc = _kvchat(args, env, kvchat_home)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == [f"kvchat: error: {line}"], proc.stderr
    assert not kvchat_home.exists(), "refused before the data dir was created"


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a torch built without CUDA")
def test_cli_cuda_on_a_cpu_torch_fails_before_the_model_loads(kvchat_home, tmp_path):
    proc = _kvchat(["ask", "hi"], {settings.DEVICE: "cuda", settings.MODELS: str(tmp_path / "no-models")}, kvchat_home)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        f"kvchat: error: KVCHAT_DEVICE is 'cuda' but this torch ({torch.__version__}) is built without CUDA; use cpu or unset it"]
    assert not (tmp_path / "no-models").exists(), "failed before the model was looked up"


@pytest.mark.skipif(torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs Triton and no GPU")
def test_cli_triton_without_interpreter_fails_before_the_model_loads(kvchat_home, tmp_path):
    env = {settings.ATTENTION: "triton", settings.MODELS: str(tmp_path / "no-models"), "TRITON_INTERPRET": None}
    proc = _kvchat(["ask", "hi"], env, kvchat_home)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("kvchat: error: KVCHAT_ATTENTION is 'triton' but Triton cannot run on the CPU")
    assert not (tmp_path / "no-models").exists()


# ---------------------------------------------------------------- the eviction note

def _chunk(seed: int, layers: int, tokens: int = 256, heads: int = 2, head_dim: int = 64) -> ChunkData:
    g = torch.Generator().manual_seed(seed)
    kv = (layers, tokens, heads, head_dim)
    fp8 = torch.float8_e4m3fn
    return ChunkData(torch.randn(kv, generator=g).to(fp8), torch.randn(kv, generator=g).to(fp8),
                     torch.rand(kv[:3], generator=g), torch.rand(kv[:3], generator=g))


def _add_leaves(db, n: int, layers: int = 2, fingerprint: str = "other-fp") -> list[ci.ChunkRow]:
    """``n`` unrelated root chunks (each a leaf), oldest first."""
    rows = []
    for i in range(n):
        key = chunk_key(fingerprint, None, range(i * 1000, i * 1000 + 256))
        rows.append(ci.add_chunk(db, _chunk(i, layers), key=key, parent_key=None, fingerprint=fingerprint))
        ci.touch(db, [key], now=100.0 + i)
    return rows


@pytest.mark.parametrize("evict", [4, 5, 7])
def test_enforce_counts_and_the_note_says_them_above_four_chunks(evict, monkeypatch):
    db = get_db()
    rows = _add_leaves(db, 9)
    kept = rows[evict:]
    kb = sum(r.bytes for r in kept) // 1000 + 1  # a budget in whole kB just above what is kept (chunks: ~140 kB)
    value = str(kb / 1e6)  # in GB, e.g. '0.000279'
    monkeypatch.setenv(settings.CACHE_BUDGET_GB, value)
    got = disk_budget.enforce(db)
    evicted_bytes = sum(r.bytes for r in rows[:evict])
    assert (got.chunks, got.bytes, got.budget_gb) == (evict, evicted_bytes, float(value))
    assert kb * 1000 - 1 <= got.budget_bytes <= kb * 1000
    assert {r.key for r in ci.list_chunks(db)} == {r.key for r in kept}, "the oldest went"
    note = disk_budget.eviction_note(got)
    if evict <= 4:
        assert note is None
    else:
        assert note == f"evicted {evict} chunks ({size_text(evicted_bytes)}) to fit KVCHAT_CACHE_BUDGET_GB={value}"
    again = disk_budget.enforce(db)
    assert (again.chunks, again.bytes) == (0, 0), "nothing more to evict"


def test_note_for_the_default_budget_names_the_variable():
    e = disk_budget.Eviction(chunks=6, bytes=3_250_000, budget_bytes=12_300_000_000, budget_gb=None)
    assert disk_budget.eviction_note(e) == (
        "evicted 6 chunks (3.2 MB) to fit the default budget of 12.3 GB (set KVCHAT_CACHE_BUDGET_GB to change it)")


def test_ask_notes_the_eviction_its_budget_caused(smol_info, kvchat_home):
    """A real ``kvchat ask`` under a lowered budget: one note line with the chunks and bytes that went.

    Six foreign chunks of ~2.2 MB each (older than anything the ask writes) each alone exceed the 2 MB
    budget, so all six go and the ask's own small tails (< 1 MB for "hi") stay.
    """
    db = get_db()
    foreign = _add_leaves(db, 6, layers=32)
    assert all(r.bytes > 2e6 for r in foreign)
    close_thread_dbs()
    proc = _kvchat(["ask", "hi", "--max-tokens", "2"],
                   {settings.CACHE_BUDGET_GB: "0.002", settings.MODELS: str(smol_info.path.parent)}, kvchat_home)
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.startswith("kvchat: note: evicted")]
    total = sum(r.bytes for r in foreign)
    assert notes == [f"kvchat: note: evicted 6 chunks ({total / 1e6:.1f} MB) to fit KVCHAT_CACHE_BUDGET_GB=0.002"]
    left = ci.list_chunks(get_db())
    assert left and not {r.key for r in left} & {r.key for r in foreign}, "the ask's own chunks stay, the foreign ones went"


def test_persist_sums_the_evictions_of_its_saves_into_one_note(monkeypatch):
    """Two saves, each evicting 3 chunks (no note alone), sum to one note of 6 (the CLI prints it once)."""
    import transformers

    from kvchat.engine.block_manager import SeqBlocks
    from kvchat.engine.persistence import KVPersist
    from kvchat.engine.runner import Engine
    from kvchat.model.config import ModelConfig

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    weights = dict(transformers.AutoModelForCausalLM.from_config(hf_cfg).state_dict())
    engine = Engine(ModelConfig.from_hf(hf_cfg.to_dict()), weights, "tiny", kv_dtype="fp8", pool_bytes=2**20,
                    device="cpu", exact_sink=False)
    db = get_db()
    foreign = _add_leaves(db, 8)
    slack = min(r.bytes for r in foreign) // 2  # more than the engine's own small chunks, less than one foreign
    persist = KVPersist(engine)
    try:
        for owner, keep, seed in (("c_a", 5, 1), ("c_b", 2, 2)):
            ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
            seq = SeqBlocks()
            prefill(engine, seq, ids)
            monkeypatch.setenv(settings.CACHE_BUDGET_GB, str((sum(r.bytes for r in foreign[-keep:]) + slack) / 1e9))
            persist.save(seq, ids, [], owner)
            persist.flush()
            assert {r.key for r in foreign[-keep:]} <= {r.key for r in ci.list_chunks(db)}
    finally:
        persist.close()
    assert persist.errors == []
    assert sum(r.bytes for r in ci.list_chunks(db) if r.fingerprint != "other-fp") < slack
    gone = foreign[:6]
    assert {r.key for r in gone}.isdisjoint(r.key for r in ci.list_chunks(db))
    assert (persist.evicted.chunks, persist.evicted.bytes) == (6, sum(r.bytes for r in gone))
    assert disk_budget.eviction_note(persist.evicted).startswith("evicted 6 chunks (")
