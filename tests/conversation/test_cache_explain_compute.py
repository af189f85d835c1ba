"""``--dtype`` is part of the cache identity everywhere: a chat stored by a run that computed in another dtype
than its weight format's own is found by ``cache explain`` (and the variants a store may hold) only under that
compute dtype, and a run computing otherwise names the dtype as the reason it does not restore."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from kvchat.conversation.cache_admin import explain_chain
from kvchat.conversation.service import ChatService
from kvchat.engine.cache_identity import BLOCK_SIZE, expected_identity, fingerprint_variants
from kvchat.engine.cache_miss import why_not_restored
from kvchat.engine.turn import SamplingParams
from kvchat.index import get_db
from kvchat.runtime import load_runtime

pytestmark = pytest.mark.model


def test_a_chat_computed_in_bf16_over_fp32_weights_is_explained_under_its_dtype(monkeypatch, smol_info, kvchat_home):
    monkeypatch.setenv("KVCHAT_WEIGHTS", "fp32")
    monkeypatch.setenv("KVCHAT_DTYPE", "bf16")
    rt = load_runtime(None, "fp8")
    assert rt.engine.weight_format == "fp32" and rt.engine.compute_key == "bf16"
    service = ChatService(rt)
    service.start_chat(None, [], lambda ev: None)
    done = service.send("Name a fruit.", SamplingParams(max_tokens=3, temperature=0), threading.Event(), lambda ev: None)
    service.close()
    fp, model_fp = rt.engine.cache_fingerprint, rt.info.fingerprint

    report = explain_chain(done.chat_id, "fp8")  # KVCHAT_DTYPE=bf16, KVCHAT_WEIGHTS=fp32: as the run that stored it
    assert report.fingerprint == fp and report.restorable_tokens > 0
    assert fp in fingerprint_variants(model_fp, "fp8", BLOCK_SIZE)

    monkeypatch.setenv("KVCHAT_DTYPE", "auto")  # the same weights computed in their own fp32: another identity
    plain = expected_identity(model_fp, "fp8", num_params=0)
    assert (plain.weight_format, plain.compute) == ("fp32", None)
    assert plain.fingerprint != fp and explain_chain(done.chat_id, "fp8").restorable_tokens == 0
    reason = why_not_restored(get_db(), done.chat_id, plain)
    assert reason == "its KV was computed in bf16; this run computes in fp32 (--dtype bf16 restores it)"
    monkeypatch.setenv("KVCHAT_WEIGHTS", "int8")  # both differ: the hint names both flags (was: --weights fp32 only)
    int8 = expected_identity(model_fp, "fp8", num_params=0)
    assert (int8.weight_format, int8.compute) == ("int8", None)
    reason = why_not_restored(get_db(), done.chat_id, int8)
    assert reason == ("its KV was saved with fp32 weights computed in bf16; this run uses int8 weights computed "
                      "in fp32 (--weights fp32 --dtype bf16 restores it)")

    env = {**os.environ, "KVCHAT_HOME": str(kvchat_home), "KVCHAT_DTYPE": "auto", "KVCHAT_WEIGHTS": "auto"}
    cli = subprocess.run([sys.executable, "-m", "kvchat.cli", "cache", "explain", done.chat_id, "--weights", "fp32",
                          "--dtype", "bf16"], capture_output=True, text=True, env=env, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert f"cache fingerprint {fp[:12]}" in cli.stdout
    assert int(cli.stdout.split("restorable from disk: ")[1].split()[0]) == report.restorable_tokens
    as_json = subprocess.run([sys.executable, "-m", "kvchat.cli", "cache", "explain", done.chat_id, "--json",
                              "--weights", "fp32", "--dtype", "bf16"], capture_output=True, text=True, env=env, timeout=300)
    got = json.loads(as_json.stdout)
    assert got["fingerprint"] == fp and got["restorable_tokens"] == report.restorable_tokens
    assert [(link["start"], link["end"]) for link in got["links"]] == [(k.start, k.end) for k in report.links]
    unknown = subprocess.run([sys.executable, "-m", "kvchat.cli", "cache", "explain", "c_none", "--json"],
                             capture_output=True, text=True, env=env, timeout=300)
    error = json.loads(unknown.stdout)["error"]
    assert unknown.returncode == 2 and unknown.stderr == "" and "c_none" in error["message"], unknown
