"""The compiled CPU kernels' AVX-512 build gives the AVX2 build's bits (kvchat.kernels.cpu_build.VARIANTS), so
a cache made on one is valid on the other and the fingerprint need not name the build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvchat.kernels import cpu_build, cpu_decode

SCRIPT = Path(__file__).with_name("kernel_outputs.py")


def _outputs(tmp_path: Path, setting: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "KVCHAT_CPU_KERNEL"}
    if setting is not None:
        env["KVCHAT_CPU_KERNEL"] = setting
    path = tmp_path / f"{setting}.pt"
    subprocess.run([sys.executable, str(SCRIPT), str(path)], env=env, check=True, timeout=600,
                   cwd=Path(__file__).parents[2])
    return torch.load(path)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.skipif(not cpu_decode.available(), reason="the compiled CPU kernels do not build here")
@pytest.mark.skipif(not cpu_build.supported("avx512"), reason="this CPU has no AVX-512: only the AVX2 build runs")
def test_the_avx512_build_gives_the_avx2_builds_bits(tmp_path):
    avx2, avx512 = _outputs(tmp_path, "avx2"), _outputs(tmp_path, None)
    assert (avx2.pop("variant"), avx512.pop("variant")) == ("avx2", "avx512")
    assert avx2.keys() == avx512.keys() and len(avx2) > 60
    differ = [name for name in avx2 if not torch.equal(_bits(avx2[name]), _bits(avx512[name]))]
    assert not differ, differ
    # the outputs are real: not all zeros, and the engine's chunk moved the hidden states
    assert all(t.float().abs().sum() > 0 for name, t in avx2.items() if "pool" not in name)


def test_the_build_follows_the_setting(monkeypatch):
    monkeypatch.setenv("KVCHAT_CPU_KERNEL", "avx2")
    assert cpu_build.chosen_variant() == "avx2"
    monkeypatch.delenv("KVCHAT_CPU_KERNEL")
    assert cpu_build.chosen_variant() == ("avx512" if cpu_build.supported("avx512") else "avx2")


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from kvchat.kernels import cpu_int8\n"
            "print(cpu_int8.small_rows_kernel(), cpu_int8.small_rows_kernel())")
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(not cpu_decode.available(), reason="the compiled CPU kernels do not build here")
@pytest.mark.skipif(not cpu_build.supported("avx512"), reason="this CPU has no AVX-512: only the AVX2 build runs")
def test_an_avx512_build_that_fails_falls_back_to_the_avx2_build_with_one_notice(tmp_path):
    """A compiler that refuses AVX-512 flags (an old one, say): the AVX2 build runs, one notice says so."""
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -mavx512f ] && { echo "no avx512 here" >&2; exit 1; }; done\n'
                  'exec gcc "$@"\n')
    cc.chmod(0o755)
    got = _probe({"XDG_CACHE_HOME": str(tmp_path / "cache"), "CC": str(cc)})
    assert got.stdout.split() == ["avx2", "avx2"], got.stderr
    assert got.stderr.count("its avx512 build is unavailable") == 1 and "no avx512 here" in got.stderr
    built = [p.name for p in (tmp_path / "cache").glob("kvchat/kernels/cpu_int8-*.so")]
    assert len(built) == 1 and built[0].startswith("cpu_int8-avx2-"), built
