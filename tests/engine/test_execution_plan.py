"""The execution plan's rules (kvchat.engine.execution_plan.plan_execution), one device and backend at a time,
and the engine acting on the plan it logs."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from kvchat.engine.execution_plan import plan_execution
from kvchat.engine.kv_pool import KVCacheSpec, KVPool
from kvchat.engine.runner import Engine
from kvchat.kernels import cpu_attention
from kvchat.kernels.dispatch import KernelChoice
from kvchat.model.config import ModelConfig

COMMON = dict(weight_format="int8", compute_dtype=torch.float32, int8_kernel="avx2", exact_sink=True,
              int8_prefill=False)


def _pool_layer(head_dim: int = 64):
    return KVPool.from_budget(KVCacheSpec(2, 2, head_dim, "fp8"), 1 << 20, torch.device("cpu")).layer(0)


def _plan(device: str, backend: str, *, layer=None, dense_kv=None, fit=True, graphs=True):
    return plan_execution(torch.device(device), KernelChoice(backend), layer or _pool_layer(), dense_kv=dense_kv,
                          compiled_layers_fit=fit, cuda_graphs=graphs, **COMMON)


@pytest.mark.skipif(not cpu_attention.takes_pool(_pool_layer()), reason="the compiled CPU attention is not built here")
def test_a_cpu_with_the_compiled_kernels_decodes_on_the_pool_through_the_compiled_layers():
    plan = _plan("cpu", "compiled")
    assert (plan.dense_kv, plan.decode_on_pool, plan.compiled_layers, plan.pad_decode, plan.cuda_graphs) == (
        True, True, True, False, False)
    assert not _plan("cpu", "compiled", fit=False).compiled_layers  # a model the compiled layers do not take
    assert plan.line() == ("cpu, int8 weights (avx2), float32, attention compiled, decode on the pool, "
                           "dense prefill copy, compiled layers, exact sink")


def test_a_pool_the_compiled_attention_cannot_read_decodes_on_the_dense_copy_without_compiled_layers():
    layer = _pool_layer(head_dim=24)  # not a multiple of 16: the compiled attention refuses it
    assert not cpu_attention.takes_pool(layer)
    plan = _plan("cpu", "compiled", layer=layer)
    assert (plan.dense_kv, plan.decode_on_pool, plan.compiled_layers) == (True, False, False)


def test_the_torch_kernels_on_a_cpu_read_the_dense_copy_unless_the_caller_says_otherwise():
    plan = _plan("cpu", "torch")
    assert (plan.dense_kv, plan.decode_on_pool, plan.compiled_layers) == (True, False, False)
    plan = _plan("cpu", "torch", dense_kv=False)
    assert (plan.dense_kv, plan.decode_on_pool, plan.compiled_layers) == (False, True, False)


@pytest.mark.parametrize("graphs", [True, False])
def test_a_gpu_with_triton_pads_its_batches_and_replays_graphs_as_the_setting_says(graphs):
    plan = _plan("cuda:0", "triton", graphs=graphs)
    assert (plan.dense_kv, plan.decode_on_pool, plan.compiled_layers, plan.pad_decode, plan.cuda_graphs) == (
        False, True, False, True, graphs)
    plan = _plan("cuda:0", "torch")  # the reference kernels read lengths back on the host: no graphs, no padding
    assert (plan.dense_kv, plan.pad_decode, plan.cuda_graphs) == (False, False, False)


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_the_engine_builds_what_its_plan_names_and_logs_it_in_one_line(weights, caplog):
    hf_cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    state = dict(transformers.AutoModelForCausalLM.from_config(hf_cfg).state_dict())
    with caplog.at_level(logging.INFO, logger="kvchat.engine.runner"):
        engine = Engine(ModelConfig.from_hf(hf_cfg.to_dict()), state, "plan-test", pool_bytes=2**20, device="cpu",
                        weight_format=weights)
    lines = [r.getMessage() for r in caplog.records if "engine plan" in r.getMessage()]
    assert lines == [f"kvchat: engine plan: {engine.plan.line()}"]
    assert (engine.dense is not None) == engine.plan.dense_kv
    assert (engine.compiled_decode is not None) == engine.plan.compiled_layers
    assert (engine.decode_graphs is not None) == engine.plan.cuda_graphs
    assert engine.identity.compiled_layers == engine.plan.compiled_layers  # the fingerprint names what runs
    if weights == "int8" and engine.plan.attention == "compiled":
        assert engine.plan.compiled_layers  # the CPU's default weights run the compiled decoder layers
