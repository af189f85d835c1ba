"""``kvchat bench serve`` plumbing: real server processes, tiny sizes; the figures are not checked, only their sources."""

import argparse

from kvchat.bench.serve import format_report, run_serve


def test_bench_serve_measures_cold_warm_restart_and_streams(smol_info):
    ns = argparse.Namespace(history_tokens=256, decode_tokens=4, streams=[1, 2], repeats=2, threads=1, model=None, kv_dtype="fp8")
    res = run_serve(ns, quick=True)
    cold, warm, restart = res["turns"]
    assert cold["cached_tokens"] == 0 and cold["prefilled_tokens"] == cold["prompt_tokens"]
    # warm: from the pool up to its last chunk edge, the turn's snapshot the rest (the server waits for the
    # last turn's snapshot writes before it looks a continued chat up); a restart: from disk only
    assert warm["from_memory"] > warm["from_disk"] and warm["from_memory"] + warm["from_disk"] >= warm["prompt_tokens"] - 32
    assert restart["from_disk"] > 0 and restart["from_memory"] == 0
    assert restart["cached_tokens"] >= warm["prompt_tokens"] - 32
    assert [r["streams"] for r in res["concurrency"]] == [1, 2] and len(res["rounds"]) == 2
    assert all(r["round_count"] == 2 for r in res["concurrency"])
    for one, two in res["rounds"]:  # each round's ratio against that round's own single stream
        assert two["aggregate_vs_one_stream"] == round(two["aggregate_tokens_per_s"] / one["aggregate_tokens_per_s"], 2)
    ratios = sorted(two["aggregate_vs_one_stream"] for _, two in res["rounds"])
    assert res["concurrency"][1]["aggregate_vs_one_stream_range"] == [ratios[0], ratios[-1]]
    assert all(r["aggregate_tokens_per_s"] > 0 for r in res["concurrency"])
    assert "after restart (disk)" in format_report(res)
