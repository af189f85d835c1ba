"""A data dir written before the layout change (commit eaf15e7) still resumes from disk (issue 13's constraint).

``tests/data/datadir-eaf15e7.tgz``: ``kvchat ask "Name a fruit." --system "Be brief." --max-tokens 3``
run by kvchat at eaf15e7 on SmolLM2-135M-Instruct (fp8 pool): its kvchat.db and its two chunk files.
Same cache fingerprint and snapshot format ⇒ the next turn restores the stored K/V instead of
prefilling them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from kvchat.index import get_db
from kvchat.store.conversations import get_conversation, list_conversations

FIXTURE = Path(__file__).parent / "data" / "datadir-eaf15e7.tgz"


def test_a_data_dir_from_before_the_refactor_resumes_from_disk(smol_info, kvchat_home):
    kvchat_home.mkdir()
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(kvchat_home, filter="data")
    [chat] = list_conversations(get_db())
    stored = len(get_conversation(get_db(), chat.id).token_ids)
    # pinned to fp32 weights: the fixture was computed with them, and since issue 15 the default (auto) is int8
    # on a CPU, whose K/V differ and so live under another cache fingerprint; fp32's fingerprint is unchanged
    proc = subprocess.run([sys.executable, "-m", "kvchat.cli", "ask", "And a colour?", "--chat", chat.id, "--json",
                           "--max-tokens", "3", "--threads", "1", "--weights", "fp32"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "KVCHAT_HOME": str(kvchat_home)})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["miss_reason"] is None
    assert out["from_disk"] == out["reused_tokens"] >= stored - 16 > 0, out  # restored, not prefilled
    int8 = subprocess.run([sys.executable, "-m", "kvchat.cli", "ask", "And a shape?", "--chat", chat.id, "--json",
                           "--max-tokens", "3", "--threads", "1", "--weights", "int8"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "KVCHAT_HOME": str(kvchat_home)})
    assert int8.returncode == 0, int8.stderr
    assert json.loads(int8.stdout)["miss_reason"].startswith("its KV was saved with fp32 weights; this run uses int8")
    assert [m.text for m in get_conversation(get_db(), chat.id).messages[::2]] == ["Name a fruit.", "And a colour?", "And a shape?"]
