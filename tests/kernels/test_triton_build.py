"""Where Triton cannot build its host launcher (no C compiler, no Python headers), a GPU engine takes the PyTorch
reference path with one line instead of a traceback (kvchat.kernels.triton_build, kvchat.kernels.dispatch)."""

from __future__ import annotations

import logging
import shutil
import subprocess

import pytest

from kvchat.kernels import dispatch
from kvchat.kernels.triton_build import is_build_failure, launcher_problem


@pytest.fixture
def fresh_dispatch(monkeypatch):
    """The dispatch's once-per-process state (the launcher check, a failed build, notices) starts empty."""
    monkeypatch.setattr(dispatch, "_build_failed", [])
    monkeypatch.setattr(dispatch, "_noticed", set())
    dispatch._launcher_problem.cache_clear()
    yield
    dispatch._launcher_problem.cache_clear()


def test_a_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert launcher_problem() == f"the C compiler CC={tmp_path / 'no-such-cc'} does not exist"
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    assert launcher_problem() == "there is no C compiler (gcc or clang on PATH, or CC)"


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("clang") is None, reason="needs a C compiler")
def test_a_machine_with_a_compiler_and_headers_has_no_problem(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    assert launcher_problem() is None


def test_what_triton_raises_for_a_failed_build_is_recognised():
    assert is_build_failure(subprocess.CalledProcessError(1, ["gcc", "main.c"]))
    assert is_build_failure(FileNotFoundError(2, "No such file or directory", "/opt/cc"))
    assert is_build_failure(RuntimeError("Failed to find C compiler. Please specify via CC environment variable"))
    # other errors never switch Triton off
    assert not is_build_failure(FileNotFoundError(2, "No such file or directory", "/models/m/accelerate.json"))
    assert not is_build_failure(RuntimeError("the compiler of a shape went wrong in a kernel"))
    assert not is_build_failure(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_build_failure(ValueError("compiler"))


def test_no_compiler_sends_cuda_tensors_to_the_reference_with_one_line(monkeypatch, tmp_path, caplog, fresh_dispatch):
    monkeypatch.setattr(dispatch, "_triton_importable", lambda: True)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
        assert [dispatch._cuda_backend() for _ in range(3)] == ["torch"] * 3
    assert [r.getMessage() for r in caplog.records] == [
        f"kvchat: Triton cannot build its kernel launcher: the C compiler CC={tmp_path / 'no-such-cc'} does not exist "
        "(install gcc and the Python headers (python3-dev) or set CC); attention runs on the PyTorch reference path"]


def test_a_build_that_failed_later_switches_triton_off_too(monkeypatch, caplog, fresh_dispatch):
    monkeypatch.setattr(dispatch, "_triton_importable", lambda: True)
    monkeypatch.delenv("CC", raising=False)
    if dispatch.triton_unusable() is not None:
        pytest.skip("no C compiler here: the check already switches Triton off")
    assert dispatch._cuda_backend() == "triton"
    dispatch.disable_triton("CalledProcessError: Command '['gcc', 'cuda_utils.c']' returned non-zero exit status 1.")
    with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
        assert dispatch._cuda_backend() == "torch"
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("kvchat: Triton cannot build its kernel launcher: CalledProcessError: ") and "\n" not in line
