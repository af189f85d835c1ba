"""A data dir whose disk is full to the last byte: the commands that free space, and the listings, still work.

A real tmpfs holds the data dir (SQLite index, safetensors chunk files); a filler file takes every byte left.
Each command runs as the user runs it, ``kvchat …`` in a fresh process. SQLite could not create its WAL
index (``-shm``) there, so listings read in ``locking_mode=EXCLUSIVE`` and ``cache purge``, ``cache gc``
and ``doc rm`` unlink chunk files before their transactions commit.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys

import pytest
import torch
from process_helpers import tree

from kvchat.engine.disk_budget import refresh_pins
from kvchat.engine.persistence import chain
from kvchat.index import get_db
from kvchat.store.chunk_index import add_chunk
from kvchat.store.chunk_refs import set_refs
from kvchat.store.conversations import append_turn, create_conversation, pin_conversation
from kvchat.store.db import close_thread_dbs
from kvchat.store.documents import upsert_document
from kvchat.store.snapshot import ChunkData

pytestmark = pytest.mark.fault

FP = "f" * 32
DOC = "d_00112233ff"


@pytest.fixture()
def full_home(tmpfs, monkeypatch):
    """A 24 MB tmpfs with a data dir of three chats (one pinned) and a document, ~0.5 MB per full chunk."""
    mnt = tmpfs("24m")
    home = mnt / "home"
    monkeypatch.setenv("KVCHAT_HOME", str(home))
    db = get_db()
    owners = {}
    for i, title in enumerate(["first", "second", "pinned"]):
        conv = create_conversation(db, title=title)
        ids = list(range(1000 * i, 1000 * i + 600))
        append_turn(db, conv.id, ids, [])
        owners[title] = (conv.id, _store(db, conv.id, ids, [40, 600]))
    pin_conversation(db, owners["pinned"][0], True)
    doc_ids = list(range(9000, 9300))
    upsert_document(db, DOC, "/nowhere/manual.txt", "manual.txt", len(doc_ids))
    owners["doc"] = (DOC, _store(db, DOC, doc_ids, [300]))
    refresh_pins(db)
    close_thread_dbs()  # no connection of this process holds the -shm: the commands meet the disk alone
    return mnt, home, owners


def _store(db, owner: str, ids: list[int], ends: list[int]) -> set[str]:
    keys = set()
    for link in chain(FP, ids, ends):
        n = link.end - link.start
        kv = torch.zeros(4, n, 2, 64, dtype=torch.float16)
        add_chunk(db, ChunkData(kv, kv.clone()), key=link.key, parent_key=link.parent_key, fingerprint=FP)
        keys.add(link.key)
    set_refs(db, owner, sorted(keys), FP)
    return keys


def fill(mnt) -> None:
    """Take every byte the file system has left (a file grown until ENOSPC, one byte at the end)."""
    fd = os.open(mnt / f"filler-{len(list(mnt.glob('filler-*')))}", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (2**20, 2**12, 1):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    break
    finally:
        os.close(fd)
    assert shutil.disk_usage(mnt).free == 0


def kvchat(home, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVCHAT_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "kvchat.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=120)


def chunk_keys(home) -> set[str]:
    return {p.stem for p in (home / "kv").rglob("*.safetensors")}


def test_listings_read_a_full_disk(full_home):
    mnt, home, owners = full_home
    fill(mnt)
    before = tree(home)
    ls = kvchat(home, "cache", "ls")
    assert ls.returncode == 0, ls.stderr
    assert {line.split()[0] for line in ls.stdout.splitlines()[1:]} == {o for o, _ in owners.values()}
    docs = kvchat(home, "doc", "list")
    assert docs.returncode == 0, docs.stderr
    assert [line.split()[:3] for line in docs.stdout.splitlines()[1:]] == [[DOC, "300", "300"]]
    stats = kvchat(home, "cache", "stats")
    assert stats.returncode == 0 and stats.stdout.startswith(f"chunks {len(set().union(*(k for _, k in owners.values())))},"), stats
    assert tree(home) == before, "the listings wrote nothing"


def test_doc_rm_and_purge_free_a_full_disk(full_home):
    mnt, home, owners = full_home
    fill(mnt)
    rm = kvchat(home, "doc", "rm", DOC)
    assert rm.returncode == 0, rm.stderr
    assert rm.stdout.strip() == f"removed {DOC} and 2 chunk(s) nobody else uses"
    assert not chunk_keys(home) & owners["doc"][1] and shutil.disk_usage(mnt).free > 0

    fill(mnt)
    purge = kvchat(home, "cache", "purge")
    assert purge.returncode == 0, purge.stderr
    assert purge.stdout.strip() == f"purged {len(owners['first'][1] | owners['second'][1])} chunk(s)"
    assert chunk_keys(home) == owners["pinned"][1], "every unpinned chunk went, the pinned chat's stayed"
    _consistent(home, owners["pinned"][1])
    ls = kvchat(home, "cache", "ls")
    assert ls.returncode == 0 and [line.split()[0] for line in ls.stdout.splitlines()[1:]] == [owners["pinned"][0]]


def test_gc_frees_a_full_disk(full_home):
    """The budget of a disk filled by others is under the cache: ``cache gc`` evicts unpinned chunks, LRU."""
    mnt, home, owners = full_home
    fill(mnt)
    gc = kvchat(home, "cache", "gc")
    assert gc.returncode == 0, gc.stderr
    left = chunk_keys(home)
    assert owners["pinned"][1] <= left < set().union(*(k for _, k in owners.values()))
    assert shutil.disk_usage(mnt).free > 0
    _consistent(home, left)


def _consistent(home, keys: set[str]) -> None:
    """The index is whole and indexes exactly the chunk files ``keys``."""
    db = sqlite3.connect(home / "kvchat.db")
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert {r[0] for r in db.execute("SELECT key FROM kv_chunks")} == keys, "rows and files agree"
    finally:
        db.close()
