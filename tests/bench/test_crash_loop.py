"""Random kill -9 of `kvchat ask` during a scripted chat: nothing lost, nothing wrong restored.

A small count of the loop that ``python -m kvchat.bench.crash_loop --kills 50``
runs (docs/reliability.md): real processes, the real model, greedy answers.
The checker itself is shown to catch a damaged answer and a damaged chunk.
"""

from __future__ import annotations

import os
import sqlite3

import pytest

from kvchat.bench.crash_checks import check_store
from kvchat.bench.crash_loop import run_loop
from kvchat.bench.crash_script import ScriptConfig
from kvchat.phase_trace import TRACE_ENV, mark, read_trace

pytestmark = pytest.mark.fault


def test_random_kills_keep_store_sound_and_resumes_exact(tmp_path, smol_info, kvchat_home):
    cfg = ScriptConfig(turns=2, max_tokens=8, threads=1, models=smol_info.path.parent)
    # seed 3: the first kill waits for the decode phase, the second for the snapshot writes
    report = run_loop(2, home=kvchat_home, work=tmp_path / "work", cfg=cfg, seed=3)
    assert report.problems == []
    assert len(report.kills) == 2
    assert report.store_checks == report.integrity_ok >= 3
    assert report.answers_checked >= 1 and report.answers_equal == report.answers_checked
    assert report.corrupt_seen == 0 and report.final_rows_without_file == 0
    assert "0 corrupt chunk(s) dropped" in report.final_verify

    # the checks are not vacuous: a changed answer or changed token ids are reported
    with sqlite3.connect(kvchat_home / "kvchat.db") as conn:
        conn.execute("UPDATE messages SET text = text || '!' WHERE id = (SELECT max(id) FROM messages)")
    assert any("stored answer" in p for p in check_store(kvchat_home, report.reference).problems)
    with sqlite3.connect(kvchat_home / "kvchat.db") as conn:
        conn.execute("UPDATE conversations SET token_ids = substr(token_ids, 5)")
    assert any("token ids" in p for p in check_store(kvchat_home, report.reference).problems)


def test_phase_trace_lines(tmp_path, monkeypatch):
    path = tmp_path / "trace"
    monkeypatch.delenv(TRACE_ENV, raising=False)
    mark("loaded")  # unset: nothing written anywhere
    monkeypatch.setenv(TRACE_ENV, str(path))
    mark("loaded")
    mark("decoding")
    with open(path, "a") as f:
        f.write("123.0 torn")  # a torn last line is ignored
    assert [p for _, p in read_trace(path)] == ["loaded", "decoding"]
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert read_trace(tmp_path / "missing") == []
