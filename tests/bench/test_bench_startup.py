"""``kvchat bench startup`` on the scripted backend: marks in order, torch never imported by the UI."""

from __future__ import annotations

import argparse
import json

from kvchat.bench.startup import cmd_bench_startup


def test_startup_bench_reports_first_frame_before_ready(tmp_path, capsys):
    out = tmp_path / "startup.json"
    args = argparse.Namespace(repeats=1, fake=True, json=str(out), model=None, kv_dtype="fp8", threads=None)
    assert cmd_bench_startup(args) == 0
    printed = capsys.readouterr().out
    assert "first frame" in printed and "ready (model loaded)" in printed
    result = json.loads(out.read_text())
    assert json.loads(printed.strip().splitlines()[-1]) == result
    [run] = result["runs"]
    assert 0 < run["child_start"] < run["app_imported"] < run["first_frame"] <= run["ready"]
    assert run["torch_imported_at_first_frame"] is False and run["model"] == "fake-model"


def test_children_ignore_a_kvchat_folder_in_the_working_directory(tmp_path, monkeypatch, capsys):
    # A user in the source checkout stands beside ./kvchat, which lacks the kernels/ and store/ subpackages
    # an install maps into it; `python -m`/`-c` children must import the installed package (python -P).
    (tmp_path / "kvchat").mkdir()
    (tmp_path / "kvchat" / "__init__.py").write_text("raise ImportError('the ./kvchat folder was imported')\n")
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(repeats=1, fake=True, json=None, model=None, kv_dtype="fp8", threads=None)
    assert cmd_bench_startup(args) == 0
    assert "first frame" in capsys.readouterr().out
