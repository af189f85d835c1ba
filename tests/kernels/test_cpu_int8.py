"""The compiled CPU int8 matmul (kvchat.kernels.cpu_int8): its numbers, its layouts, its build cache and its fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from kvchat.engine.cache_identity import CacheIdentity, fingerprint_variants
from kvchat.kernels import cpu_int8
from kvchat.model.int8_scheme import int8_compute_scheme

needs_kernel = pytest.mark.skipif(not cpu_int8.available(), reason="the compiled CPU int8 kernel does not build here")


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    return q, torch.rand(n, k // 32, generator=gen) * 0.01, torch.randn(n, k // 32, generator=gen) * 0.1


@needs_kernel
@pytest.mark.parametrize("n,k", [(40, 576), (24, 1536), (13, 64)])
def test_each_row_is_an_fp32_dot_product_whatever_the_other_rows(n, k):
    q, scale, offset = _weights(n, k)
    x = torch.randn(15, k, generator=torch.Generator().manual_seed(1))  # rows in an eight, a four, a pair, alone
    y = cpu_int8.int8_matmul(x, q, scale, offset)
    w = (q.double().view(n, -1, 32) * scale.double()[..., None] + offset.double()[..., None]).view(n, k)
    parts = (q.double().abs().view(n, -1, 32) * scale.double()[..., None] + offset.double().abs()[..., None]).view(n, k)
    exact, mass = x.double() @ w.t(), x.abs().double() @ parts.t()
    assert ((y.double() - exact).abs() <= 2**-16 * mass).all()  # fp32 rounding only (a bf16 input: ~2**-9)
    # a row alone (decode), in a pair, a four or an eight, or among an odd count gives the same bits
    for i in range(15):
        assert torch.equal(cpu_int8.int8_matmul(x[i : i + 1].clone(), q, scale, offset)[0], y[i])
    for start, stop in ((2, 5), (3, 7), (0, 4), (1, 13)):
        got = cpu_int8.int8_matmul(x[start:stop].clone(), q, scale, offset)
        assert torch.equal(got, y[start:stop])


@needs_kernel
def test_threads_and_calling_thread_do_not_change_the_bits():
    q, scale, offset = _weights(1000, 576)
    x = torch.randn(3, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_int8.int8_matmul(x, q, scale, offset)
        torch.set_num_threads(2)
        two = cpu_int8.int8_matmul(x, q, scale, offset)
    finally:
        torch.set_num_threads(before)
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("y", cpu_int8.int8_matmul(x, q, scale, offset)))
    worker.start()
    worker.join()
    assert torch.equal(one, two) and torch.equal(one, out["y"])


@needs_kernel
def test_layouts_it_does_not_take_are_refused():
    q, scale, offset = _weights(8, 96)
    x = torch.randn(1, 96)
    cpu_int8.int8_matmul(x, q, scale, offset)
    with pytest.raises(ValueError, match="not a layout"):
        cpu_int8.int8_matmul(torch.randn(1, 48), q[:, :48], scale[:, :1], offset[:, :1])  # 48 inputs: not groups of 32
    with pytest.raises(ValueError, match="not a layout"):
        cpu_int8.int8_matmul(x.double(), q, scale, offset)
    with pytest.raises(ValueError, match="not a layout"):
        cpu_int8.int8_matmul(torch.randn(1, 64), q, scale, offset)
    with pytest.raises(ValueError, match="not a layout"):
        cpu_int8.int8_matmul(x, q, scale, offset[:, :2])


def test_each_kernel_has_its_own_cache_fingerprint():
    names = {int8_compute_scheme(k) for k in ("int8mm", "avx2")} | {
        int8_compute_scheme("avx2", layers=layers, prefill=prefill) for layers in (False, True) for prefill in (False, True)}
    assert len(names) == 5
    assert int8_compute_scheme("int8mm") == "int8-v1-per-channel-down_proj256-mm256"  # the name before this kernel
    # the name before the compiled decoder layers ran short chunks, and where they do not
    assert int8_compute_scheme("avx2") == "int8-affine-g32-v1-avx2f32x32-mm256"
    assert int8_compute_scheme("avx2", layers=True) == "int8-affine-g32-v1-avx2f32x32-mm256-layer32v2"
    assert (int8_compute_scheme("avx2", layers=True, prefill=True)
            == "int8-affine-g32-v1-avx2f32x32-mm256-layer32v2-prefill-a8g32v1")  # int8 activations in prefill
    variants = fingerprint_variants("m", "bf16", 16, ("int8",))  # a store may hold caches of any kind
    assert len(variants) == 5 and CacheIdentity("m", "bf16", 16, "int8").fingerprint in variants
    assert CacheIdentity("m", "bf16", 16, "int8", int8_kernel="avx2", compiled_layers=True).fingerprint in variants
    with pytest.raises(ValueError, match="unknown int8 kernel"):
        int8_compute_scheme("avx512")


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from kvchat.kernels import cpu_int8\n"
            "print(cpu_int8.small_rows_kernel(), cpu_int8.small_rows_kernel())")
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


@needs_kernel
def test_built_once_into_the_cache_dir_and_reused_by_the_next_process(tmp_path):
    first = _probe({"XDG_CACHE_HOME": str(tmp_path)})
    assert first.stdout.split() == ["avx2", "avx2"], first.stderr
    built = list(tmp_path.glob("kvchat/kernels/cpu_int8-*.so"))
    assert len(built) == 1 and not list(tmp_path.glob("kvchat/kernels/.cpu_int8-*"))  # no temp file left
    stamp = built[0].stat()
    # the next process finds it: no compiler needed any more (the same file; each load touches its mtime)
    again = _probe({"XDG_CACHE_HOME": str(tmp_path), "PATH": os.path.dirname(sys.executable)})
    assert again.stdout.split() == ["avx2", "avx2"], again.stderr
    now = built[0].stat()  # a rebuild would have replaced the file (os.replace: another inode)
    assert now.st_ino == stamp.st_ino and now.st_size == stamp.st_size and now.st_mtime_ns >= stamp.st_mtime_ns


def test_without_a_compiler_or_when_turned_off_int8_layers_keep_torchs_kernel(tmp_path):
    broken = _probe({"XDG_CACHE_HOME": str(tmp_path), "CC": str(tmp_path / "no-such-cc"), "PATH": str(tmp_path)})
    assert broken.stdout.split() == ["int8mm", "int8mm"]
    assert broken.stderr.count("compiled CPU kernel cpu_int8 unavailable") == 1  # one notice, not one per call
    assert not list(tmp_path.glob("kvchat/kernels/*"))
    named = _probe({"XDG_CACHE_HOME": str(tmp_path), "CC": str(tmp_path / "no-such-cc")})  # $CC is honoured
    assert named.stdout.split() == ["int8mm", "int8mm"] and "is not an executable" in named.stderr
    off = _probe({"XDG_CACHE_HOME": str(tmp_path), "KVCHAT_CPU_KERNEL": "0"})
    assert off.stdout.split() == ["int8mm", "int8mm"] and "unavailable" not in off.stderr
    assert not list(tmp_path.glob("kvchat/kernels/*.so"))
    bad = _probe({"KVCHAT_CPU_KERNEL": "yes"})
    assert bad.returncode != 0 and "KVCHAT_CPU_KERNEL" in bad.stderr
