"""``--weights auto`` on a CPU by the model's size: int4 from ``INT4_AUTO_PARAMS`` stored parameters, int8 below;
the engine, the identity ``cache explain`` expects and the report agree on it."""

from __future__ import annotations

import threading

import pytest

from kvchat.conversation.cache_admin import explain_chain
from kvchat.conversation.service import ChatService
from kvchat.engine import cache_identity
from kvchat.engine.cache_identity import INT4_AUTO_PARAMS, expected_identity, resolve_weight_format
from kvchat.engine.turn import SamplingParams
from kvchat.kernels import cpu_int4
from kvchat.model.weights import CheckpointReader
from kvchat.runtime import load_runtime


def test_auto_on_a_cpu_is_int4_from_the_size_and_int8_below():
    assert resolve_weight_format("auto", "cpu", num_params=INT4_AUTO_PARAMS - 1) == "int8"
    assert resolve_weight_format("auto", "cpu", num_params=INT4_AUTO_PARAMS) == "int4"
    assert resolve_weight_format("auto", "cpu") == "int8"  # size unknown: as a small model
    assert resolve_weight_format("auto", "cuda", num_params=8 * 10**9) == "bf16"
    # a 16-bit computation asked for keeps its unquantized format whatever the size; an explicit format is kept
    assert resolve_weight_format("auto", "cpu", "bf16", num_params=8 * 10**9) == "bf16"
    assert resolve_weight_format("auto", "cpu", "fp16", num_params=8 * 10**9) == "fp32"
    assert resolve_weight_format("int8", "cpu", num_params=8 * 10**9) == "int8"


@pytest.mark.model
@pytest.mark.skipif(not cpu_int4.available(), reason="int4 needs the compiled CPU kernels")
def test_a_model_at_the_size_runs_int4_and_explain_expects_it(monkeypatch, smol_info, kvchat_home):
    """SmolLM2 (135M) stands for a large model with the threshold moved to its size: the rule, not the constant,
    is what runs through load_runtime and cache explain."""
    params = CheckpointReader(smol_info.path).num_params()
    monkeypatch.setenv("KVCHAT_WEIGHTS", "auto")
    monkeypatch.setattr(cache_identity, "INT4_AUTO_PARAMS", params)
    rt = load_runtime(None, "fp8")
    assert rt.engine.weight_format == "int4"
    service = ChatService(rt)
    service.start_chat(None, [], lambda ev: None)
    done = service.send("Name a fruit.", SamplingParams(max_tokens=3, temperature=0), threading.Event(), lambda ev: None)
    service.close()
    assert expected_identity(rt.info.fingerprint, "fp8", num_params=params).fingerprint == rt.engine.cache_fingerprint
    report = explain_chain(done.chat_id, "fp8")  # finds the model by the chat's name, reads its size
    assert report.fingerprint == rt.engine.cache_fingerprint and report.restorable_tokens > 0

    monkeypatch.setattr(cache_identity, "INT4_AUTO_PARAMS", params + 1)  # one parameter short: int8 again
    assert expected_identity(rt.info.fingerprint, "fp8", num_params=params).weight_format == "int8"
    assert explain_chain(done.chat_id, "fp8").restorable_tokens == 0
