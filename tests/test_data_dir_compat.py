"""A data dir written before the layout change (commit eaf15e7) still resumes from disk: users' caches survive upgrades.

``tests/data/datadir-eaf15e7.tgz``: ``kvchat ask "Name a fruit." --system "Be brief." --max-tokens 3``
run by kvchat at eaf15e7 on SmolLM2-135M-Instruct (fp8 pool): its kvchat.db and its two chunk files, and
``models/.calibration/``, the K-centring calibration that run computed in its models dir. The calibration's
digest is part of the cache fingerprint, and it is computed by a float forward whose last bits depend on the CPU
(the first fixture, made on an AVX-512 machine, missed on an AVX2-only one: another digest), so a data dir resumes
with the models dir's calibration it was made with; the test's models dir holds the fixture's beside the model.
Same cache fingerprint and snapshot format ⇒ the next turn restores the stored K/V instead of prefilling them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

from kvchat.index import get_db
from kvchat.store.conversations import get_conversation, list_conversations

FIXTURE = Path(__file__).parent / "data" / "datadir-eaf15e7.tgz"


def _models_dir(fixture_models: Path, smol_dir: Path) -> Path:
    """The fixture's models dir (its calibration) with the imported model and the shared int8 weights linked in."""
    (fixture_models / smol_dir.name).symlink_to(smol_dir, target_is_directory=True)
    weights = smol_dir.parent / ".weights"
    weights.mkdir(mode=0o700, exist_ok=True)
    (fixture_models / ".weights").symlink_to(weights, target_is_directory=True)
    return fixture_models


def test_a_data_dir_from_before_the_refactor_resumes_from_disk(smol_info, kvchat_home, tmp_path, monkeypatch):
    kvchat_home.mkdir()
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path / "fixture", filter="data")
    for name in ("kvchat.db", "kv"):
        (tmp_path / "fixture" / name).rename(kvchat_home / name)
    models = _models_dir(tmp_path / "fixture" / "models", smol_info.path)
    monkeypatch.setenv("KVCHAT_MODELS", str(models))
    [chat] = list_conversations(get_db())
    stored = len(get_conversation(get_db(), chat.id).token_ids)
    # pinned to fp32 weights: the fixture was computed with them, and the default (auto) is int8
    # on a CPU, whose K/V differ and so live under another cache fingerprint; fp32's fingerprint is unchanged
    proc = subprocess.run([sys.executable, "-m", "kvchat.cli", "ask", "And a colour?", "--chat", chat.id, "--json",
                           "--max-tokens", "3", "--threads", "1", "--weights", "fp32"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["miss_reason"] is None
    assert out["from_disk"] == out["reused_tokens"] >= stored - 16 > 0, out  # restored, not prefilled
    int8 = subprocess.run([sys.executable, "-m", "kvchat.cli", "ask", "And a shape?", "--chat", chat.id, "--json",
                           "--max-tokens", "3", "--threads", "1", "--weights", "int8"], capture_output=True, text=True,
                          timeout=600)
    assert int8.returncode == 0, int8.stderr
    assert json.loads(int8.stdout)["miss_reason"].startswith("its KV was saved with fp32 weights; this run uses int8")
    assert [m.text for m in get_conversation(get_db(), chat.id).messages[::2]] == ["Name a fruit.", "And a colour?", "And a shape?"]
