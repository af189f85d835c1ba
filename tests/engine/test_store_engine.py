"""The persistent KV store as the engine and the CLI use it: cache identity across checkpoints,
what deleting a chat or a document removes, ``kvchat doc``, the cache CLI (pin, purge, verify,
gc, the byte budget) and restoring only when it pays.

One data dir is built once per module with real ``kvchat`` subprocesses on the default model
(``doc add`` of a ~610-token document, then two chats on it); each test works on its own copy.
Chunks in that dir (CHUNK_TOKENS = 256):

    c0 [0, 256) -> c1 [256, 512) -> t_p  (tail at the end of the document prefix)
                                 -> t1   (tail of chat 1: prefix + turn)
                                 -> t2   (tail of chat 2)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvchat.cli.main import main
from kvchat.index import get_db
from kvchat.store.chunk_index import WRITER_WINDOW_S, gc, get_chunk, list_chunks, load_chunk, touch
from kvchat.store.db import connect, write_transaction

DOC = (
    "The tide tables of the Orrin estuary were kept by the harbour office from 1870 onward. "
    "Each page lists the high and low water for one week, the height of the spring tides, and a "
    "note on the wind. Clerks wrote in blue ink until 1902 and in black ink afterwards, when the "
    "office moved to the customs house beside the ferry slip. "
) * 7  # ~610-token prefix: two full chunks and a tail, and each chat stays under 768 tokens
QUESTIONS = ["When did the ink change colour?", "Where did the office move?", "What does each page list?"]
MAX_TOKENS = 4


def cli(args: list[str], home: Path, models: Path, json_out: bool = True) -> subprocess.Popen:
    """Start ``kvchat ARGS`` in a fresh process on data dir ``home`` (one torch thread: the CPU is shared)."""
    env = {**os.environ, "KVCHAT_HOME": str(home), "KVCHAT_MODELS": str(models)}
    extra = ["--threads", "1"] + (["--json", "--max-tokens", str(MAX_TOKENS)] if json_out else [])
    return subprocess.Popen([sys.executable, "-m", "kvchat.cli", *args, *extra], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, expect_rc: int = 0) -> dict | str:
    """Wait for ``proc``; return its JSON output (or stderr when a failure is expected)."""
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == expect_rc, err
    return json.loads(out) if expect_rc == 0 else err


def run(*argv: str) -> None:
    """``kvchat ARGV`` in this process (on ``$KVCHAT_HOME``); must succeed."""
    assert main(list(argv)) == 0


def refs(db, owner: str) -> set[str]:
    return {r["key"] for r in db.query("SELECT key FROM chunk_refs WHERE owner = ?", [owner])}


def chunk_files(home: Path) -> set[str]:
    return {p.stem for p in (home / "kv").glob("*/*.safetensors")}


@pytest.fixture(scope="module")
def base(tmp_path_factory, smol_info):
    """A data dir after ``doc add DOC`` and two chats on DOC; returns facts about it."""
    home = tmp_path_factory.mktemp("base") / "home"
    doc = home.parent / "orrin.txt"
    doc.write_text(DOC)
    models = smol_info.path.parent
    added = cli(["doc", "add", str(doc)], home, models, json_out=False)
    out, err = added.communicate(timeout=900)
    assert added.returncode == 0, err
    chats = [cli(["ask", q, "--doc", str(doc)], home, models) for q in QUESTIONS[:2]]
    chat1, chat2 = [finish(p) for p in chats]
    return {"home": home, "doc": doc, "models": models, "chat1": chat1, "chat2": chat2, "doc_add_stdout": out}


@pytest.fixture
def home(base, kvchat_home) -> Path:
    """This test's own copy of the base data dir (``KVCHAT_HOME`` points at it)."""
    shutil.copytree(base["home"], kvchat_home, dirs_exist_ok=True)
    return kvchat_home


@pytest.fixture
def keys(base, home) -> dict[str, set[str]]:
    """Chunk keys per owner, and the named chunks of the module docstring."""
    db = get_db()
    did = next(iter(db.query("SELECT id FROM documents")))["id"]
    k = {"doc": refs(db, did), "chat1": refs(db, base["chat1"]["chat_id"]), "chat2": refs(db, base["chat2"]["chat_id"])}
    assert len(k["doc"]) == 3 and k["doc"] < k["chat1"] and k["doc"] < k["chat2"], k
    (k["t1"],), (k["t2"],) = k["chat1"] - k["doc"], k["chat2"] - k["doc"]
    rows = {r.key: r for r in list_chunks(db)}
    (c0,) = {r.key for r in rows.values() if r.parent_key is None}
    k["c0"] = c0
    (k["c1"],) = {r.key for r in rows.values() if r.parent_key == c0}
    (k["t_p"],) = k["doc"] - {c0, k["c1"]}
    k["doc_id"] = did
    return k


# ---- cache identity across checkpoints --------------------------------------------------------

def _tiny_checkpoint(path: Path, seed: int, tokenizer_dir: Path) -> None:
    """A 2-layer random-weight llama with the default model's tokenizer and chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)


def test_same_weights_elsewhere_hit_other_weights_miss(tmp_path, smol_info, kvchat_home):
    a, b = tmp_path / "ckpt-a", tmp_path / "ckpt-b"
    _tiny_checkpoint(a, 0, smol_info.path)
    _tiny_checkpoint(b, 1, smol_info.path)  # same shapes and tokenizer, other weights
    a_copy = tmp_path / "elsewhere" / "ckpt-a-copy"
    shutil.copytree(a, a_copy)
    doc = tmp_path / "orrin.txt"
    doc.write_text(DOC)
    models = tmp_path / "models"  # checkpoints are used in place; keep their fingerprint cache out of the shared dir

    first = finish(cli(["ask", QUESTIONS[0], "--doc", str(doc), "--model", str(a)], kvchat_home, models))
    assert first["from_disk"] == 0 and first["prompt_tokens"] > 512
    cont, refused, other = (
        cli(["ask", QUESTIONS[1], "--chat", first["chat_id"], "--model", str(a_copy)], kvchat_home, models),
        cli(["ask", QUESTIONS[1], "--chat", first["chat_id"], "--model", str(b)], kvchat_home, models,
            json_out=False),  # refused before any answer: its one error line on stderr
        cli(["ask", QUESTIONS[0], "--doc", str(doc), "--model", str(b)], kvchat_home, models),
    )
    cont = finish(cont)
    # the copy has the same fingerprint: the whole stored history comes from disk
    assert cont["from_memory"] == 0 and cont["miss_reason"] is None
    assert cont["from_disk"] >= first["context_tokens"] - 3 and cont["bytes_read"] > 0
    # other weights: the chat's ids belong to model A, so continuing it on B is refused
    err = finish(refused, expect_rc=2).strip().splitlines()[-1]
    assert err.startswith("kvchat: error: ") and f"chat {first['chat_id']} was made with model" in err
    # a new chat on B with the same document: same token ids, other fingerprint, nothing reused
    other = finish(other)
    assert other["from_disk"] == 0 and other["bytes_read"] == 0
    assert other["prefilled_tokens"] == other["prompt_tokens"] == first["prompt_tokens"]
    db = get_db()
    fps = {r["fingerprint"] for r in db.query("SELECT DISTINCT fingerprint FROM kv_chunks")}
    assert len(fps) == 2, "A (and its copy) and B each stored their own chunks"


# ---- deleting chats and documents --------------------------------------------------------------

def test_delete_chat_keeps_prefix_shared_with_another_chat(base, home, keys):
    from kvchat.conversation.records import delete_chat

    db = get_db()
    run("doc", "rm", keys["doc_id"])  # the document's own reference goes first: only chat 2 shares now
    assert chunk_files(home) == keys["chat1"] | keys["chat2"], "doc rm deletes nothing the chats still use"

    assert delete_chat(db, base["chat1"]["chat_id"]) == [keys["t1"]]
    assert chunk_files(home) == keys["chat2"], "the shared document prefix stays"
    assert {r.key for r in list_chunks(db)} == keys["chat2"]

    assert set(delete_chat(db, base["chat2"]["chat_id"])) == keys["chat2"]
    assert chunk_files(home) == set() and list_chunks(db) == []
    assert list(db.query("SELECT * FROM chunk_refs")) == []


def test_doc_add_then_ask_reuses_whole_prefix_and_doc_rm(base, home, keys, capsys, monkeypatch):
    from kvchat.conversation.records import delete_chat

    db = get_db()
    (doc,) = db.query("SELECT id, path, token_count FROM documents")
    assert doc["path"] == str(base["doc"].resolve()) and doc["id"] in base["doc_add_stdout"]
    for chat in (base["chat1"], base["chat2"]):  # --doc on an added document restores its whole prefix
        assert chat["from_memory"] == 0 and chat["from_disk"] == doc["token_count"]
        assert chat["prefilled_tokens"] == chat["prompt_tokens"] - doc["token_count"]

    run("doc", "list")
    listed = capsys.readouterr().out.splitlines()
    tokens = str(doc["token_count"])  # TOKENS and CACHED: its whole prefix is on disk
    assert any(line.split()[:4] == [doc["id"], tokens, tokens, base["doc"].name] for line in listed), listed

    for chat in (base["chat1"], base["chat2"]):
        delete_chat(db, chat["chat_id"])
    assert chunk_files(home) == keys["doc"], "the document still owns its prefix"
    monkeypatch.chdir(base["doc"].parent)
    run("doc", "rm", base["doc"].name)  # a relative path names the same document
    assert f"removed {doc['id']} and 3 chunk(s)" in capsys.readouterr().out
    assert chunk_files(home) == set() and list(db.query("SELECT * FROM documents")) == []


# ---- cache CLI -----------------------------------------------------------------------------------

def test_pin_unpin_purge(base, home, keys, capsys):
    chat2 = base["chat2"]["chat_id"]
    run("cache", "pin", chat2)
    run("cache", "ls")
    ls = capsys.readouterr().out.splitlines()
    assert any(line.startswith(chat2) and " yes " in line for line in ls), ls
    run("cache", "purge")
    assert "purged 1 chunk(s)" in capsys.readouterr().out
    assert chunk_files(home) == keys["chat2"], "only chat 1's own tail was unpinned"
    assert refs(get_db(), base["chat1"]["chat_id"]) == keys["doc"], "refs to purged chunks are gone too"

    run("cache", "unpin", chat2)
    assert not any(r.pinned for r in list_chunks(get_db()))
    run("cache", "pin", chat2)
    run("cache", "purge", "--all")
    assert chunk_files(home) == set()
    assert main(["cache", "pin", "c_nonexistent"]) == 2
    assert "no chat or document with id 'c_nonexistent'" in capsys.readouterr().err


@pytest.mark.fault
def test_verify_drops_corrupt_chunk_and_resume_recomputes_it(base, home, keys, tmp_path, capsys):
    corrupt, deleted = tmp_path / "corrupt", tmp_path / "deleted"
    for d in (corrupt, deleted):
        shutil.copytree(home, d)
    row = get_chunk(get_db(), keys["c1"])

    def flip(path: Path) -> None:
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x40]))

    run("cache", "verify")  # clean: exit 0
    assert "0 corrupt chunk(s)" in capsys.readouterr().out
    flip(row.path)
    assert main(["cache", "verify"]) == 1, "damage found: exit non-zero, as fsck does"
    out = capsys.readouterr().out
    assert "1 corrupt chunk(s) dropped" in out and "checksum" in out and "database ok" in out
    assert get_chunk(get_db(), keys["c1"]) is None and not row.path.exists()
    assert chunk_files(home) == (keys["chat1"] | keys["chat2"]) - {keys["c1"]}

    # unverified corruption met by a resume vs the same chunk simply absent
    flip(corrupt / "kv" / row.file_path)
    other = connect(deleted / "kvchat.db")
    with write_transaction(other):
        other.execute("DELETE FROM kv_chunks WHERE key = ?", [keys["c1"]])
    other.close()
    (deleted / "kv" / row.file_path).unlink()
    chat1 = base["chat1"]["chat_id"]
    runs = [cli(["ask", QUESTIONS[2], "--chat", chat1], d, base["models"]) for d in (corrupt, deleted)]
    with_corrupt, with_missing = [finish(p) for p in runs]
    assert "checksum" in with_corrupt["miss_reason"] and "recomputed" in with_corrupt["miss_reason"]
    assert "stops early" in with_missing["miss_reason"], "an absent chunk is a plain miss, named as such"
    for r in (with_corrupt, with_missing):  # c0 is read, the chain stops at c1 and is cut back to a segment edge
        assert r["reused_tokens"] == r["from_memory"] + r["from_disk"] < 256 and r["bytes_read"] > 0, r
    assert with_corrupt["from_disk"] == with_missing["from_disk"]
    assert with_corrupt["prefilled_tokens"] == with_missing["prefilled_tokens"]
    assert with_corrupt["text"] == with_missing["text"]
    # the recomputed chunk was written again under the same key (content addressing)
    other = connect(corrupt / "kvchat.db")
    rewritten = get_chunk(other, keys["c1"])
    other.close()
    assert rewritten is not None and rewritten.checksum == row.checksum


def test_gc_removes_only_old_strays_and_orphan_rows(base, home, keys):
    db = get_db()
    indexed = chunk_files(home)
    shard = home / "kv" / "ff"
    shard.mkdir(exist_ok=True)
    stray = shard / ("f" * 32 + ".safetensors")
    stray.write_bytes(os.urandom(1000))
    temp = shard / f".{'f' * 32}.1234.abcd.tmp"
    temp.write_bytes(os.urandom(10))

    r = gc(db, now=time.time())
    assert (r.files_removed, r.rows_removed) == (0, 0) and stray.exists() and temp.exists(), "young files stay"
    r = gc(db, now=time.time() + WRITER_WINDOW_S + 1)
    assert (r.files_removed, r.bytes_freed, r.rows_removed) == (2, 1010, 0)
    assert not stray.exists() and not temp.exists()
    assert chunk_files(home) == indexed, "files with a row are never removed, however old"

    get_chunk(db, keys["t1"]).path.unlink()
    r = gc(db)
    assert r.rows_removed == 1 and get_chunk(db, keys["t1"]) is None


def test_budget_evicts_lru_leaves_never_pinned(base, home, keys, monkeypatch, capsys):
    db = get_db()
    # c0 is the least recently used but has children; t1 is the oldest leaf
    for stamp, name in ((10, "c0"), (20, "t1"), (30, "t_p"), (40, "t2"), (50, "c1")):
        touch(db, [keys[name]], now=stamp)
    run("cache", "pin", base["chat1"]["chat_id"])
    monkeypatch.setenv("KVCHAT_CACHE_BUDGET_GB", "1e-9")  # 1 byte
    run("cache", "gc")
    assert "evicted 1 chunk(s) over budget" in capsys.readouterr().out
    assert chunk_files(home) == keys["chat1"], "everything unpinned went; the pinned chat stays whole"

    run("cache", "unpin", base["chat1"]["chat_id"])
    total = sum(r.bytes for r in list_chunks(db))
    monkeypatch.setenv("KVCHAT_CACHE_BUDGET_GB", str((total - 1) / 1e9))  # one byte over
    run("cache", "gc")
    assert "evicted 1 chunk(s)" in capsys.readouterr().out
    assert chunk_files(home) == keys["chat1"] - {keys["t1"]}, "the LRU leaf goes, not the older parent c0"
    rows = list_chunks(db)
    assert all(r.parent_key is None or any(p.key == r.parent_key for p in rows) for r in rows), "no chain is cut"


# ---- restore only when it pays -----------------------------------------------------------------

@pytest.fixture(scope="module")
def rt(smol_info):
    from kvchat.runtime import load_runtime

    return load_runtime(None, "fp8")


def test_restore_skipped_when_reading_is_slower_than_prefill(base, home, keys, rt):
    from kvchat.engine.block_manager import SeqBlocks
    from kvchat.engine.persistence import KVPersist
    from kvchat.engine.read_speed import ReadSpeed
    from kvchat.store.conversations import get_conversation

    ids = get_conversation(get_db(), base["chat1"]["chat_id"]).token_ids
    persist = KVPersist(rt.engine)
    try:
        stored = persist.find(ids)
        assert {r.key for r in stored} == {keys["c0"], keys["c1"], keys["t1"]}
        persist.read_speed = ReadSpeed.fixed(1.0)  # a disk of 1 byte/s: prefilling is faster
        slow = SeqBlocks()
        res = persist.restore(slow, ids)
        assert res.from_disk == 0 and res.bytes_read == 0 and slow.block_table == []
        assert res.miss_reason == "recomputing is faster than reading from disk"

        persist.read_speed = ReadSpeed.fixed(500e6)
        seq = SeqBlocks()
        res = persist.restore(seq, ids)
        assert res.miss_reason is None and res.from_disk == min(len(ids) - 1, sum(r.token_count for r in stored))
        assert res.bytes_read == sum(r.bytes for r in stored) and seq.num_computed == res.from_disk
        # bytes in the pool == bytes in the files, checked token by token through BlockManager.slot
        pool, start = rt.engine.pool, 0
        for row in stored:
            data = load_chunk(get_db(), row, persist.layout)
            for p in range(start, min(start + row.token_count, res.from_disk), 37):
                block, off = divmod(rt.engine.blocks.slots(seq, p, p + 1)[0], pool.spec.block_size)
                for name in ("k", "v", "k_scale", "v_scale"):
                    live, saved = getattr(pool, name)[:, block, off], getattr(data, name)[:, p - start]
                    assert torch.equal(live.view(torch.uint8), saved.view(torch.uint8)), (name, p)
            start += row.token_count
        rt.engine.release(seq)
    finally:
        persist.close()


def test_a_long_lived_fast_gpu_restores_when_the_disk_is_faster_and_recomputes_when_not(base, home, keys, rt,
                                                                                        monkeypatch):
    """The engine has measured an H200's 8B prefill (in snapshot bytes per second: 20,000 tok/s x 68 KB per
    token = 1.36 GB/s) and its first restore read a cold disk at 300 MB/s. Later resumes read the real chunk
    files through a probe whose time is faked (disk speeds, a fake clock): once that measurement is stale a
    3 GB/s disk restores again; a 0.5 GB/s one recomputes."""
    from kvchat.engine.block_manager import SeqBlocks
    from kvchat.engine.persistence import KVPersist
    from kvchat.engine.read_speed import STALE_S, ReadSpeed, probe_read
    from kvchat.store.conversations import get_conversation

    ids = get_conversation(get_db(), base["chat1"]["chat_id"]).token_ids
    persist = KVPersist(rt.engine)
    stored = persist.find(ids)
    nbytes, tokens = sum(r.bytes for r in stored), min(len(ids) - 1, sum(r.token_count for r in stored))
    monkeypatch.setattr(rt.engine, "prefill_tokens_per_s", 1.36e9 / (nbytes / tokens))
    now, disk, probed = [0.0], [0.0], []

    def probe(path):  # the real file's first bytes, read for real; their time is the fake disk's
        n, _ = probe_read(path)
        probed.append(path)
        return n, n / disk[0]

    persist.read_speed = ReadSpeed(clock=lambda: now[0], probe=probe)
    persist.read_speed.record(nbytes, nbytes / 0.3e9)

    def resume():
        seq = SeqBlocks()
        try:
            return persist.restore(seq, ids)
        finally:
            rt.engine.release(seq)

    try:
        now[0] = 10.0
        res = resume()
        assert res.from_disk == 0 and res.miss_reason == "recomputing is faster than reading from disk" and not probed
        disk[0], now[0] = 3e9, now[0] + STALE_S + 1
        res = resume()
        assert res.miss_reason is None and res.from_disk == tokens and res.bytes_read == nbytes
        assert probed == [stored[0].path], "the stale measurement was probed on the chain's first file"
        disk[0], now[0] = 0.5e9, now[0] + STALE_S + 1
        res = resume()
        assert res.from_disk == 0 and res.miss_reason == "recomputing is faster than reading from disk"
        assert len(probed) == 2
    finally:
        persist.close()


def test_writer_survives_a_failing_save_and_flush_returns(base, home, rt, monkeypatch):
    import threading

    from kvchat.engine.block_manager import SeqBlocks
    from kvchat.engine.persistence import KVPersist
    from kvchat.store.conversations import get_conversation

    ids = get_conversation(get_db(), base["chat2"]["chat_id"]).token_ids
    persist = KVPersist(rt.engine)
    seq = SeqBlocks()
    try:
        assert persist.restore(seq, ids).from_disk > 512
        monkeypatch.setenv("KVCHAT_CACHE_BUDGET_GB", "lots")  # enforcing the budget fails in the writer thread
        persist.save(seq, ids, [], owner="c_other")
        flusher = threading.Thread(target=persist.flush, daemon=True)
        flusher.start()
        flusher.join(timeout=60)
        assert not flusher.is_alive(), "flush() hung: the writer thread died on the error"
        assert persist.errors == ["KV snapshot not saved: KVCHAT_CACHE_BUDGET_GB must be a positive number of GB, got 'lots'"]
        monkeypatch.delenv("KVCHAT_CACHE_BUDGET_GB")
        saved = persist.save(seq, ids, [], owner="c_other")
        persist.flush()
        assert refs(get_db(), "c_other") == set(saved), "the writer still serves the queue"
        # Chat 2's snapshot holds every token (its answers are settled), this restore all but the
        # last one: the full chunks are chat 2's, the final tail (one token shorter) is new.
        assert set(saved[:-1]) < refs(get_db(), base["chat2"]["chat_id"]), "chat 2's full chunks"
        persist.close()  # not in `finally`: after a failure above it could block on a dead writer
    finally:
        rt.engine.release(seq)


def test_a_turn_under_another_kv_dtype_says_why_and_keeps_the_fp8_snapshot(base, home, smol_info):
    """``ask --chat`` with bf16 on an fp8 chat: a full miss that names the cause, and afterwards the
    chat's fp8 chain is still referenced, so an fp8 ask restores it again (refs are per fingerprint)."""
    models, chat = smol_info.path.parent, base["chat2"]["chat_id"]
    fp8_keys = refs(get_db(), chat)
    out = finish(cli(["ask", "Anything else?", "--chat", chat, "--kv-dtype", "bf16"], home, models))
    assert out["from_disk"] == 0 and "saved as fp8; this run uses bf16" in out["miss_reason"]
    assert fp8_keys <= refs(get_db(), chat), "the bf16 turn released the chat's fp8 chunks"
    back = finish(cli(["ask", "And the ink?", "--chat", chat], home, models))
    assert back["from_disk"] >= base["chat2"]["context_tokens"] - 16, back  # the fp8 chain, up to the bf16 turn
    # the bf16 turn itself was recomputed, and the line names the KV dtype it was stored in
    assert "other turns' KV was saved as bf16; this run uses fp8" in back["miss_reason"], back
