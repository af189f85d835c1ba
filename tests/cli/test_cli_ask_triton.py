"""`kvchat ask --json` on the Triton path (the interpreter, on CPU) against the default CPU path.

Both backends read the exact attention sink, so they run one fp8 scheme under
one cache fingerprint: a chat stored by the default path is restored from
disk by a fresh Triton process (only an equal fingerprint finds its chunks).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")]


def _ask(args: list[str], home: Path, models: Path, **env: str) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("KVCHAT_ATTENTION", "KVCHAT_DEVICE")}
    full |= {"KVCHAT_HOME": str(home), "KVCHAT_MODELS": str(models), "KVCHAT_DEVICE": "cpu"} | env
    proc = subprocess.run([sys.executable, "-m", "kvchat.cli", "ask", *args, "--json"], capture_output=True,
                          text=True, env=full, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_triton_path_reports_the_cpu_scheme_and_restores_its_chat(smol_info, kvchat_home):
    models = smol_info.path.parent
    cpu = _ask(["Say hi.", "--max-tokens", "3"], kvchat_home, models, KVCHAT_ATTENTION="torch")
    assert cpu["kv_dtype"] == "fp8" and cpu["scale_scheme"].endswith("+sink")
    tri = _ask(["Thanks.", "--chat", cpu["chat_id"], "--max-tokens", "2"], kvchat_home, models,
               KVCHAT_ATTENTION="triton", TRITON_INTERPRET="1")
    assert tri["scale_scheme"] == cpu["scale_scheme"]
    assert tri["from_disk"] > 0 and tri["reused_tokens"] >= tri["from_disk"], tri  # same fingerprint: chunks found
    assert tri["miss_reason"] in (None, ""), tri
    assert tri["text"] is not None
