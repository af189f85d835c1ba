"""The TUI never ends in a traceback over a damaged database, a read-only data dir, or a failed flush at quit.

Where it cannot run it exits non-zero with one ``kvchat: error: …`` line and
leaves every file it found as it was.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvchat.tui.app import EXIT_CANNOT_RUN, EXIT_NOT_SAVED, KvchatApp
from kvchat.tui.fake_backend import FakeBackend
from kvchat.tui.real_backend import RealBackend

pytestmark = [pytest.mark.tui, pytest.mark.fault]

SIZE = (100, 30)
HEADLESS = {"TEXTUAL_DRIVER": "textual.drivers.headless_driver:HeadlessDriver"}
CAPS_WITHOUT_OVERRIDE = (1, 2, 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
PR_CAPBSET_DROP = 24
RUN_KVCHAT = "import sys; from kvchat.cli.main import main; sys.exit(main(sys.argv[1:]))"


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` with the sha256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def garbage_db(home: Path) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    (home / "kvchat.db").write_bytes(bytes(range(256)) * 40)
    return tree(home)


def _drop_root_override() -> None:
    """In the child: root loses the capabilities that ignore file modes, so a read-only dir is read-only."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in CAPS_WITHOUT_OVERRIDE:
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def run_kvchat(home: Path, *argv: str, timeout: float = 90) -> subprocess.CompletedProcess:
    """``kvchat ARGV`` (no ARGV: the TUI, headless) in a fresh process on data dir ``home``; root runs without
    DAC override."""
    env = {**os.environ, **HEADLESS, "KVCHAT_HOME": str(home)}
    pre = _drop_root_override if os.geteuid() == 0 else None
    return subprocess.run([sys.executable, "-c", RUN_KVCHAT, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=pre, check=False)


def assert_one_error_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == EXIT_CANNOT_RUN, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvchat: error: "), proc.stderr
    for w in words:
        assert w in lines[0], lines[0]


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

