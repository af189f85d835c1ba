"""The compiled CPU kernels' AVX-512 builds (VNNI among them) give the AVX2 build's bits
(kvchat.kernels.cpu_build.VARIANTS), so a cache made on one is valid on the other and the fingerprint need not
name the build."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvchat.kernels import cpu_attention, cpu_build, cpu_decode, cpu_int4, cpu_int8
from kvchat.settings import SettingError

SCRIPT = Path(__file__).with_name("kernel_outputs.py")


def _cc() -> str | None:
    """The compiler the kernels build with, or None."""
    try:
        return cpu_build._compiler()[0]
    except FileNotFoundError:
        return None


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
    # what each process loaded, not what it asked for: the int4 kernel and the decode layer that links it load
    # the integer build (VNNI where the CPU has it)
    integer = "avx512vnni" if cpu_build.supported("avx512vnni") else "avx512"
    for build, out in (("avx2", avx2), ("avx512", avx512)):
        names = out.pop("libraries")
        want = {"cpu_int8": build, "cpu_attention": build} | dict.fromkeys(
            ("cpu_int4", "cpu_decode"), integer if build == "avx512" else build)
        assert {n.split("-")[0]: n.split("-")[1] for n in names} == want, names
    assert avx2.keys() == avx512.keys() and len(avx2) > 110
    differ = [name for name in avx2 if not torch.equal(_bits(avx2[name]), _bits(avx512[name]))]
    assert not differ, differ
    # the outputs are real: not all zeros, and the engine's chunk moved the hidden states
    assert all(t.float().abs().sum() > 0 for name, t in avx2.items() if "pool" not in name)


def test_the_build_follows_the_setting(monkeypatch):
    monkeypatch.setenv("KVCHAT_CPU_KERNEL", "AVX2")
    assert cpu_build.chosen_variant() == "avx2"
    monkeypatch.delenv("KVCHAT_CPU_KERNEL")
    assert cpu_build.chosen_variant() == ("avx512" if cpu_build.supported("avx512") else "avx2")
    monkeypatch.setenv("KVCHAT_CPU_KERNEL", "avx512")
    with pytest.raises(SettingError, match="KVCHAT_CPU_KERNEL"):
        cpu_build.chosen_variant()


@pytest.mark.skipif(_cc() is None, reason="no C compiler")
def test_the_avx512_build_compiles_on_any_cpu_and_keeps_the_other_builds_current_library(tmp_path, monkeypatch):
    """The AVX-512 sources compile where the CPU cannot run them (an AVX2-only CI); a build removes another
    version's library unused for a week, but not one used since (another checkout's) nor the other build's
    current one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    sources = (cpu_decode.SOURCE, cpu_int8.SOURCE, cpu_int4.SOURCE, cpu_attention.SOURCE)
    avx2 = cpu_build.library_path(*sources, variant="avx2")
    avx2.parent.mkdir(parents=True)
    avx2.write_bytes(b"current")
    stale = avx2.with_name("cpu_decode-avx512-0123456789abcdef.so")
    stale.write_bytes(b"old")
    week = time.time() - cpu_build.STALE_S - 60
    os.utime(stale, (week, week))
    recent = avx2.with_name("cpu_decode-avx512-fedcba9876543210.so")
    recent.write_bytes(b"another checkout's")
    built = cpu_build._build(sources, "avx512")
    assert built == cpu_build.library_path(*sources, variant="avx512") and built.stat().st_size > 10_000
    assert avx2.read_bytes() == b"current" and not stale.exists() and recent.exists()


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess:
    """A process that loads the int8 kernel's AVX-512 build twice and prints the library it got."""
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from pathlib import Path\n"
            "from kvchat.kernels import cpu_build, cpu_int8\n"
            "libs = [cpu_build.load(cpu_int8.SOURCE, variant='avx512') for _ in range(2)]\n"
            "print(*(Path(lib._name).name for lib in libs))")
    base = {k: v for k, v in os.environ.items() if k != "KVCHAT_CPU_KERNEL"}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(not cpu_decode.available(), reason="the compiled CPU kernels do not build here")
def test_an_avx512_build_that_fails_falls_back_to_the_avx2_build_with_one_notice(tmp_path):
    """A compiler that refuses AVX-512 flags (an old one, say), or a CPU without them: the AVX2 build runs, one
    notice says why."""
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -mavx512f ] && { echo "no avx512 here" >&2; exit 1; }; done\n'
                  f'exec {_cc()} "$@"\n')
    cc.chmod(0o755)
    got = _probe({"XDG_CACHE_HOME": str(tmp_path / "cache"), "CC": str(cc)})
    names = got.stdout.split()
    assert len(names) == 2 and all(n.startswith("cpu_int8-avx2-") for n in names), got.stderr
    why = "no avx512 here" if cpu_build.supported("avx512") else "the CPU lacks avx512"
    assert got.stderr.count("its avx512 build is unavailable") == 1 and why in got.stderr, got.stderr
    built = [p.name for p in (tmp_path / "cache").glob("kvchat/kernels/cpu_int8-*.so")]
    assert len(built) == 1 and built[0].startswith("cpu_int8-avx2-"), built
