"""A truncated imported model: ``model list`` still lists it, and ``ask``/``model pull`` are one error line
that says how to repair it (remove the folder, pull again), never a traceback."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from process_helpers import assert_one_error_line, run_kvchat

pytestmark = pytest.mark.model
TRUNCATED_BYTES = 200_000_000  # as in the trial: the last layers' tensors run past the end


@pytest.fixture
def damaged_models(tmp_path, smol_dir, monkeypatch):
    models = tmp_path / "models"
    shutil.copytree(smol_dir, models / smol_dir.name)
    os.truncate(models / smol_dir.name / "model.safetensors", TRUNCATED_BYTES)
    monkeypatch.setenv("KVCHAT_MODELS", str(models))
    return models / smol_dir.name


def test_model_list_lists_a_damaged_model_with_the_repair(damaged_models, tmp_path):
    proc = run_kvchat(tmp_path / "home", "model", "list")
    assert proc.returncode == 0, proc.stderr
    assert damaged_models.name in proc.stdout and "damaged" in proc.stdout
    assert "Traceback" not in proc.stderr and f"remove {damaged_models}" in proc.stderr


@pytest.mark.parametrize("argv", [["ask", "hi", "--max-tokens", "2"], ["model", "pull"]], ids=["ask", "pull"])
def test_a_damaged_model_is_one_error_line_with_the_repair(damaged_models, tmp_path, argv):
    proc = run_kvchat(tmp_path / "home", *argv, timeout=300)
    assert_one_error_line(proc, "runs past the end of the file", f"remove {damaged_models}", "kvchat model pull")


def test_ask_json_on_a_damaged_model_is_one_json_error(damaged_models, tmp_path):
    proc = run_kvchat(tmp_path / "home", "ask", "hi", "--max-tokens", "2", "--json", timeout=300)
    assert proc.returncode == 2 and proc.stderr == "", proc.stderr
    (line,) = proc.stdout.splitlines()
    err = json.loads(line)["error"]
    assert err["exit_status"] == 2 and "runs past the end of the file" in err["message"], err
    assert f"remove {damaged_models}" in err["message"]
