"""``kvchat ask --weights int4`` on the real default model, as a user runs it: one short turn, the next turn
resumed from disk with the same weights, and snapshots never crossing int4 and int8 weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.kernels import cpu_int4

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not cpu_int4.available(), reason="the compiled CPU int4 kernel does not build here")]


def _ask(home: Path, models: Path, *args: str) -> dict:
    env = {**os.environ, "KVCHAT_HOME": str(home), "KVCHAT_MODELS": str(models)}
    env.pop("KVCHAT_WEIGHTS", None)
    proc = subprocess.run([sys.executable, "-m", "kvchat.cli", "ask", *args, "--json", "--max-tokens", "3",
                           "--threads", "1"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_ask_with_int4_weights_resumes_from_disk_and_never_crosses_int8(smol_info, kvchat_home):
    models = smol_info.path.parent
    first = _ask(kvchat_home, models, "Name a fruit.", "--weights", "int4")
    assert first["text"].strip() and first["prefilled_tokens"] > 0
    chat = first["chat_id"]
    again = _ask(kvchat_home, models, "And a colour?", "--chat", chat, "--weights", "int4")
    assert again["miss_reason"] is None
    assert again["from_disk"] == again["reused_tokens"] > 0, again  # the int4 snapshot restored, not prefilled
    # the int4 chat's snapshot is not restored into an int8 engine (another cache fingerprint) ...
    int8 = _ask(kvchat_home, models, "And a shape?", "--chat", chat, "--weights", "int8")
    assert int8["miss_reason"].startswith("its KV was saved with int4 weights; this run uses int8"), int8
    # ... nor an int8 chat's into an int4 engine
    other = _ask(kvchat_home, models, "Name a tree.", "--weights", "int8")["chat_id"]
    int4 = _ask(kvchat_home, models, "And a bird?", "--chat", other, "--weights", "int4")
    assert int4["miss_reason"].startswith("its KV was saved with int8 weights; this run uses int4"), int4
