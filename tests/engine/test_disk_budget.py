"""The default disk budget on a real small file system (tmpfs): fixed by the disk, not raised by the cache's own
growth, and a snapshot never takes the disk's free floor, whatever the chat's size."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch

from kvchat.engine.disk_budget import budget_bytes, default_budget, free_floor
from kvchat.engine.persistence import chain
from kvchat.index import get_db
from kvchat.store.chunk_index import add_chunk, totals
from kvchat.store.snapshot import ChunkData

pytestmark = pytest.mark.fault

FP = "e" * 32
MB = 10**6


def test_the_floor_keeps_5_percent_and_1_gb_but_a_tenth_of_a_small_disk():
    assert [free_floor(n) for n in (40 * MB, 5 * 10**9, 10 * 10**9, 100 * 10**9, 10**12)] == [
        4 * MB, 500 * MB, 10**9, 5 * 10**9, 50 * 10**9]


def test_the_cache_growing_does_not_raise_the_default_budget(tmpfs, monkeypatch):
    mnt = tmpfs("40m")
    monkeypatch.setenv("KVCHAT_HOME", str(mnt / "home"))
    db = get_db()
    start = budget_bytes(db)
    disk = shutil.disk_usage(mnt)
    assert start == int(0.2 * disk.free) and start < 8.4 * MB
    ids = list(range(256 * 12))
    for link in chain(FP, ids, [len(ids)]):  # 12 chunks of ~0.5 MB, as the snapshot writer adds them
        kv = torch.zeros(4, link.end - link.start, 2, 64, dtype=torch.float16)
        add_chunk(db, ChunkData(kv, kv.clone()), key=link.key, parent_key=link.parent_key, fingerprint=FP)
        now = budget_bytes(db)
        assert abs(now - start) < 0.1 * MB, "only the index's own growth (others' use) moves it"
    assert totals(db).bytes > 6 * MB
    disk = shutil.disk_usage(mnt)
    assert default_budget(disk.total, 0, totals(db).bytes) <= totals(db).bytes - free_floor(disk.total), \
        "filled by others, the disk takes the floor back from the cache"


def test_a_snapshot_larger_than_the_disk_leaves_its_floor_free(smol_info, tmpfs, tmp_path, monkeypatch):
    """``kvchat ask --doc`` whose prefix's snapshot (~28 MB) exceeds a 24 MB disk: the answer comes, the snapshot
    stops at the budget (one warning line), and the disk's free space never goes under the floor."""
    mnt = tmpfs("24m")
    doc = tmp_path / "mills.txt"
    doc.write_text("\n\n".join(f"Section {i}. The river Alder passes mill {i * 7}; its miller keeps {i + 3} cats "
                               "and a grain ledger." for i in range(60)))
    env = {**os.environ, "KVCHAT_HOME": str(mnt / "home"), "KVCHAT_MODELS": str(smol_info.path.parent)}
    floor = free_floor(shutil.disk_usage(mnt).total)
    lowest, done = [shutil.disk_usage(mnt).free], threading.Event()

    def watch() -> None:
        while not done.wait(0.002):
            lowest[0] = min(lowest[0], shutil.disk_usage(mnt).free)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        ask = subprocess.run([sys.executable, "-m", "kvchat.cli", "ask", "--doc", str(doc), "Which mill?",
                              "--max-tokens", "3", "--threads", "1"], env=env, capture_output=True, text=True,
                             timeout=600)
    finally:
        done.set()
        watcher.join()
    assert ask.returncode == 0 and ask.stdout.strip(), ask.stderr
    warnings = [line for line in ask.stderr.splitlines() if line.startswith("kvchat: warning:")]
    assert len(warnings) == 1 and "KV snapshot stopped at token" in warnings[0], ask.stderr
    assert lowest[0] >= floor, f"{lowest[0]} bytes free at the lowest, under the {floor}-byte floor"
    monkeypatch.setenv("KVCHAT_HOME", env["KVCHAT_HOME"])
    db = get_db()
    assert 0 < totals(db).bytes <= budget_bytes(db), "the snapshot's first chunks are kept, within the budget"
