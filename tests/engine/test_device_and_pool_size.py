"""The engine's device check and guard, its synced timer, and the default pool's size."""

from __future__ import annotations

import time

import pytest
import torch

from kvchat import settings
from kvchat.engine.device import DeviceError, check_device, device_guard
from kvchat.engine.kv_pool import KVCacheSpec
from kvchat.engine.pool_size import DEFAULT_CPU_POOL_BYTES, GPU_MEMORY_FRACTION, gpu_plan, plan_pool
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
    # CUDA: resident chats x context, unless the memory left after weights and activations caps it
    want = 4 * 8192 * spec.bytes_per_token
    roomy = gpu_plan(spec, 8192, 4, free_bytes=140 * 2**30, activation_bytes=2**30)
    assert roomy.bytes == want and "4 chats x 8,192 tokens" in roomy.text  # ~0.4 GB, not half of an H200
    tight = gpu_plan(spec, 8192, 4, free_bytes=300 * 2**20, activation_bytes=100 * 2**20)
    assert tight.bytes == int(200 * 2**20 * GPU_MEMORY_FRACTION) < want and "capped" in tight.text
    assert gpu_plan(spec, 8192, 4, free_bytes=0, activation_bytes=2**30).bytes == spec.bytes_per_block


def test_resident_chats_setting(monkeypatch):
    assert settings.resident_chats() == settings.DEFAULT_RESIDENT_CHATS
    monkeypatch.setenv(settings.RESIDENT_CHATS, "12")
    assert settings.resident_chats() == 12
    for bad in ("0", "-1", "2.5", "many"):
        monkeypatch.setenv(settings.RESIDENT_CHATS, bad)
        with pytest.raises(settings.SettingError, match=rf"^KVCHAT_RESIDENT_CHATS must be a whole number of chats >= 1, got '{bad}'$"):
            settings.check()
