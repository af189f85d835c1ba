"""``--weights auto`` on a CPU by the model's size: int4 from ``INT4_AUTO_PARAMS`` stored parameters, int8 below;
the engine, the identity ``cache explain`` expects and the report agree on it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from kvchat.bench.random_checkpoint import write_checkpoint
from kvchat.conversation.cache_admin import explain_chain
from kvchat.conversation.service import ChatService
from kvchat.engine import cache_identity
from kvchat.engine.cache_identity import INT4_AUTO_PARAMS, expected_identity, int4_runs, resolve_weight_format
from kvchat.engine.turn import SamplingParams
from kvchat.kernels import cpu_int4
from kvchat.model.registry import model_dir_by_fingerprint, resolve_model
from kvchat.model.weights import CheckpointReader
from kvchat.runtime import load_runtime


def test_auto_is_int8_where_the_int4_kernels_do_not_run():
    """KVCHAT_CPU_KERNEL=0 (or no compiler): a large model's auto is int8, which runs there, not int4, which cannot."""
    code = ("from kvchat.engine.cache_identity import resolve_weight_format as r; "
            "print(r('auto', 'cpu', num_params=10**10), r('int4', 'cpu', num_params=0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "KVCHAT_CPU_KERNEL": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["int8", "int4"]  # an explicit int4 is refused where the engine loads, as before


def test_a_checkpoint_used_in_place_is_found_by_its_fingerprint(tmp_path, kvchat_home):
    """cache explain sizes the model of a chat by its fingerprint: a checkpoint directory used in place (whose
    chats record only its folder's name) is found through the fingerprint cache, an unknown one is not."""
    model_dir = tmp_path / "some" / "tiny"
    write_checkpoint(model_dir, "tiny")
    info = resolve_model(str(model_dir))
    assert model_dir_by_fingerprint(info.fingerprint) == model_dir.resolve()
    assert model_dir_by_fingerprint("0" * 32) is None


def test_auto_on_a_cpu_is_int4_from_the_size_and_int8_below():
    assert resolve_weight_format("auto", "cpu", num_params=INT4_AUTO_PARAMS - 1) == "int8"
    assert resolve_weight_format("auto", "cpu", num_params=INT4_AUTO_PARAMS) == ("int4" if int4_runs() else "int8")
    assert resolve_weight_format("auto", "cpu", num_params=0) == "int8"  # validating a name before the model is at hand
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
    report = explain_chain(done.chat_id, "fp8")  # finds the model by the chat's fingerprint, reads its size
    assert report.fingerprint == rt.engine.cache_fingerprint and report.restorable_tokens > 0

    monkeypatch.setattr(cache_identity, "INT4_AUTO_PARAMS", params + 1)  # one parameter short: int8 again
    assert expected_identity(rt.info.fingerprint, "fp8", num_params=params).weight_format == "int8"
    other = explain_chain(done.chat_id, "fp8")
    assert other.restorable_tokens == 0 and other.stops_at == 0
    assert other.reason == "its KV was saved with int4 weights; this run uses int8 (--weights int4 restores it)"
    assert report.reason is None  # the int4 report: its chain is whole
