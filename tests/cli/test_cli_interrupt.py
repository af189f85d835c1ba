"""Ctrl+C at any moment of a start is the user's interrupt: one JSON object (``--json``) or one line, exit 130,
never a traceback or an "internal error" (an interrupt inside a library's import can surface as another error
there); and reading the command line imports no torch, so a usage error or the TUI's first frame is quick."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest


def test_parsing_the_command_line_imports_no_heavy_package():
    code = ("import sys; from kvchat.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'numpy', 'textual', 'llguidance') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.model
@pytest.mark.parametrize("after_s", [0.8, 1.6, 2.4])  # in the imports of torch and transformers, the model load
def test_an_interrupt_during_the_start_is_one_json_object(smol_info, tmp_path, after_s):
    env = {**os.environ, "KVCHAT_HOME": str(tmp_path / "home"), "KVCHAT_MODELS": str(smol_info.path.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "kvchat.cli", "ask", "Say hi.", "--max-tokens", "200", "--json"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the answer was complete before the interrupt")
    assert proc.returncode == 130 and "Traceback" not in err, err
    error = json.loads(out)["error"]
    assert error["type"] == "interrupted" and error["exit_status"] == 130, error
