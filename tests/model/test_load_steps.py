"""Getting a model ready says each step: the TUI's backend emits every step as a status line (nothing on
stderr); a CLI run on a model never loaded here says its first-time steps (fp8 calibration, int8
quantization, kernel builds) on stderr, and a second run says none of them."""

from __future__ import annotations

import os
import shutil

import pytest
from process_helpers import run_kvchat

from kvchat.conversation.events import LoadProgress
from kvchat.tui.real_backend import RealBackend

pytestmark = pytest.mark.model


def test_tui_backend_shows_each_load_step_in_the_status(smol_info, capfd):
    heard: list[LoadProgress] = []
    backend = RealBackend(str(smol_info.path), "fp8", threads=1)
    try:
        backend.load(heard.append)
    finally:
        backend.shutdown()
    texts = [e.message for e in heard]
    assert texts[0] == "importing torch and transformers"
    assert f"loading {smol_info.name}: tokenizer" in texts and f"loading {smol_info.name}: weights (int8)" in texts
    assert texts.index(f"loading {smol_info.name}: tokenizer") < texts.index(f"loading {smol_info.name}: weights (int8)")
    assert "kvchat:" not in capfd.readouterr().err  # under the TUI nothing goes to the terminal


def test_a_first_start_says_its_one_time_steps_on_stderr(tmp_path, smol_info, monkeypatch):
    models = tmp_path / "models"  # the model itself, but no calibration or int8 weights stored beside it
    models.mkdir()
    (models / smol_info.name).symlink_to(smol_info.path, target_is_directory=True)
    monkeypatch.setenv("KVCHAT_MODELS", str(models))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no compiled kernels either
    home = tmp_path / "home"
    first = run_kvchat(home, "ask", "Hi.", "--max-tokens", "1", "--threads", "1", timeout=600)
    assert first.returncode == 0, first.stderr
    said = [line for line in first.stderr.splitlines() if line.endswith(" …")]
    assert f"kvchat: calibrating fp8 K centring for {smol_info.name} (once per model) …" in said, first.stderr
    assert any(line.startswith("kvchat: quantizing ") and "to int8 (once per model)" in line for line in said), said
    if shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc"):
        assert any(line.startswith("kvchat: building the compiled CPU kernel cpu_attention") for line in said), said
    again = run_kvchat(home, "ask", "Hi.", "--max-tokens", "1", "--threads", "1", timeout=600)
    assert again.returncode == 0, again.stderr
    assert not [line for line in again.stderr.splitlines() if line.endswith(" …")], again.stderr
