"""``kvchat plan`` arithmetic against the figures of the seed article 004 (the 40 GB example)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvchat.cli.plan import cmd_plan
from kvchat.model.config import ModelConfig
from kvchat.plan import GIB, PlanInputError, count_params, plan_memory

# Llama-2-7B's published config.json (the article quotes L=32, hidden 4096, 32 heads, no GQA).
LLAMA2_7B = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}


def _row(plan, kv):
    return next(r for r in plan.rows if r.kv_dtype == kv)


def test_article_40gb_example_from_config():
    """7B fp16 on a 40 GB A100: 512 KiB/token, 2 GiB per 4096-token chat, 12 chats fit."""
    cfg = ModelConfig.from_hf(LLAMA2_7B)
    assert count_params(cfg) == 6_738_415_616  # Llama-2-7B's published parameter count
    plan = plan_memory(cfg, context=4096, gpu_gb=40, weight_dtype="fp16")
    fp16 = _row(plan, "fp16")
    assert fp16.bytes_per_token == 524_288
    assert fp16.bytes_per_chat == 2 * GIB
    assert fp16.chats == 12
    assert plan.gpu_bytes / GIB == pytest.approx(37.25, abs=0.01)
    # kvchat's fp8 pool: 1 byte per value plus one fp32 scale per token and KV head.
    fp8 = _row(plan, "fp8")
    assert fp8.bytes_per_token == 2 * 32 * 32 * (128 + 4)
    assert fp8.chats == int(plan.kv_budget_bytes // fp8.bytes_per_chat) == 23


def test_article_nominal_7b_arithmetic():
    """With the article's nominal 7e9 parameters: 13.04 GiB of weights, about 24.2 GiB left, 12 chats."""
    plan = plan_memory(ModelConfig.from_hf(LLAMA2_7B), context=4096, gpu_gb=40, params=7_000_000_000, weight_dtype="fp16")
    assert plan.weight_bytes / GIB == pytest.approx(13.04, abs=0.005)
    assert plan.kv_budget_bytes / GIB == pytest.approx(24.2, abs=0.05)
    assert _row(plan, "fp16").chats == 12


def test_article_gqa_and_exercise_figures():
    """8 KV heads: 128 KiB/token and about 48 chats; 70B: 320 KiB/token; the exercise: 384 MiB."""
    gqa = plan_memory(ModelConfig.from_hf(LLAMA2_7B | {"num_key_value_heads": 8}), context=4096, gpu_gb=40,
                      params=7_000_000_000, weight_dtype="fp16")
    assert _row(gqa, "fp16").bytes_per_token == 128 * 1024
    assert _row(gqa, "fp16").chats == 48
    big = ModelConfig.from_hf(LLAMA2_7B | {"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
                                           "num_key_value_heads": 8})
    assert plan_memory(big, context=16, gpu_gb=200).rows[0].bytes_per_token == 327_680
    small = ModelConfig.from_hf(LLAMA2_7B | {"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
                                             "num_key_value_heads": 16})
    assert _row(plan_memory(small, context=2048, gpu_gb=40), "fp16").bytes_per_chat == 384 * 2**20


def test_context_rounds_up_to_blocks_and_weights_too_big():
    cfg = ModelConfig.from_hf(LLAMA2_7B)
    plan = plan_memory(cfg, context=4081, gpu_gb=12)
    assert _row(plan, "fp16").bytes_per_chat == 524_288 * 4096
    assert plan.kv_budget_bytes < 0 and all(r.chats == 0 for r in plan.rows)
    with pytest.raises(PlanInputError):
        plan_memory(cfg, context=0, gpu_gb=40)


def test_a_context_beyond_the_models_is_refused_and_the_default_stays_within_it(tmp_path, capsys):
    from process_helpers import assert_one_error_line, run_kvchat

    cfg = ModelConfig.from_hf(LLAMA2_7B)
    assert plan_memory(cfg, context=4096, gpu_gb=40).context == 4096  # the model's whole context: planned
    with pytest.raises(PlanInputError, match="beyond llama2's context of 4096 tokens"):
        plan_memory(cfg, context=4097, gpu_gb=40, model="llama2")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    proc = run_kvchat(tmp_path / "home", "plan", "--model", str(tmp_path / "config.json"), "--context", "8192")
    assert_one_error_line(proc, "--context 8192 is beyond", "4096 tokens")
    proc = run_kvchat(tmp_path / "home", "plan", "--model", str(tmp_path / "config.json"), "--context", "8192", "--json")
    error = json.loads(proc.stdout)["error"]  # with --json: the error object on stdout, nothing on stderr
    assert proc.returncode == 2 and proc.stderr == "" and "--context 8192 is beyond" in error["message"]
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B | {"max_position_embeddings": 2048}))
    args = argparse.Namespace(model=str(tmp_path), context=None, gpu_gb=40.0, params=None, weight_dtype="fp16",
                              reserve_gb=0.0, json=True)
    assert cmd_plan(args) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 2048  # the default, cut to the model's context


def test_cmd_plan_reads_a_config_file(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    args = argparse.Namespace(model=str(tmp_path), context=4096, gpu_gb=40.0, params=None, weight_dtype="fp16",
                              reserve_gb=0.0, json=True)
    assert cmd_plan(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 6_738_415_616
    assert {r["kv_dtype"]: r["chats"] for r in out["rows"]} == {"fp16": 12, "bf16": 12, "fp8": 23}
    args.json = False
    assert cmd_plan(args) == 0
    out = capsys.readouterr().out
    assert "fp16" in out
    assert 'as in the 40 GB example of the article "KV Cache Optimization: Efficient Context Storage"' in out


@pytest.mark.parametrize("flag, value", [("--gpu-gb", "inf"), ("--gpu-gb", "nan"), ("--reserve-gb", "nan"),
                                         ("--params", "inf")])
def test_inf_or_nan_sizes_are_one_error_line(tmp_path, flag, value):
    from process_helpers import assert_one_error_line, run_kvchat

    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    proc = run_kvchat(tmp_path / "home", "plan", "--model", str(tmp_path / "config.json"), "--context", "8192",
                      flag, value)
    assert_one_error_line(proc, f"{flag} must be", f"not {value}")  # the one flag, named


def test_a_config_file_is_named_in_errors_and_its_folder_names_the_model(tmp_path, monkeypatch):
    from process_helpers import assert_one_error_line, run_kvchat

    (tmp_path / "bad.json").write_text("{not json")
    assert_one_error_line(run_kvchat(tmp_path / "home", "plan", "--model", str(tmp_path / "bad.json")),
                          str(tmp_path / "bad.json"), "not a JSON model config")
    folder = tmp_path / "llama7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA2_7B))
    monkeypatch.chdir(folder)
    proc = run_kvchat(tmp_path / "home", "plan", "--model", "config.json")
    assert proc.returncode == 0 and proc.stdout.startswith("llama7b: "), proc.stdout + proc.stderr


def test_plan_defaults_to_this_machines_device_and_memory(tmp_path, capsys):
    import os

    import torch

    from kvchat.cli.main import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    assert main(["plan", "--model", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        assert props.name in out["device"] and out["gpu_bytes"] == props.total_memory
    else:  # no GPU: the plan is for this machine's RAM, not a 40 GB GPU it does not have
        assert out["device"] == "cpu"
        assert out["gpu_bytes"] == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert main(["plan", "--model", str(tmp_path)]) == 0
    assert f"4096-token chats; {out['device']} " in capsys.readouterr().out
    assert main(["plan", "--model", str(tmp_path), "--gpu-gb", "40", "--json"]) == 0  # a stated size is kept
    assert json.loads(capsys.readouterr().out)["gpu_bytes"] == 40 * 10**9


def test_each_bad_size_is_named_by_its_flag_or_config_field(tmp_path):
    from process_helpers import assert_one_error_line, run_kvchat

    from kvchat.model.config import UnsupportedModelError

    cfg = ModelConfig.from_hf(LLAMA2_7B)
    for kw, words in (({"context": -5}, "--context must be a positive number of tokens, not -5"),
                      ({"gpu_gb": 0.0}, "--gpu-gb must be a positive number, not 0"),
                      ({"reserve_gb": -1.5}, "--reserve-gb must be a number not below 0, not -1.5"),
                      ({"params": 0.5}, "--params must be a count of at least 1, not 0.5")):
        with pytest.raises(PlanInputError, match=words):
            plan_memory(cfg, **({"context": 4096, "gpu_gb": 40} | kw))
    for field, value in (("max_position_embeddings", "abc"), ("max_position_embeddings", 0),
                         ("num_attention_heads", 0), ("num_key_value_heads", 0), ("num_hidden_layers", True)):
        with pytest.raises(UnsupportedModelError, match=f"config's {field} must be a positive integer"):
            ModelConfig.from_hf(LLAMA2_7B | {field: value})
    with pytest.raises(UnsupportedModelError, match="the model config has no vocab_size"):
        ModelConfig.from_hf({k: v for k, v in LLAMA2_7B.items() if k != "vocab_size"})
    with pytest.raises(UnsupportedModelError, match="the model config is a JSON list, not an object"):
        ModelConfig.from_hf([LLAMA2_7B])
    assert ModelConfig.from_hf(LLAMA2_7B | {"max_position_embeddings": None}).max_position_embeddings == 2048
    with pytest.raises(PlanInputError, match="is beyond the model's context of 4096 tokens"):
        plan_memory(cfg, context=10**400, gpu_gb=40)  # an int too large for a float: compared, not converted
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B | {"max_position_embeddings": "abc"}))
    proc = run_kvchat(tmp_path / "home", "plan", "--model", str(tmp_path / "config.json"))
    assert_one_error_line(proc, "max_position_embeddings must be a positive integer, not 'abc'")
