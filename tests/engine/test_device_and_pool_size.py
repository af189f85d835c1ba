"""The engine's device check and guard, its synced timer, and the default pool's size."""

from __future__ import annotations

import time

import pytest
import torch

from kvchat import settings
from kvchat.device import DeviceError, check_device, device_guard
from kvchat.engine.kv_pool import KVCacheSpec
from kvchat.engine.pool_size import (
    DEFAULT_CPU_POOL_BYTES,
    MIN_POOL_TOKENS,
    GPUMemoryError,
    gpu_plan,
    gpu_pool_cap,
    load_oom_line,
    plan_pool,
)
from kvchat.engine.timing import DeviceTimer


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a torch built without CUDA")
def test_a_cuda_device_on_a_cpu_torch_is_one_line_before_any_work():
    from kvchat.engine.runner import Engine

    with pytest.raises(DeviceError, match=r"^device 'cuda:1': this torch \(.*\) is built without CUDA$"):
        check_device("cuda:1")
    with pytest.raises(DeviceError, match="built without CUDA"):  # before it looks at the (absent) weights
        Engine(None, {}, "x", device="cuda:1")


def test_cuda_n_beyond_the_devices_is_named(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # the checks only; nothing runs on the "GPU"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DeviceError, match=r"^device 'cuda:1': torch sees 1 CUDA device\(s\), cuda:0 to cuda:0$"):
        check_device("cuda:1")
    assert check_device("cuda:0") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(DeviceError, match="sees no CUDA device"):
        check_device("cuda")
    with pytest.raises(DeviceError, match="not supported"):
        check_device("meta")


def test_cpu_guard_and_timer():
    assert check_device("cpu") == torch.device("cpu")
    with device_guard(torch.device("cpu")), DeviceTimer("cpu") as t:
        time.sleep(0.02)
    assert 20 <= t.ms < 2000


def test_default_pool_size(monkeypatch):
    spec = KVCacheSpec(30, 3, 64, "fp8")
    cpu = plan_pool(spec, 8192, torch.device("cpu"))
    assert cpu.bytes == DEFAULT_CPU_POOL_BYTES and "CPU default" in cpu.text
    monkeypatch.setenv(settings.KV_BUDGET_MB, "10")
    assert plan_pool(spec, 8192, torch.device("cpu")).bytes == 10 * 2**20
    # CUDA: resident chats x context, unless the memory the pool may take caps it
    want = 4 * 8192 * spec.bytes_per_token
    roomy = gpu_plan(spec, 8192, 4, 140 * GIB, GIB, total_bytes=141 * GIB, held_bytes=GIB // 2, fraction=None)
    assert roomy.bytes == want and "4 chats x 8,192 tokens" in roomy.text  # ~0.4 GB, not half of an H200
    tight = gpu_plan(spec, 8192, 4, 300 * 2**20, 100 * 2**20, total_bytes=8 * GIB, held_bytes=GIB, fraction=None)
    assert tight.bytes == 100 * 2**20 < want and "capped at 50% of the 0.2 GiB free" in tight.text


GIB = 2**30
LLAMA_8B = KVCacheSpec(32, 8, 128, "fp8")  # ~66 KiB per token


def test_the_default_leaves_half_of_a_shared_gpu_free():
    """A 24 GiB card with a desktop (1.5 GiB) and an 8B model's bf16 weights (15 GiB) held by this process:
    7.5 GiB free, 1 GiB of it the activation peak. The default takes half of the 6.5 GiB left (taking
    90 % would leave 1.65 GiB free, less than a 1B model's 2 GiB of weights); a second kvchat process with a 1B
    model then loads beside it and gets a pool of its own."""
    free, act, total, held = int(7.5 * GIB), GIB, 24 * GIB, 15 * GIB
    assert gpu_pool_cap(free, act, total, held, None) == int(3.25 * GIB)
    plan = gpu_plan(LLAMA_8B, 131072, 4, free, act, total, held, None)
    assert plan.bytes == int(3.25 * GIB) and plan.bytes // LLAMA_8B.bytes_per_token >= 50_000
    assert "50% of the 6.5 GiB free after weights and activations" in plan.text
    left = free - plan.bytes
    assert left == int(4.25 * GIB) and free - 0.9 * (free - act) < 2 * GIB
    one_b = KVCacheSpec(16, 8, 64, "fp8")
    second = gpu_plan(one_b, 131072, 4, left - 2 * GIB, GIB // 4, total, 2 * GIB, None)
    assert second.bytes // one_b.bytes_per_token > 30_000


@pytest.mark.parametrize("fraction, cap_gib", [
    (0.9, 0.9 * 24 - 15 - 1),  # 5.6 GiB: this process's share of the total, less its weights and activations
    (1.0, 6.5),  # the whole share would be 8 GiB, but only 6.5 GiB are free after the activations
    (0.5, 0.0),  # 12 GiB of 24 is less than the weights: nothing left for the pool
])
def test_gpu_memory_fraction_is_this_processes_share_of_the_total(fraction, cap_gib):
    cap = gpu_pool_cap(int(7.5 * GIB), GIB, 24 * GIB, 15 * GIB, fraction)
    assert cap == pytest.approx(cap_gib * GIB, abs=1)


def test_a_pool_too_small_for_a_chat_is_one_line_with_the_numbers_and_the_flag():
    with pytest.raises(GPUMemoryError) as exc:
        gpu_plan(LLAMA_8B, 131072, 4, int(7.5 * GIB), GIB, 24 * GIB, 15 * GIB, 0.5)
    assert str(exc.value) == (
        "the KV pool would get 0.00 GiB (--gpu-memory 0.5 x 24.0 GiB less 15.0 GiB held and 1.0 GiB of activations, "
        "at most the 6.5 GiB free), under the 0.13 GiB of 2,048 tokens; raise --gpu-memory, or free GPU memory")
    with pytest.raises(GPUMemoryError, match=r"^the KV pool would get 0\.00 GiB \(50% of the 0\.0 GiB free .*; pass "
                       r"--gpu-memory FRACTION \(this process's share of the GPU's 24\.0 GiB\), or free GPU memory$"):
        gpu_plan(LLAMA_8B, 131072, 4, 0, GIB, 24 * GIB, 22 * GIB, None)  # 90 % of what is free would give a one-block pool
    small = KVCacheSpec(30, 3, 64, "fp8")  # a model whose context is under MIN_POOL_TOKENS needs only that much
    assert gpu_plan(small, 1024, 1, 3 * 1024 * small.bytes_per_token, 0, GIB, 0, None).bytes == 1024 * small.bytes_per_token
    assert MIN_POOL_TOKENS > 1024
    assert isinstance(exc.value, ValueError), "the CLI prints a ValueError as one line, exit 2"


def test_out_of_memory_at_load_is_one_line_with_the_numbers_and_the_flag():
    assert load_oom_line("Llama-3-8B", 16 * GIB, 10 * GIB, 24 * GIB, None) == (
        "out of GPU memory loading Llama-3-8B: its weights take 16.0 GiB; 10.0 GiB of the GPU's 24.0 GiB were free "
        "before loading (other processes hold the rest); free GPU memory or use a smaller model")
    assert load_oom_line("Llama-3-8B", 15 * GIB, 22 * GIB, 24 * GIB, 0.98) == (
        "out of GPU memory loading Llama-3-8B: its weights take 15.0 GiB; 22.0 GiB of the GPU's 24.0 GiB were free "
        "before loading; the KV pool, activations and kernels took the rest: lower --gpu-memory (now 0.98) or free "
        "GPU memory")


def test_resident_chats_setting(monkeypatch):
    assert settings.resident_chats() == settings.DEFAULT_RESIDENT_CHATS
    monkeypatch.setenv(settings.RESIDENT_CHATS, "12")
    assert settings.resident_chats() == 12
    for bad in ("0", "-1", "2.5", "many"):
        monkeypatch.setenv(settings.RESIDENT_CHATS, bad)
        with pytest.raises(settings.SettingError, match=rf"^KVCHAT_RESIDENT_CHATS must be a whole number of chats >= 1, got '{bad}'$"):
            settings.check()
