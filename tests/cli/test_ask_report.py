"""What ``kvchat ask`` reports besides the answer (real subprocesses, the real model): one line of figures on
stderr without ``--json``, and under ``--json`` every error as one JSON object on stdout with the plain run's
exit status."""

from __future__ import annotations

import json
import re

import pytest
from process_helpers import run_kvchat

pytestmark = pytest.mark.model
FIGURES = re.compile(r"^kvchat: reused ([\d,]+) of ([\d,]+) tokens \(([\d,]+) from memory, ([\d,]+) from disk in "
                     r"\d+ ms\) · prefilled [\d,]+ · TTFT \d+ ms · [\d.]+ tok/s$")


def _figures(stderr: str) -> tuple[int, ...]:
    (m,) = [m for m in map(FIGURES.match, stderr.splitlines()) if m]
    return tuple(int(g.replace(",", "")) for g in m.groups())


def test_plain_ask_says_what_was_reused_from_disk_and_how_fast(tmp_path, smol_info):
    home = tmp_path / "home"
    first = run_kvchat(home, "ask", "Say hi.", "--max-tokens", "4", timeout=300)
    assert first.returncode == 0, first.stderr
    reused, prompt, memory, disk = _figures(first.stderr)
    assert (reused, memory, disk) == (0, 0, 0) and prompt > 0
    chat_id = re.search(r"--chat (c_\w+)", first.stderr).group(1)
    again = run_kvchat(home, "ask", "Again.", "--chat", chat_id, "--max-tokens", "2", timeout=300)
    assert again.returncode == 0, again.stderr
    reused, prompt, memory, disk = _figures(again.stderr)  # a new process: the history comes from disk
    assert memory == 0 and disk == reused and reused >= prompt - 16, again.stderr


def _json_error(proc, kind: str, status: int = 2) -> dict:
    assert proc.returncode == status, (proc.stdout, proc.stderr)
    assert proc.stderr == "" and "Traceback" not in proc.stdout
    (line,) = proc.stdout.splitlines()
    err = json.loads(line)["error"]
    assert err["type"] == kind and err["exit_status"] == status and err["message"], err
    return err


def test_every_ask_json_error_is_one_json_object(tmp_path, smol_info):
    home = tmp_path / "home"
    long_doc = tmp_path / "long.txt"
    long_doc.write_text("The quick brown fox jumps over the lazy dog. " * 1200)  # ~12k tokens > 8192
    cases = [
        (["ask", "hi", "--json", "--max-tokens", "many"], "usage_error", "invalid int value: 'many'"),
        (["ask", "--json"], "usage_error", "required: prompt"),
        (["ask", "hi", "--json", "--bogus"], "usage_error", "unrecognized arguments: --bogus"),
        (["ask", "   ", "--json"], "invalid_request", "prompt is empty"),
        (["ask", "hi", "--json", "--temperature", "-1"], "invalid_request", "temperature"),
        (["ask", "hi", "--json", "--doc", str(tmp_path / "missing.txt")], "invalid_request", "cannot read document"),
        (["ask", "hi", "--json", "--chat", "c_nope00"], "not_found", "no conversation"),
        (["ask", "hi", "--json", "--model", "no-such-model"], "not_found", "unknown model"),
    ]
    for argv, kind, words in cases:
        err = _json_error(run_kvchat(home, *argv, timeout=300), kind)
        assert words in err["message"], (argv, err)
    err = _json_error(run_kvchat(home, "ask", "Summarize.", "--json", "--doc", str(long_doc), timeout=300),
                      "context_length_exceeded")
    assert "context limit is 8192 tokens" in err["message"], err
    assert not home.exists() or not (home / "kvchat.db").exists()  # nothing stored by any of them
    # the plain run of the same command: one error line, the same exit status
    plain = run_kvchat(home, "ask", "hi", "--chat", "c_nope00", timeout=300)
    assert plain.returncode == 2 and plain.stdout == "" and plain.stderr.startswith("kvchat: error: no conversation")
