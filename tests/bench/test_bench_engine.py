"""``kvchat bench engine`` end to end at tiny settings on the real model (plumbing, not speed)."""

from __future__ import annotations

import json

from kvchat.cli.main import main


def test_bench_engine_writes_every_backend_ratio_target_and_the_matmul_ceiling(smol_dir, tmp_path, capsys):
    out = tmp_path / "engine.json"
    rc = main(["bench", "engine", "--lengths", "24", "40", "--decode-tokens", "2", "--repeats", "1",
               "--no-transformers", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    runs = {(r["backend"], r["context"]) for r in res["runs"]}
    backends = ("kvchat-fp8", "kvchat-bf16", "kvchat-fp8-int8", "kvchat-bf16-int8")  # fp32 and int8 weights
    assert runs == {(b, n) for b in backends for n in (24, 40)}
    assert all(r["decode_tok_s"]["median"] > 0 for r in res["runs"])
    ceiling = res["matmul_ceiling"]
    assert ceiling["decode_ceiling_tok_s"] > 0 and ceiling["prefill_ceiling_tok_s"] > 0
    # tokens/s and ms describe the same measured pass
    assert abs(ceiling["decode_ceiling_tok_s"] * ceiling["decode_ms"] / 1e3 - 1) < 0.02
    assert set(res["matmul_ceiling_per_weight_format"]) == {"fp32", "int8"}
    assert res["matmul_ceiling_per_weight_format"]["fp32"] == ceiling
    int8 = res["matmul_ceiling_per_weight_format"]["int8"]
    # bytes read: int8 values and, per 32 inputs, an fp32 scale and offset (groups scheme, 1.25 of fp32's 4 bytes:
    # 0.3125x) or per channel (~0.25x); fp32 reads 4 bytes a weight
    assert int8["weight_gb_s"] * int8["decode_ms"] < 0.32 * ceiling["weight_gb_s"] * ceiling["decode_ms"]
    assert {(r["num"], r["den"]) for r in res["ratios"]} >= {("kvchat-fp8-int8", "kvchat-fp8")}
    names = [t["name"] for t in res["targets"]]
    assert "fp8 decode / bf16 decode @40" in names and "load_runtime seconds" in names
    printed = capsys.readouterr().out
    assert "matmul ceiling" in printed and "kvchat-fp8" in printed and "int8 weights: decode" in printed
