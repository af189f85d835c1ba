"""``kvchat bench peers`` cut down for sizes a run cannot afford whole: kvchat's side alone (``--skip-llama``), its
rates from the resume chat (``--skip-speed``), each cut named in the JSON, with the fresh processes' load time and
peak resident set; a cut that leaves nothing to measure is one error line."""

from __future__ import annotations

import argparse

import pytest

from kvchat.bench.peers import format_report, run_peers
from kvchat.cli.main import main


def test_skip_speed_without_a_resume_chat_is_one_error_line(capsys):
    assert main(["bench", "peers", "--skip-llama", "--skip-speed", "--resume-tokens", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvchat: error: --skip-speed takes its figures from the resume chat: give --resume-tokens N"]


@pytest.mark.model
def test_kvchat_side_alone_reports_rates_from_the_resume_chat_with_load_and_peak_memory(smol_info, monkeypatch):
    monkeypatch.setenv("KVCHAT_MODELS", str(smol_info.path.parent))  # the imported model, its stored int8 weights
    args = argparse.Namespace(model=None, gguf=None, shape=None, threads=1, context=256, decode_tokens=4, repeats=1,
                              resume_tokens=256, skip_llama=True, skip_speed=True, kvchat_pools=["fp8"], json=None)
    res = run_peers(args)
    assert res["skipped"] == ["llama.cpp", "speed prefill"] and res["gguf"] is None and res["ratios"] == []
    [speed] = res["speed"]
    assert speed["backend"] == "kvchat-fp8" and speed["source"] == "resume chat"
    resume = res["resume"]
    cold = resume["kvchat_cold_prefill_ms"]["median"]
    assert speed["prefill_tok_s"]["median"] == pytest.approx(256 / (cold / 1e3), rel=1e-3)
    assert speed["decode_tok_s"]["median"] > 0  # the answer ran its 4 tokens after the first (random stops aside)
    assert [r["who"] for r in resume["rows"]] == ["kvchat cold prefill", "kvchat fp8 snapshot, page cache warm",
                                                  "kvchat fp8 snapshot, page cache dropped"]
    # three fresh processes (the chat, a warm and a dropped resume), each with its load time; the peak is theirs
    assert len(resume["kvchat_load_ms"]["samples"]) == 3 and resume["kvchat_load_ms"]["min"] > 0
    assert 100 << 20 < resume["kvchat_peak_rss_bytes_chat"] <= resume["kvchat_peak_rss_bytes"] < 8 << 30
    report = format_report(res)
    assert "(llama.cpp skipped)" in report and "speed from the resume chat" in report and "peak RSS" in report
