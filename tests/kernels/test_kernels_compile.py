"""The Triton kernels compile for real NVIDIA GPUs (sm_90, sm_80), checked on a machine without one.

The interpreter runs kernels as plain Python, so it misses what only the
compiler rejects (unsupported constructs, tl.dot shape limits, fp8 on old
architectures) and says nothing about register spills. Here a subprocess,
free of ``TRITON_INTERPRET``, swaps Triton's active driver for one that
only reports a CUDA target and turns every launch into a compile-only
warmup, then calls the real host wrappers on CPU tensors: the kernels get
the same argument specialization (divisibility by 16, ints equal to 1) as a
real launch and are compiled down to a cubin by the ptxas that ships with
Triton. Each compiled kernel's spill stack is read with the bundled cuobjdump.

Run directly: ``python tests/kernels/test_kernels_compile.py 90`` (add ``warmup`` for the
warm-up check: after :mod:`kvchat.kernels.warmup`'s launches a chat compiles nothing new).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import pytest

SETUP_FAILED = 3  # exit status: Triton's internals differ from what the fake driver needs


def test_kernels_compile_for_sm90_and_sm80_without_spills():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVCHAT_ATTENTION")}
    for cc in ("90", "80"):
        proc = subprocess.run([sys.executable, __file__, cc], env=env, capture_output=True, text=True, timeout=600,
                              check=False)
        if proc.returncode == SETUP_FAILED:
            pytest.skip(f"compile-only launch not possible with this Triton: {proc.stderr.strip()[-300:]}")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "spills" not in proc.stdout, proc.stdout


def _compile_only(cc: int) -> list:
    """Make every Triton launch in this process compile for ``sm_<cc>`` without running; the list it fills
    with ``(kernel name, compiled kernel)`` per launch (a cache hit returns the same compiled object)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class CompileOnlyDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", cc, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    compiled = []
    real_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    try:
        driver.set_active(CompileOnlyDriver())
        JITFunction.run = compile_only
        for name in ("triton_decode", "triton_extend", "triton_write", "triton_fused"):  # decorated under the fake driver
            importlib.import_module(f"kvchat.kernels.{name}")
    except Exception as exc:  # noqa: BLE001 - any mismatch of internals means "cannot check here"
        print(repr(exc), file=sys.stderr)
        sys.exit(SETUP_FAILED)
    return compiled


def test_a_chat_after_the_warm_up_compiles_nothing_new():
    """kvchat.kernels.warmup's plan for SmolLM2 on a 132-SM sm_90 GPU, then every launch of a chat growing to
    2,048 tokens (decode at each width with the engine's split count, prefill chunks, cache writes)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVCHAT_ATTENTION")}
    proc = subprocess.run([sys.executable, __file__, "90", "warmup"], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    if proc.returncode == SETUP_FAILED:
        pytest.skip(f"compile-only launch not possible with this Triton: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "new variants during the chat: 0" in proc.stdout, proc.stdout


def _warm_up_then_chat(cc: int, num_sms: int = 132, max_context: int = 2048) -> None:
    """Print how many variants the warm-up compiled and how many a chat then added (should be 0)."""
    import torch

    compiled = _compile_only(cc)
    from kvchat.kernels import triton_decode, triton_extend, triton_write
    from kvchat.kernels.layout import KVLayer
    from kvchat.kernels.warmup import launch_warmup, plan_warmup

    num_heads, num_kv_heads, head_dim, act = 9, 3, 64, torch.bfloat16
    fp8 = torch.float8_e4m3fn
    k_cache = torch.zeros(200, 16, num_kv_heads, head_dim, dtype=fp8)
    pool = KVLayer(k_cache, torch.zeros_like(k_cache), *(torch.zeros(200, 16, num_kv_heads) for _ in range(2)))
    launch_warmup(plan_warmup(num_kv_heads, 16, max_context, num_sms), pool, num_heads, act, exact_sink=True)
    warmed = {id(kernel) for _, kernel in compiled}
    print(f"variants compiled by the warm-up: {len(warmed)}")
    del compiled[:]

    def rows(n):  # q, k, v as the model hands them over: views into one projection row per token
        qkv = torch.zeros(n, num_heads + 2 * num_kv_heads, head_dim, dtype=act)
        return qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]

    sink = tuple(torch.zeros(1, num_kv_heads, head_dim) for _ in range(2))
    for width in range(1, max_context // 16 + 1):
        table = torch.zeros(1, width, dtype=torch.int32)
        seq_lens = torch.full((1,), width * 16, dtype=torch.int32)
        q, k, v = rows(1)
        triton_write.write_kv(k, v, pool, torch.zeros(1, dtype=torch.long))
        splits = triton_decode.splits_for(1, num_kv_heads, width * 16, num_sms)
        triton_decode.paged_decode(q, pool, table, seq_lens, 0.125, sink, num_splits=splits,
                                   split_tokens=triton_decode.MIN_TOKENS_PER_SPLIT)  # the engine's launch
        q, _, _ = rows(16)
        triton_extend.extend_attention(q, pool, table, seq_lens, torch.tensor([0, 16], dtype=torch.int32), 0.125, sink)
    new = {(name, id(kernel)) for name, kernel in compiled if id(kernel) not in warmed}
    print(f"new variants during the chat: {len(new)} {sorted(name for name, _ in new)}")


def _compile_all(cc: int) -> None:
    """Compile every kernel variant a bf16/fp16 model uses at SmolLM2 and Llama-3-8B sizes; print spills.

    fp8 pools compile on every target: with Triton's float8e4nv cast on sm_89+, with the bit conversion below.
    """
    import torch

    compiled = _compile_only(cc)
    from kvchat.kernels import triton_decode, triton_extend, triton_fused, triton_write
    from kvchat.kernels.layout import KVLayer

    fp8 = torch.float8_e4m3fn
    bits = cc < 89  # no float8e4nv below sm_89: fp8 bytes converted with integer bit operations
    cases = [  # (num_heads, num_kv_heads, head_dim, activations, pool); fp8 pools with the exact sink, as engines run
        (32, 8, 128, torch.bfloat16, torch.bfloat16),
        (9, 3, 64, torch.float16, torch.float16),
        (32, 8, 128, torch.bfloat16, fp8),
        (9, 3, 64, torch.bfloat16, fp8),
    ]
    hidden = {32: (4096, 14336), 9: (576, 1536)}  # Llama-3-8B's and SmolLM2's hidden and MLP sizes
    for num_heads, num_kv_heads, head_dim, act, pool in cases:
        k_cache = torch.zeros(64, 16, num_kv_heads, head_dim, dtype=pool)
        scales = [torch.zeros(64, 16, num_kv_heads) for _ in range(2)] if pool == fp8 else [None, None]
        layer = KVLayer(k_cache, torch.zeros_like(k_cache), *scales)
        sink = tuple(torch.zeros(4, num_kv_heads, head_dim) for _ in range(2)) if pool == fp8 else None
        kv = torch.zeros(40, num_kv_heads, head_dim, dtype=act)
        triton_write.write_kv(kv, kv, layer, torch.arange(40))
        shift = torch.zeros(num_kv_heads, head_dim, dtype=act) if pool == fp8 else None  # K centring: fp8 pools
        triton_fused.warm_up(*hidden[num_heads], num_heads, act, layer, shift)
        table = torch.zeros(4, 13, dtype=torch.int32)
        seq_lens = torch.ones(4, dtype=torch.int32)
        for splits in (1, 5):
            triton_decode.paged_decode(torch.zeros(4, num_heads, head_dim, dtype=act), layer, table, seq_lens, 0.125,
                                       sink, num_splits=splits, fp8_bits=bits)
        cu = torch.tensor([0, 10, 20, 30, 40], dtype=torch.int32)
        triton_extend.extend_attention(torch.zeros(40, num_heads, head_dim, dtype=act), layer, table, seq_lens, cu,
                                       0.125, sink, fp8_bits=bits)
    cuobjdump = os.path.join(os.path.dirname(sys.modules["triton"].__file__), "backends", "nvidia", "bin", "cuobjdump")
    for name, kernel in compiled:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
            fh.write(kernel.asm["cubin"])
            fh.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", fh.name], capture_output=True, text=True,
                                   check=True).stdout
        found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        assert found is not None, usage
        regs, stack = found.groups()
        print(f"sm_{cc} {name}: {regs} registers" + (f", spills {stack} bytes" if int(stack) else ""))


if __name__ == "__main__":
    if sys.argv[2:] == ["warmup"]:
        _warm_up_then_chat(int(sys.argv[1]))
    else:
        _compile_all(int(sys.argv[1]))
