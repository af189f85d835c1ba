"""The checkout's top-level ``kernels/`` folder never poses as Hugging Face's ``kernels`` package.

transformers imports ``kernels`` (Hugging Face's hub kernels) as soon as its model code loads. Every
way of running kvchat from the checkout root puts the root on ``sys.path`` (``python -m pytest``,
``python -c``, ``python -m kvchat.cli``), so the folder must not be a regular package there; it is
the namespace package ``kvchat.kernels`` instead (see ``kvchat/__init__.py``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import json, kernels, transformers\n"
         "from transformers import LlamaConfig\n"
         "import kvchat.kernels.dispatch as d, kvchat.kernels.cpu_attention\n"
         "print(json.dumps({'kernels': getattr(kernels, '__file__', None), 'dispatch': d.__file__}))\n")


def _hub_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_the_checkout_root_holds_no_regular_kernels_package():
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert (ROOT / "kernels" / "dispatch.py").is_file()


def test_this_test_process_imports_transformers_model_code_and_kvchat_kernels():
    from transformers import LlamaConfig  # noqa: F401  (imports Hugging Face's kernels where installed)

    dispatch = importlib.import_module("kvchat.kernels.dispatch")
    assert Path(dispatch.__file__).resolve() == ROOT / "kernels" / "dispatch.py"
    hub = sys.modules.get("kernels")
    if hub is not None:
        assert ROOT not in Path(getattr(hub, "__file__", None) or "/").resolve().parents


@pytest.mark.parametrize("flags", [[], ["-P"]], ids=["cwd-on-path", "safe-path"])
def test_python_c_from_the_checkout_root(flags):
    proc = subprocess.run([sys.executable, *flags, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(found["dispatch"]).resolve() == ROOT / "kernels" / "dispatch.py"
    if _hub_kernels_installed():
        assert found["kernels"] and ROOT not in Path(found["kernels"]).resolve().parents, found


@pytest.mark.model
def test_python_m_kvchat_cli_ask_from_the_checkout_root(smol_info, kvchat_home):
    env = {**os.environ, "KVCHAT_HOME": str(kvchat_home), "KVCHAT_MODELS": str(smol_info.path.parent)}
    proc = subprocess.run([sys.executable, "-m", "kvchat.cli", "ask", "Say hi.", "--max-tokens", "4", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["new_tokens"] > 0 and out["chat_id"]
