"""int8 activations in prefill change the K/V a chat stores, so they are part of the cache identity: a chat
stored with one choice is not restored under the other (the miss names why and how to restore it), and is
restored again under its own (up to the turns stored under the other)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvchat.engine.cache_identity import CacheIdentity, fingerprint_variants
from kvchat.kernels import cpu_int8_int8

DOC = ("The lighthouse keeper of Varn Island logged the weather every hour for thirty-one years; his notebooks "
       "record storms by the colour of the sea. ") * 4


def test_int8_prefill_has_its_own_fingerprint():
    a = CacheIdentity("m" * 32, "fp8", weight_format="int8", int8_kernel="avx2", compiled_layers=True)
    b = CacheIdentity("m" * 32, "fp8", weight_format="int8", int8_kernel="avx2", compiled_layers=True, int8_prefill=True)
    assert a.fingerprint != b.fingerprint
    both = fingerprint_variants("m" * 32, "fp8", a.block_size, ("int8",), (None,), ("avx2",))
    assert {a.fingerprint, b.fingerprint} <= both
    assert b.fingerprint not in fingerprint_variants("m" * 32, "fp8", a.block_size, ("int8",), (None,), ("avx2",), (False,))


def _ask(home, models, prefill: str, *args: str) -> dict:
    env = {**os.environ, "KVCHAT_HOME": str(home), "KVCHAT_MODELS": str(models), "KVCHAT_INT8_PREFILL": prefill,
           "KVCHAT_WEIGHTS": "int8"}
    r = subprocess.run([sys.executable, "-m", "kvchat.cli", "ask", *args, "--json", "--max-tokens", "4"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.skipif(not cpu_int8_int8.available(), reason="the compiled CPU kernels do not build here")
def test_a_chat_stored_with_float_prefill_is_not_restored_with_int8_prefill(tmp_path, smol_info, kvchat_home):
    doc = tmp_path / "varn.txt"
    doc.write_text(DOC)
    models = smol_info.path.parent
    first = _ask(kvchat_home, models, "float", "Who kept the logbooks?", "--doc", str(doc))
    assert first["prefilled_tokens"] > 32  # past the compiled fp32 kernel's rows: the chunk the choice decides
    other = _ask(kvchat_home, models, "int8", "What did he record?", "--chat", first["chat_id"])
    assert other["from_disk"] == 0
    assert other["miss_reason"] == ("its KV was computed with float activations in prefill; this run uses int8 "
                                    "(KVCHAT_INT8_PREFILL=float restores it)")
    same = _ask(kvchat_home, models, "float", "For how long?", "--chat", first["chat_id"])
    # the first turn's K/V come back; the second turn's were stored under the int8 prefill's fingerprint
    assert first["prompt_tokens"] - 16 <= same["from_disk"] < other["context_tokens"]
    assert same["miss_reason"] == ("its snapshot chain stops early: other turns' KV was computed with int8 "
                                   "activations in prefill; this run uses float (KVCHAT_INT8_PREFILL=int8 restores it)")


@pytest.mark.skipif(not cpu_int8_int8.available(), reason="the compiled CPU kernels do not build here")
def test_the_plan_decides_once_and_the_layers_follow(smol_info):
    from kvchat.engine.runner import Engine
    from kvchat.model.quant import Int8GroupLinear
    from kvchat.model.registry import load_weights

    weights = load_weights(smol_info)
    engines = {c: Engine(smol_info.config, weights, smol_info.fingerprint, kv_dtype="bf16", pool_bytes=4 << 20,
                         device="cpu", weight_format="int8", int8_prefill=c) for c in ("float", "int8", "auto")}
    assert [e.plan.int8_prefill for e in engines.values()] == [False, True, False]  # auto: float (the default)
    assert "int8 prefill activations" in engines["int8"].plan.line()
    assert engines["int8"].cache_fingerprint != engines["float"].cache_fingerprint == engines["auto"].cache_fingerprint
    for choice, e in engines.items():
        flags = {m.integer_prefill for m in e.model.modules() if isinstance(m, Int8GroupLinear)}
        assert flags == {choice == "int8"}  # SmolLM2's every layer has out_features a multiple of 16
