"""The TUI never ends in a traceback over a damaged database, a read-only data dir, or a failed flush at quit.

Where it cannot run it exits non-zero with one ``kvchat: error: …`` line and
leaves every file it found as it was.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from process_helpers import assert_one_error_line, run_kvchat, tree

from kvchat.tui.app import EXIT_CANNOT_RUN, EXIT_NOT_SAVED, KvchatApp
from kvchat.tui.fake_backend import FakeBackend
from kvchat.tui.real_backend import RealBackend

pytestmark = [pytest.mark.tui, pytest.mark.fault]

SIZE = (100, 30)


def garbage_db(home: Path) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    (home / "kvchat.db").write_bytes(bytes(range(256)) * 40)
    return tree(home)


@pytest.mark.asyncio
async def test_damaged_database_exits_with_one_line_before_loading_the_model(kvchat_home):
    before = garbage_db(kvchat_home)
    backend = RealBackend("no-such-model")  # never reached: the store is checked first
    app = KvchatApp(backend)
    t0 = time.monotonic()
    async with app.run_test(size=SIZE) as pilot:
        while app.is_running and time.monotonic() - t0 < 30:
            await pilot.pause(0.05)
    backend.shutdown()
    assert app.return_code == EXIT_CANNOT_RUN
    assert str(kvchat_home / "kvchat.db") in app.error_line and "file is not a database" in app.error_line
    assert "\n" not in app.error_line
    assert tree(kvchat_home) == before  # no -wal/-shm, no backup, the bytes untouched


def test_damaged_database_through_the_kvchat_command(kvchat_home):
    before = garbage_db(kvchat_home)
    proc = run_kvchat(kvchat_home)
    assert_one_error_line(proc, "kvchat.db", "file is not a database")
    assert "backups" not in proc.stderr, "no backup exists, so none is offered"
    assert tree(kvchat_home) == before


def test_truncated_database_beside_chunks_is_refused_not_replaced(kvchat_home):
    chunk = kvchat_home / "kv" / "ab" / ("ab" * 16 + ".safetensors")
    chunk.parent.mkdir(parents=True)
    chunk.write_bytes(b"chunk bytes")
    (kvchat_home / "kvchat.db").write_bytes(b"")
    before = tree(kvchat_home)
    proc = run_kvchat(kvchat_home)
    assert_one_error_line(proc, "kvchat.db", "is empty (0 bytes)", "truncated")
    assert tree(kvchat_home) == before, "a fresh schema would orphan the chunks (and cache gc would delete them)"


def test_data_dir_that_is_a_file(tmp_path):
    home = tmp_path / "a-file"
    home.write_text("mine")
    proc = run_kvchat(home)
    assert_one_error_line(proc, f"{home} is not a directory")
    assert "dir  " not in proc.stderr and home.read_text() == "mine"


def test_read_only_empty_data_dir(tmp_path):
    home = tmp_path / "ro-home"
    home.mkdir()
    home.chmod(0o555)
    try:
        proc = run_kvchat(home)
    finally:
        home.chmod(0o755)
    assert_one_error_line(proc, str(home))
    assert list(home.iterdir()) == []


def test_read_only_data_dir_with_chats_keeps_them(tmp_path):
    from kvchat.store.conversations import create_conversation
    from kvchat.store.db import connect

    home = tmp_path / "ro-home"
    home.mkdir()
    db = connect(home / "kvchat.db")
    create_conversation(db, title="keep me", model_fingerprint="m", model_name="m", system_prompt="s", settings={})
    db.close()
    before = tree(home)
    for p in [home, *home.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        proc = run_kvchat(home)
    finally:
        for p in [home, *home.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
    assert_one_error_line(proc, "kvchat.db", "writable")
    assert tree(home) == before


class FlushFails(FakeBackend):
    """A backend whose final flush hits a full disk."""

    def shutdown(self) -> None:
        super().shutdown()
        raise OSError(28, "No space left on device")


@pytest.mark.asyncio
async def test_failed_flush_at_quit_is_one_line_and_exit_code():
    backend = FlushFails()
    app = KvchatApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.2)
        await pilot.press("ctrl+q")
        t0 = time.monotonic()
        while app.is_running and time.monotonic() - t0 < 10:
            await pilot.pause(0.05)
    assert backend.shutdown_called and app.return_code == EXIT_NOT_SAVED
    assert app.error_line.startswith("saving the KV cache at quit failed") and "No space left" in app.error_line

