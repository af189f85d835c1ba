"""Persistent KV: a chat resumed in a fresh process restores its K/V from disk and answers exactly
as the uninterrupted process does; documents are reused across chats; identity misses when it must."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from turn_helpers import run_turn

from kvchat.conversation.records import new_settings
from kvchat.engine.persistence import CHUNK_TOKENS, chain
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.session import DEFAULT_SYSTEM_PROMPT, Session
from kvchat.runtime import load_runtime

DOC = (
    "The lighthouse keeper of Varn Island logged the weather every hour for thirty-one years. "
    "His notebooks record storms by the colour of the sea: green for a rising swell, grey for rain, "
    "and black for the nights when the lamp had to be tended without sleep. In 1911 a supply boat "
    "named Meridian was lost two miles north of the rocks, and the keeper wrote only one line: "
    "'No light could have saved her; the fog was inside the waves.' "
) * 6
QUESTIONS = ["Who kept the logbooks?", "What was lost in 1911?", "What colour meant rain?"]
MAX_TOKENS = 12


def run_cli(args: list[str], home: Path, models: Path) -> dict:
    env = {**os.environ, "KVCHAT_HOME": str(home), "KVCHAT_MODELS": str(models)}
    r = subprocess.run([sys.executable, "-m", "kvchat.cli", *args, "--json", "--max-tokens", str(MAX_TOKENS)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_resume_in_fresh_processes_is_exact(tmp_path, smol_info, kvchat_home):
    doc = tmp_path / "varn.txt"
    doc.write_text(DOC)
    models = smol_info.path.parent

    # the uninterrupted conversation, in this process
    rt = load_runtime(None, "fp8")
    session = Session.new(rt.engine, rt.chat_format(new_settings(["varn.txt"])), DEFAULT_SYSTEM_PROMPT, [("varn.txt", DOC)])
    uninterrupted = []
    for q in QUESTIONS:
        uninterrupted.append(run_turn(session, q, SamplingParams(max_tokens=MAX_TOKENS)).text)

    # the same conversation, one fresh process per turn
    first = run_cli(["ask", QUESTIONS[0], "--doc", str(doc)], kvchat_home, models)
    assert first["from_disk"] == 0 and first["prefilled_tokens"] == first["prompt_tokens"]
    answers, prev = [first["text"]], first
    for q in QUESTIONS[1:]:
        out = run_cli(["ask", q, "--chat", first["chat_id"]], kvchat_home, models)
        new_turn = out["prompt_tokens"] - prev["context_tokens"]
        assert out["from_memory"] == 0 and out["bytes_read"] > 0 and out["miss_reason"] is None
        assert out["from_disk"] + out["prefilled_tokens"] == out["prompt_tokens"]
        # only the new turn plus what the previous turn never ran through the model: its last
        # generated token and the closing ids (<|im_end|>\n when cut by --max-tokens: 3 at most)
        assert out["prefilled_tokens"] <= new_turn + 3, out
        answers.append(out["text"])
        prev = out
    assert answers == uninterrupted


def test_document_prefix_is_stored_once_and_reused_in_full(tmp_path, smol_info, kvchat_home):
    doc = tmp_path / "varn.txt"
    doc.write_text(DOC)
    models = smol_info.path.parent
    a = run_cli(["ask", QUESTIONS[0], "--doc", str(doc)], kvchat_home, models)
    b = run_cli(["ask", QUESTIONS[2], "--doc", str(doc)], kvchat_home, models)
    assert b["chat_id"] != a["chat_id"]
    prefix_tokens = a["prompt_tokens"] - _user_turn_tokens(QUESTIONS[0])
    assert b["from_disk"] == prefix_tokens, "the whole document prefix (full chunks + its tail) is reused"
    assert b["prefilled_tokens"] == b["prompt_tokens"] - prefix_tokens

    from kvchat.store.db import connect

    db = connect(kvchat_home / "kvchat.db")
    rows = list(db.query("SELECT key, token_count FROM kv_chunks"))
    assert len({r["key"] for r in rows}) == len(rows)
    shared = list(db.query("SELECT key FROM chunk_refs GROUP BY key HAVING count(*) = 2"))
    assert len(shared) == prefix_tokens // CHUNK_TOKENS + 1, "both chats reference the same prefix chunks"

    # `cache explain` finds the chain under the fingerprint the engine uses (scheme, calibration and all)
    env = {**os.environ, "KVCHAT_HOME": str(kvchat_home), "KVCHAT_MODELS": str(models)}
    r = subprocess.run([sys.executable, "-m", "kvchat.cli", "cache", "explain", b["chat_id"]],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    restorable = int(r.stdout.split("restorable from disk: ")[1].split()[0])
    assert restorable >= prefix_tokens, r.stdout


def _user_turn_tokens(text: str) -> int:
    rt = _user_turn_tokens.rt = getattr(_user_turn_tokens, "rt", None) or load_runtime(None, "fp8")
    return len(rt.chat_format().user_turn_ids(text))


def test_chain_keys_and_tails():
    ids = list(range(700))
    links = chain("f" * 32, ids, [300, 700])
    assert [(link.start, link.end) for link in links] == [(0, 256), (256, 512), (256, 300), (512, 700)]
    assert links[2].parent_key == links[0].key and links[3].parent_key == links[1].key
    other = chain("e" * 32, ids, [700])
    assert not {link.key for link in links} & {link.key for link in other}, "another cache fingerprint never shares keys"
