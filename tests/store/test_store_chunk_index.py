"""kv_chunks index: add/load/delete with real files, LRU leaf-first eviction, refs, gc, verify, crashes."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

import pytest
import torch

from kvchat.index import get_db, kv_dir
from kvchat.store import chunk_index as ci
from kvchat.store import snapshot
from kvchat.store.db import close_thread_dbs
from kvchat.store.errors import CorruptChunkError
from kvchat.store.keys import chunk_key
from kvchat.store.snapshot import ChunkData, ChunkLayout

torch.set_num_threads(1)
LAYOUT = ChunkLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float8_e4m3fn)
FP = "cache-fp"


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    yield
    close_thread_dbs()


def data(seed: int, tokens: int = 16) -> ChunkData:
    g = torch.Generator().manual_seed(seed)
    kv = (LAYOUT.num_layers, tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return ChunkData(torch.randn(kv, generator=g).to(LAYOUT.dtype), torch.randn(kv, generator=g).to(LAYOUT.dtype),
                     torch.rand(kv[:3], generator=g), torch.rand(kv[:3], generator=g))


def add_chain(db, n: int, seed: int = 0, parent: str | None = None) -> list[str]:
    keys = []
    for i in range(n):
        key = chunk_key(FP, parent, range(seed * 100 + i * 16, seed * 100 + i * 16 + 16))
        ci.add_chunk(db, data(seed * 100 + i), key=key, parent_key=parent, fingerprint=FP)
        keys.append(key)
        parent = key
    return keys


def test_add_load_round_trip_and_touch():
    db = get_db()
    d = data(1)
    key = chunk_key(FP, None, range(16))
    row = ci.add_chunk(db, d, key=key, parent_key=None, fingerprint=FP)
    assert row.path.exists() and row.bytes == row.path.stat().st_size and row.token_count == 16
    assert ci.totals(db) == ci.ChunkTotals(count=1, bytes=row.bytes, pinned_count=0, pinned_bytes=0)
    before = row.last_used
    time.sleep(0.01)
    back = ci.load_chunk(db, row, LAYOUT)
    assert torch.equal(back.k.view(torch.uint8), d.k.view(torch.uint8)) and torch.equal(back.v_scale, d.v_scale)
    assert ci.get_chunk(db, key).last_used > before


def test_second_writer_of_same_key_keeps_first():
    db = get_db()
    key = chunk_key(FP, None, range(16))
    first = ci.add_chunk(db, data(1), key=key, parent_key=None, fingerprint=FP)
    again = ci.add_chunk(db, data(2), key=key, parent_key=None, fingerprint=FP)
    assert again == first
    assert os.listdir(first.path.parent) == [first.path.name]  # the loser's temp file is gone
    ci.load_chunk(db, first, LAYOUT)  # file and row still agree


@pytest.mark.fault
def test_row_without_file_is_rewritten():
    db = get_db()
    key = chunk_key(FP, None, range(16))
    row = ci.add_chunk(db, data(1), key=key, parent_key=None, fingerprint=FP)
    ci.set_pinned(db, [key], True)
    row.path.unlink()
    new = ci.add_chunk(db, data(2), key=key, parent_key=None, fingerprint=FP)
    assert new.path.exists() and new.checksum != row.checksum and new.pinned
    ci.load_chunk(db, new, LAYOUT)


@pytest.mark.fault
def test_corrupt_chunk_is_dropped_on_load():
    db = get_db()
    row = ci.get_chunk(db, add_chain(db, 1)[0])
    raw = bytearray(row.path.read_bytes())
    raw[-1] ^= 1
    row.path.write_bytes(bytes(raw))
    with pytest.raises(CorruptChunkError) as ei:
        ci.load_chunk(db, row, LAYOUT)
    assert ei.value.kind == "checksum"
    assert ci.get_chunk(db, row.key) is None and not row.path.exists()


def test_eviction_is_lru_leaf_first_and_skips_pinned():
    db = get_db()
    a = add_chain(db, 3, seed=1)  # a0 <- a1 <- a2
    b = add_chain(db, 2, seed=2)  # b0 <- b1
    ci.touch(db, a, now=100.0)
    ci.touch(db, b, now=200.0)
    ci.touch(db, [a[0]], now=300.0)  # a0 most recent, but it is a parent: must wait for a1, a2
    evicted = ci.evict_to_budget(db, budget_bytes=sum(ci.get_chunk(db, k).bytes for k in [a[0], *b]))
    assert [r.key for r in evicted] == [a[2], a[1]]
    ci.set_pinned(db, [b[1]], True)
    evicted = ci.evict_to_budget(db, budget_bytes=0)
    assert [r.key for r in evicted] == [a[0]]  # b1 pinned, so b0 is not a leaf
    assert {r.key for r in ci.list_chunks(db)} == set(b)
    assert ci.totals(db).pinned_count == 1
    assert sorted(p.name for p in kv_dir().glob("*/*")) == sorted(f"{k}.safetensors" for k in b)


def test_unref_deletes_only_unshared_tail_of_chain():
    db = get_db()
    doc = add_chain(db, 2, seed=1)
    chat1 = doc + add_chain(db, 2, seed=2, parent=doc[-1])
    chat2 = doc + add_chain(db, 1, seed=3, parent=doc[-1])
    ci.ref_chunks(db, chat1)
    ci.ref_chunks(db, chat2)
    assert ci.unref_chunks(db, chat1) == list(reversed(chat1[2:]))
    assert ci.get_chunk(db, doc[0]).ref_count == 1
    assert ci.unref_chunks(db, chat2) == list(reversed(chat2))
    assert ci.list_chunks(db) == []


def test_gc_respects_writer_window():
    db = get_db()
    keep, gone = add_chain(db, 2)
    ci.get_chunk(db, gone).path.unlink()
    orphan = kv_dir() / "zz" / ("zz" * 16 + ".safetensors")
    orphan.parent.mkdir(mode=0o700)
    orphan.write_bytes(b"x" * 10)
    temp = kv_dir() / "zz" / ".zz.123.ab.tmp"
    temp.write_bytes(b"y" * 5)
    report = ci.gc(db, writer_window_s=600)
    assert report == ci.GcReport(files_removed=0, bytes_freed=0, rows_removed=1)  # files are too young
    assert orphan.exists() and temp.exists()
    report = ci.gc(db, writer_window_s=600, now=time.time() + 601)
    assert report == ci.GcReport(files_removed=2, bytes_freed=15, rows_removed=0)
    assert [r.key for r in ci.list_chunks(db)] == [keep] and ci.get_chunk(db, keep).path.exists()


@pytest.mark.fault
def test_verify_reports_and_drops_bad_files():
    db = get_db()
    good, bad, missing = add_chain(db, 3)
    path = ci.get_chunk(db, bad).path
    path.write_bytes(path.read_bytes()[:-3])
    ci.get_chunk(db, missing).path.unlink()
    errors = ci.verify_chunks(db, drop=False)
    assert sorted(e.kind for e in errors) == ["missing", "truncated"]
    assert len(ci.list_chunks(db)) == 3
    assert len(ci.verify_chunks(db)) == 2 and [r.key for r in ci.list_chunks(db)] == [good]
    assert ci.verify_chunks(db) == []


@pytest.mark.fault
def test_disk_full_abandons_write_cleanly(monkeypatch):
    db = get_db()
    real_write_all = snapshot._write_all

    def write_until_full(fd, buf):
        real_write_all(fd, bytes(memoryview(buf)[:100]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(snapshot, "_write_all", write_until_full)
    home = kv_dir()
    key = chunk_key(FP, None, range(16))
    with pytest.raises(OSError) as ei:
        ci.add_chunk(db, data(1), key=key, parent_key=None, fingerprint=FP)
    assert ei.value.errno == errno.ENOSPC
    assert ci.list_chunks(db) == [] and list(kv_dir().glob("*/*")) == []
    monkeypatch.setattr(snapshot, "_write_all", real_write_all)
    assert kv_dir() == home
    ci.add_chunk(db, data(1), key=key, parent_key=None, fingerprint=FP)
    assert len(ci.list_chunks(db)) == 1


@pytest.mark.fault
def test_crash_between_rename_and_row_insert_leaves_orphan_for_gc():
    db = get_db()
    key = chunk_key(FP, None, range(16))
    code = ("import torch; from kvchat.index import get_db; from kvchat.store.chunk_index import add_chunk; "
            "from kvchat.store.snapshot import ChunkData; "
            "d = ChunkData(torch.zeros(2, 16, 2, 8, dtype=torch.float16), torch.zeros(2, 16, 2, 8, dtype=torch.float16)); "
            f"add_chunk(get_db(), d, key={key!r}, parent_key=None, fingerprint='x')")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVCHAT_CRASH_AT": "chunk_after_rename"})
    assert proc.returncode == -9
    assert ci.get_chunk(db, key) is None and (kv_dir() / key[:2] / f"{key}.safetensors").exists()
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    row = ci.add_chunk(db, data(1), key=key, parent_key=None, fingerprint=FP)  # a later writer replaces the orphan
    ci.load_chunk(db, row, LAYOUT)
    assert ci.gc(db, writer_window_s=0).files_removed == 0
