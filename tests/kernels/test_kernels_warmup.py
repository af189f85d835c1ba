"""The kernel warm-up: which variants it compiles at engine start, and that it is a no-op on CPU.

That a warmed-up chat compiles nothing new is checked against Triton's own
compiler by tests/kernels/test_kernels_compile.py (no GPU needed).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported (see test_kernels_triton.py)

from kvchat.kernels import (  # noqa: E402
    dispatch,
    triton_decode,  # noqa: E402
    triton_write,
)
from kvchat.kernels.layout import KVLayer  # noqa: E402
from kvchat.kernels.warmup import DecodeLaunch, ExtendLaunch, compile_plan, launch_warmup, plan_warmup, warm_up  # noqa: E402

FP8 = torch.float8_e4m3fn


def _variants(plan, kind):
    return [launch.variant for launch in plan if isinstance(launch, kind)]


@pytest.mark.parametrize("num_kv_heads, max_context, num_sms, batches", [
    (3, 8192, 132, (1, 2, 4, 8)),  # SmolLM2 on an H100/H200, the server's batch buckets
    (8, 131072, 108, (1,)),  # a Llama-3.1-8B layer on an A100, its full context
    (8, 4096, 1, (1, 16)),  # the interpreter counts as one SM
])
def test_plan_covers_every_launch_of_a_growing_chat_once(num_kv_heads, max_context, num_sms, batches):
    plan = plan_warmup(num_kv_heads, 16, max_context, num_sms, batches)
    decode = _variants(plan, DecodeLaunch)
    assert len(decode) == len(set(decode)) and len(_variants(plan, ExtendLaunch)) == 3  # widths 1, 16k, others
    for width in range(1, max_context // 16 + 1):
        for b in batches:
            splits = triton_decode.splits_for(b, num_kv_heads, width * 16, num_sms)
            assert DecodeLaunch(b, width, splits).variant in decode, (b, width, splits)
    assert all(launch.width <= max_context // 16 for launch in plan)


def test_plan_for_smollm2_on_132_sms_by_hand():
    """Batch 1: num_splits = ceil(width / 16) up to 32 at 8192 tokens (a wave of 132 programs / 3 KV heads caps at 44).

    One split: widths 1, 2..15 and 16 (three classes); 2..32 splits: merge sizes 2, 4, 8, 16, 32, the counts
    16 and 32 being multiples of 16 (two classes under 16 and 32), each with widths that are and are not
    multiples of 16: 3 + 7 x 2 = 17 decode variants.
    """
    plan = plan_warmup(3, 16, 8192, 132, (1,))
    assert len(_variants(plan, DecodeLaunch)) == 17
    assert {merge for _, merge, _ in _variants(plan, DecodeLaunch)} == {0, 2, 4, 8, 16, 32}
    assert max(launch.num_splits for launch in plan if isinstance(launch, DecodeLaunch)) == 32


@pytest.mark.parametrize("length, num_sms, num_seqs, num_kv_heads, splits", [
    (4096, 132, 1, 8, 16),  # Llama-3-8B at 4K on an H200: two waves are 33 per KV head, the length allows 16
    (4096, 132, 1, 3, 16),  # SmolLM2 at 4K: 88 would fit the waves, the length allows 16
    (32768, 132, 1, 8, 33),  # 32K: the waves cap it, 33 x 8 = 264 programs, 8 tiles of 128 each
    (32768, 132, 8, 8, 5),  # batch 8: 64 programs per split, 5 splits
    (200, 132, 1, 8, 1),  # under 256 tokens: one split, no merge
    (1 << 20, 1000, 1, 1, triton_decode.MAX_SPLITS),
    (0, 132, 1, 8, 1),
])
def test_split_count_is_the_waves_over_the_sms_from_the_length(length, num_sms, num_seqs, num_kv_heads, splits):
    assert triton_decode.SPLIT_WAVES == 2
    assert triton_decode.splits_for(num_seqs, num_kv_heads, length, num_sms) == splits
    assert triton_decode.splits_for(num_seqs, num_kv_heads, length, 2 * num_sms, waves=1) == splits


def test_split_count_grows_with_the_length_up_to_the_grids():
    """What the kernel computes per sequence, min(grid count, ceil(length / MIN_TOKENS_PER_SPLIT)), is the
    count of its own length for every length up to the grid's capacity."""
    for capacity in (256, 1024, 4096, 8192):
        grid = triton_decode.splits_for(1, 8, capacity, 132)
        for length in range(1, capacity + 1, 7):
            kernel = max(1, min(grid, -(-length // triton_decode.MIN_TOKENS_PER_SPLIT)))
            assert kernel == triton_decode.splits_for(1, 8, length, 132), (capacity, length)


def test_warm_up_is_a_no_op_on_cpu(monkeypatch):
    layer = KVLayer(torch.zeros(4, 16, 2, 64, dtype=FP8), torch.zeros(4, 16, 2, 64, dtype=FP8),
                    torch.zeros(4, 16, 2), torch.zeros(4, 16, 2))
    for backend in ("torch", "triton"):
        monkeypatch.setenv("KVCHAT_ATTENTION", backend)
        assert warm_up(layer, 6, torch.float32, 8192, True) == []


@pytest.mark.parametrize("pool_dtype, sink", [(FP8, True), (torch.float16, False)])
def test_every_planned_launch_runs_and_leaves_the_pool_alone(pool_dtype, sink):
    """Under the interpreter (or on a GPU): zero-length launches of every planned variant, nothing written."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = (4, 16, 2, 64)
    k_cache = torch.randn(shape).to(pool_dtype).to(device)
    v_cache = torch.randn(shape).to(pool_dtype).to(device)
    scales = [torch.rand(shape[:3], device=device) for _ in range(2)] if pool_dtype == FP8 else [None, None]
    before = [t.clone() for t in (k_cache, v_cache, *scales) if t is not None]
    plan = plan_warmup(2, 16, 1024, 8, (1, 2))  # up to 4 splits (a wave of 8 SMs); 3 and 4 share one variant
    assert {launch.num_splits for launch in plan if isinstance(launch, DecodeLaunch)} == {1, 2, 3}
    launch_warmup(plan, KVLayer(k_cache, v_cache, *scales), 6, torch.float16, sink)
    after = [t for t in (k_cache, v_cache, *scales) if t is not None]
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b)
               for a, b in zip(after, before))


def _cpu_layer():
    shape = (4, 16, 2, 64)
    return KVLayer(torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8), torch.ones(shape[:3]), torch.ones(shape[:3]))


def test_compiling_reports_each_variant(monkeypatch):
    plan = plan_warmup(2, 16, 1024, 8, (1,))
    seen = []
    assert compile_plan(plan, _cpu_layer(), 6, torch.float16, True, lambda done, total: seen.append((done, total)))
    assert seen == [(i, len(plan)) for i in range(1, len(plan) + 1)] and len(plan) > 3


def test_a_launcher_that_cannot_be_built_is_one_line_then_the_reference(monkeypatch, caplog):
    """Triton's first launch builds its C launcher; here that build fails as it does without a compiler."""
    monkeypatch.setattr(dispatch, "_build_failed", [])
    monkeypatch.setattr(dispatch, "_noticed", set())
    monkeypatch.setattr(dispatch, "_triton_importable", lambda: True)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable or set "
                           "triton.knobs.build.impl.")

    monkeypatch.setattr(triton_write, "write_kv", no_compiler)
    assert compile_plan(plan_warmup(2, 16, 1024, 8, (1,)), _cpu_layer(), 6, torch.float16, True) is False
    with caplog.at_level("WARNING", logger=dispatch.__name__):
        assert dispatch._cuda_backend() == "torch"
    assert [r.getMessage() for r in caplog.records] == [
        "kvchat: Triton cannot build its kernel launcher: RuntimeError: Failed to find C compiler. Please specify via "
        "CC environment variable or set triton.knobs.build.impl. (install gcc and the Python headers (python3-dev) or "
        "set CC); attention runs on the PyTorch reference path"]
    monkeypatch.setattr(triton_write, "write_kv", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("CUDA error")))
    with pytest.raises(RuntimeError, match="CUDA error"):  # any other error is not swallowed
        compile_plan(plan_warmup(2, 16, 1024, 8, (1,)), _cpu_layer(), 6, torch.float16, True)
