"""Running ``kvchat`` in a child process as a user would, and checking what it leaves behind."""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from kvchat.tui.app import EXIT_CANNOT_RUN

HEADLESS = {"TEXTUAL_DRIVER": "textual.drivers.headless_driver:HeadlessDriver"}
CAPS_WITHOUT_OVERRIDE = (1, 2, 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
PR_CAPBSET_DROP = 24
RUN_KVCHAT = "import sys; from kvchat.cli.main import main; sys.exit(main(sys.argv[1:]))"


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` with the sha256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _drop_root_override() -> None:
    """In the child: root loses the capabilities that ignore file modes, so a read-only dir is read-only."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in CAPS_WITHOUT_OVERRIDE:
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def run_kvchat(home: Path, *argv: str, timeout: float = 90) -> subprocess.CompletedProcess:
    """``kvchat ARGV`` (no ARGV: the TUI, headless) in a fresh process on data dir ``home``; root runs without
    DAC override."""
    env = {**os.environ, **HEADLESS, "KVCHAT_HOME": str(home)}
    pre = _drop_root_override if os.geteuid() == 0 else None
    return subprocess.run([sys.executable, "-c", RUN_KVCHAT, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=pre, check=False)


def assert_one_error_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == EXIT_CANNOT_RUN, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvchat: error: "), proc.stderr
    for w in words:
        assert w in lines[0], lines[0]
