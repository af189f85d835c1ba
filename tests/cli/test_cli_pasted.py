"""A document pasted into ``kvchat ask`` (fresh processes, the real model): in a new chat's first message it is
listed by ``kvchat doc list``; pasted in a later turn of a chat it is not (only that chat could reuse it, from
its own snapshot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

DOC = "\n\n".join(f"Section {i}. The river Alder passes mill {i * 7}; its miller keeps {i + 3} cats and a grain "
                  "ledger." for i in range(24))


@pytest.fixture
def models(smol_info):
    return smol_info.path.parent


def run_cli(args: list[str], home, models) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVCHAT_HOME": str(home), "KVCHAT_MODELS": str(models)}
    return subprocess.run([sys.executable, "-m", "kvchat.cli", *args], capture_output=True, text=True, env=env, timeout=600)


def _docs(home, models) -> list[str]:
    out = run_cli(["doc", "list"], home, models)
    assert out.returncode == 0, out.stderr
    return [line.split(None, 3)[3] for line in out.stdout.splitlines()[1:]]  # ID TOKENS CACHED TITLE


def test_a_pasted_document_is_listed_only_from_a_first_message(models, kvchat_home):
    later = run_cli(["ask", "Hello", "--max-tokens", "2", "--json"], kvchat_home, models)
    assert later.returncode == 0, later.stderr
    chat = json.loads(later.stdout)["chat_id"]
    out = run_cli(["ask", DOC + "\n\nWhat does the miller keep?", "--chat", chat, "--max-tokens", "2"], kvchat_home, models)
    assert out.returncode == 0, out.stderr
    assert _docs(kvchat_home, models) == []
    first = run_cli(["ask", DOC + "\n\nWhat does the miller keep?", "--max-tokens", "2"], kvchat_home, models)
    assert first.returncode == 0, first.stderr
    (title,) = _docs(kvchat_home, models)
    assert title.startswith("pasted: Section 0. The river Alder")
