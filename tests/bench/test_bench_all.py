"""``kvchat bench all``: the real benchmarks at tiny settings write valid JSON (with where/when/what they
ran on) and PNG plots; ``--replot`` redraws from the JSON; without matplotlib it says so in one line."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvchat.bench.all import bench_settings, load_results, plot_and_report, run_all
from kvchat.bench.plots import PLOTS_MISSING, write_plots
from kvchat.bench.resume import summarise
from kvchat.cli.main import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[2]


def _tiny(name: str) -> argparse.Namespace:
    ns = bench_settings(name, True, argparse.Namespace(model=None, kv_dtype="fp8", threads=1, text=[]))
    tiny = {"memory": {"mix_chats": 40, "budget_gib": [0.25]},
            "engine": {"lengths": [48], "decode_tokens": 2, "repeats": 1},
            "fidelity": {"tokens": 64, "retrieval_tokens": 160, "depths": [0.5]}}[name]
    for k, v in tiny.items():
        setattr(ns, k, v)
    return ns


def _head() -> str | None:
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    return git.stdout.strip() if git.returncode == 0 else None


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000, f"{path.name} is not a drawn PNG"


@pytest.fixture
def threads_restored():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def test_bench_all_quick_plumbing_writes_json_and_plots(smol_info, tmp_path, threads_restored, capsys):
    settings = {name: _tiny(name) for name in ("memory", "engine", "fidelity")}
    heads = {_head()}
    results = run_all(tmp_path, settings, quick=True)
    plot_and_report(results, tmp_path)
    heads.add(_head())  # a commit landing during the run may be either
    for name in settings:
        res = json.loads((tmp_path / f"{name}.json").read_text())
        assert "error" not in res, res.get("traceback")
        run = res["run"]
        assert run["quick"] is True
        assert run["machine"]["cpu_model"] and run["machine"]["cores"] >= 1
        assert run["machine"]["threads"] == 1
        assert run["packages"]["torch"] == torch.__version__
        if None not in heads:
            assert run["git"]["commit"] in heads
        assert res["wall_s"] > 0

    mem = results["memory"]
    fp8 = next(p for p in mem["pools"] if p["kv_dtype"] == "fp8")
    cfg = smol_info.config
    assert fp8["bytes_per_token"] == 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)
    eng = results["engine"]
    assert {r["backend"] for r in eng["runs"]} == {"kvchat-fp8", "kvchat-bf16", "kvchat-fp8-int8", "kvchat-bf16-int8", "transformers",
                                                      "transformers-fp8-cache"}
    assert all(r["prefill_tok_s"]["median"] > 0 and r["decode_tok_s"]["median"] > 0 for r in eng["runs"])
    ret = results["fidelity"]["retrieval"]
    assert [r["depth"] for r in ret["rows"]] == [None, 0.5]
    planted = ret["rows"][1]
    assert all(math.isfinite(planted[kv]["logprob_sum"]) and planted[kv]["logprob_sum"] < 0 for kv in ("bf16", "fp8"))
    assert planted["fp8_minus_bf16"] != 0, "fp8 and bf16 pools scored identically: no quantization happened"

    for png in ("memory_bytes_per_token.png", "engine_tok_s.png", "retrieval_by_depth.png"):
        _assert_png(tmp_path / png)
    assert not (tmp_path / "resume_curve.png").exists(), "a benchmark that did not run got a plot"

    for png in tmp_path.glob("*.png"):  # --replot redraws every plot from the JSON alone
        png.unlink()
    assert main(["bench", "all", "--out", str(tmp_path), "--replot"]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["engine_tok_s.png", "memory_bytes_per_token.png",
                                                               "retrieval_by_depth.png"]
    assert "wrote" in capsys.readouterr().out


def test_resume_curve_plot_from_the_resume_summariser(tmp_path):
    disk = {"cold_bytes_per_s": {"median": 0.6e9}, "hot_bytes_per_s": {"median": 2.7e9}}
    summaries = []
    for n, cold, restore in ((512, 3900.0, 8.0), (2048, 18500.0, 60.0)):
        resumes = {mode: [{"restore_ms": restore * k, "ttft_ms": restore * k + 200, "bytes_read": 12242 * n,
                           "resident_before": None, "load_ms": 900.0, "peak_rss_bytes": 700 << 20}
                          for k in (1.0, 1.2)] for mode in ("warm", "dropped")}
        build = {"cold_prefill_ms": cold, "snapshot_bytes": 12242 * n, "snapshot_files": 2, "f16_bytes": 23040 * n,
                 "ttft_in_memory_ms": 150.0, "question_tokens": 15, "load_ms": 1500.0, "peak_rss_bytes": 900 << 20}
        summaries.append(summarise({"tokens": n, "builds": [build], "resumes": resumes}, disk))
    res = {"benchmark": "resume", "summary": summaries, "run": {"quick": True}}
    written = write_plots({"resume": res, "startup": {"summary": {}}}, tmp_path)
    assert written == [tmp_path / "resume_curve.png"]
    _assert_png(written[0])


def test_without_matplotlib_json_only_and_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    (tmp_path / "memory.json").write_text(json.dumps({"benchmark": "memory", "pools": [{"kv_dtype": "fp8"}]}))
    plot_and_report(load_results(tmp_path), tmp_path)
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [PLOTS_MISSING]
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama-cpp-python is installed")
def test_bench_peers_without_llama_cpp_is_one_error_line(capsys):
    assert main(["bench", "peers", "--resume-tokens", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvchat: error: llama-cpp-python is not installed (pip install 'kvchat[peers]')"]
