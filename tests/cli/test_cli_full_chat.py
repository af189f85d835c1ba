"""`kvchat ask --chat FULL`: one error line naming the ways on as ``--new-chat`` values, and each way taken (real
subprocesses, the real model on a 256-token context: a 3 MiB KV pool)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.store.conversations import get_conversation, list_conversations
from kvchat.store.db import connect

pytestmark = pytest.mark.model
LONG = ("Tell me more about the heron, the mill, the river and the stones, and what the children do there in summer, "
        "in as much detail as you can.")


def ask(home: Path, models: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVCHAT_HOME": str(home), "KVCHAT_MODELS": str(models), "KVCHAT_KV_BUDGET_MB": "3"}
    return subprocess.run([sys.executable, "-m", "kvchat.cli", "ask", *args, "--max-tokens", "8", "--threads", "1"],
                          capture_output=True, text=True, env=env, timeout=300)


def answer(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["text"].strip() and out["context_limit"] == 256 and out["context_tokens"] <= 256
    return out


def test_a_full_chat_names_the_ways_on_and_each_one_answers(tmp_path, smol_info, kvchat_home):
    models = smol_info.path.parent
    doc = tmp_path / "mill.txt"
    doc.write_text("The heron nests by the old mill, where the river runs past the stones. " * 9)
    r = ask(kvchat_home, models, "hi", "--new-chat", "all")
    assert r.returncode == 2 and r.stderr == "kvchat: error: --new-chat all goes on from a stored chat: give it --chat ID\n"

    first = answer(ask(kvchat_home, models, "Where does the heron nest?", "--doc", str(doc), "--json"))
    full_id = first["chat_id"]
    db = connect(kvchat_home / "kvchat.db")
    full = get_conversation(db, full_id)
    prefix = full.segments[0][1]

    r = ask(kvchat_home, models, LONG, "--chat", full_id)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    line = r.stderr.strip()
    assert line.startswith(f"kvchat: error: chat {full_id} is full: this turn needs ")
    assert f"the system prompt and documents are {prefix:,} of 256 tokens: the last turn" in line
    assert "--new-chat turns (the last turn, without the documents: " in line
    assert f"--new-chat documents (the documents alone: {prefix:,} of 256 tokens)" in line
    assert "--new-chat all" not in line
    assert [c.id for c in list_conversations(db)] == [full_id], "the error stored nothing"

    r = ask(kvchat_home, models, LONG, "--chat", full_id, "--new-chat", "turns", "--json")
    turns = answer(r)
    assert turns["continued_from"] == full_id and turns["chat_id"] != full_id
    assert (f"kvchat: note: chat {full_id} goes on in new chat {turns['chat_id']} with the last turn, without the "
            "documents") in r.stderr
    new = get_conversation(db, turns["chat_id"])
    assert new.settings["documents"] == [] and new.segments[0][1] < prefix
    assert [m.text for m in new.messages] == [m.text for m in full.messages] + [LONG, turns["text"]]
    assert new.token_ids[new.segments[0][1]:new.segments[2][1]] == full.token_ids[prefix:]  # the turn, as ids

    docs = answer(ask(kvchat_home, models, LONG, "--chat", full_id, "--new-chat", "documents", "--json"))
    new = get_conversation(db, docs["chat_id"])
    assert docs["chat_id"] not in (full_id, turns["chat_id"]) and new.settings["documents"] == ["mill.txt"]
    assert [m.text for m in new.messages] == [LONG, docs["text"]] and new.token_ids[:prefix] == full.token_ids[:prefix]
    assert docs["from_disk"] >= prefix - 16, "the documents' prefix comes back from its snapshot"

    more = answer(ask(kvchat_home, models, "Anything else?", "--chat", full_id, "--new-chat", "all", "--json"))
    new = get_conversation(db, more["chat_id"])
    assert new.settings["documents"] == ["mill.txt"] and new.token_ids[:len(full.token_ids)] == full.token_ids
    assert [m.text for m in new.messages] == [m.text for m in full.messages] + ["Anything else?", more["text"]]
    assert get_conversation(db, full_id).token_ids == full.token_ids, "the full chat stays as it was"
