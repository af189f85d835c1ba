"""Two processes on one data dir, both writing turns and chunks: no corruption, no lost turn, no half-visible chunk."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvchat.index import get_db, kv_dir
from kvchat.store import chunk_index as ci
from kvchat.store.conversations import create_conversation, get_conversation
from kvchat.store.db import close_thread_dbs

TURNS = 20

WRITER = """
import os, sys, time, torch
from kvchat.index import get_db
from kvchat.store.conversations import NewMessage, append_turn
from kvchat.store.chunk_index import add_chunk
from kvchat.store.keys import chunk_key
from kvchat.store.snapshot import ChunkData
torch.set_num_threads(1)
who, shared, own, turns = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
db = get_db()
open(os.path.join(os.environ["KVCHAT_HOME"], f"ready-{who}"), "w").close()
while len([f for f in os.listdir(os.environ["KVCHAT_HOME"]) if f.startswith("ready-")]) < 2:
    time.sleep(0.01)  # start barrier: both processes write at the same time
parent = None
for t in range(turns):
    append_turn(db, shared, [t, t], [NewMessage("user", f"{who}-{t}", 0, 2)])
    append_turn(db, own, [t], [NewMessage("user", f"{who}-{t}", 0, 1)], expected_version=t)
    key = chunk_key("fp", parent, range(16 * t, 16 * t + 16))  # the same chain in both processes
    fill = float(ord(who[0]))
    data = ChunkData(torch.full((2, 16, 2, 8), fill, dtype=torch.float16), torch.zeros(2, 16, 2, 8, dtype=torch.float16))
    add_chunk(db, data, key=key, parent_key=parent, fingerprint="fp")
    parent = key
"""


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    yield
    close_thread_dbs()


def test_two_writer_processes():
    db = get_db()
    shared = create_conversation(db, title="shared").id
    own = {who: create_conversation(db, title=who).id for who in ("a", "b")}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, who, shared, own[who], str(TURNS)]) for who in own]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    conv = get_conversation(db, shared)
    assert len(conv.messages) == 2 * TURNS and len(conv.token_ids) == 4 * TURNS and conv.token_ids_version == 2 * TURNS
    assert sorted(m.text for m in conv.messages) == sorted(f"{w}-{t}" for w in own for t in range(TURNS))
    assert all(m.token_end == m.token_start + 2 for m in conv.messages)
    for who, cid in own.items():
        assert [m.text for m in get_conversation(db, cid).messages] == [f"{who}-{t}" for t in range(TURNS)]
    rows = ci.list_chunks(db)
    assert len(rows) == TURNS and ci.verify_chunks(db, drop=False) == []
    files = sorted(p.name for p in kv_dir().glob("*/*"))
    assert files == sorted(f"{r.key}.safetensors" for r in rows)  # no temp file, no second copy
