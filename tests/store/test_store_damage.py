"""Damage found before the work, not after it: a database with garbage in its middle, a
full disk, a read-only data dir. Each is one line naming the cause, exit 2, and nothing the user had changes."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from process_helpers import assert_one_error_line, run_kvchat, tree
from server_helpers import free_port

from kvchat.index import get_db
from kvchat.store.conversations import NewMessage, append_turn, create_conversation, get_conversation
from kvchat.store.db import backups_dir, connect, database_error_line

pytestmark = pytest.mark.fault

PAGE = 4096


def _chats(home: Path, n: int = 40) -> list[str]:
    """A database with ``n`` stored chats (several pages of rows), closed again."""
    db = connect(home / "kvchat.db")
    ids = []
    for i in range(n):
        c = create_conversation(db, title=f"chat {i}", model_fingerprint="m", model_name="m", system_prompt="s")
        append_turn(db, c.id, list(range(300)), [NewMessage("user", f"message {i} " * 40, 0, 300)])
        ids.append(c.id)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return ids


def _garbage_in_the_middle(path: Path) -> None:
    """Overwrite a few pages in the middle of the file with bytes that are no b-tree page."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek((size // PAGE // 2) * PAGE)
        f.write(bytes(range(256)) * (3 * PAGE // 256))


def test_a_database_with_garbage_in_its_middle_is_refused_by_every_command(kvchat_home, tmp_path):
    kvchat_home.mkdir()
    ids = _chats(kvchat_home)
    backups_dir(kvchat_home / "kvchat.db").mkdir()
    shutil.copy(kvchat_home / "kvchat.db", backups_dir(kvchat_home / "kvchat.db") / "kvchat-1-before-m005.db")
    _garbage_in_the_middle(kvchat_home / "kvchat.db")
    before = tree(kvchat_home)
    for argv in (["cache", "ls"], ["cache", "verify"], ["doc", "list"], ["ask", "hello", "--chat", ids[0]],
                 ["serve", "--port", str(free_port())]):
        proc = run_kvchat(kvchat_home, *argv)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert proc.stdout == "", "nothing was generated or listed from a damaged index"
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "is damaged" in lines[0] and str(backups_dir(kvchat_home / "kvchat.db")) in lines[0], (argv, lines)
    proc = run_kvchat(kvchat_home, "ask", "hello", "--chat", ids[0], "--json")
    assert proc.returncode == 2 and json.loads(proc.stdout)["error"]["type"] == "database_error", proc.stdout
    proc = run_kvchat(kvchat_home)  # the TUI: one line before the model loads
    assert_one_error_line(proc, "is damaged")
    assert tree(kvchat_home) == before


def test_a_full_database_is_named_as_such(kvchat_home):
    db = get_db()
    db.execute("VACUUM")
    db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
    with pytest.raises(sqlite3.OperationalError) as info:
        c = create_conversation(db, title="x")
        append_turn(db, c.id, list(range(3000)), [NewMessage("user", "word " * 3000, 0, 1)])
    line = database_error_line(info.value, kvchat_home / "kvchat.db")
    assert line.startswith("no space left for the database") and "MB free" in line and "nothing was stored" in line


def test_read_only_data_dir_still_lists_and_refuses_to_ask_before_loading(kvchat_home):
    kvchat_home.mkdir()
    _chats(kvchat_home, 2)
    before = tree(kvchat_home)
    for p in [kvchat_home, *kvchat_home.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        ls = run_kvchat(kvchat_home, "cache", "stats")
        docs = run_kvchat(kvchat_home, "doc", "list")
        ask = run_kvchat(kvchat_home, "ask", "hello")
    finally:
        for p in [kvchat_home, *kvchat_home.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
    assert ls.returncode == 0 and "chunks 0" in ls.stdout, ls.stderr
    assert docs.returncode == 0, docs.stderr
    assert ask.returncode == 2 and ask.stdout == ""
    lines = ask.stderr.strip().splitlines()
    assert len(lines) == 1 and "is read-only" in lines[0] and "Errno" not in lines[0], lines
    assert tree(kvchat_home) == before


@pytest.fixture()
def small_disk(tmpfs):
    """A 24 MB tmpfs (a real file system that fills up); skipped where mounting is not allowed."""
    return tmpfs("24m")


def test_a_full_disk_is_said_before_the_answer_is_generated(smol_info, small_disk, monkeypatch):
    home = small_disk / "home"
    env = {**os.environ, "KVCHAT_HOME": str(home), "OMP_NUM_THREADS": "1"}

    def ask(*argv):
        return subprocess.run([sys.executable, "-m", "kvchat.cli", "ask", *argv, "--threads", "1"], env=env,
                              capture_output=True, text=True, timeout=600)

    first = ask("Name a fruit.", "--max-tokens", "3", "--json")
    assert first.returncode == 0, first.stderr
    chat = json.loads(first.stdout)["chat_id"]
    filler = small_disk / "filler"
    free = shutil.disk_usage(small_disk).free
    filler.write_bytes(b"\0" * (free - 2 * 2**20))  # 2 MB left: less than a 64-token turn's snapshot needs
    before = tree(home)
    full = ask("Name a colour.", "--chat", chat, "--max-tokens", "64")
    assert full.returncode == 2 and full.stdout == "", "refused before generating anything"
    lines = full.stderr.strip().splitlines()
    assert len(lines) == 1 and "not enough free space" in lines[0] and "MB free" in lines[0], lines
    assert tree(home) == before
    filler.unlink()
    again = ask("Name a colour.", "--chat", chat, "--max-tokens", "3")
    assert again.returncode == 0, again.stderr
    monkeypatch.setenv("KVCHAT_HOME", str(home))
    assert [m.text for m in get_conversation(get_db(), chat).messages[::2]] == ["Name a fruit.", "Name a colour."]


def test_a_damaged_database_without_backups_names_the_next_step(kvchat_home):
    kvchat_home.mkdir()
    _chats(kvchat_home)
    _garbage_in_the_middle(kvchat_home / "kvchat.db")
    before = tree(kvchat_home)
    proc = run_kvchat(kvchat_home, "cache", "ls")
    assert_one_error_line(proc, "is damaged", "there is no backup of it: move it away to start a new index")
    assert tree(kvchat_home) == before
