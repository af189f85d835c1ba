"""Pasted documents through ``kvchat serve`` (a real process, the real ``openai`` client): a long user message
(a document, then a question) and a long system message are recorded as document prefixes (``kvchat doc list``)
and reused in full by a new conversation repeating them with another question, from the pool and, after a
server restart, from disk."""

from __future__ import annotations

import pytest
from process_helpers import run_kvchat
from server_helpers import MODEL, Server
from transformers import AutoTokenizer

pytestmark = pytest.mark.model
SYSTEM = {"role": "system", "content": "You are a concise assistant."}
DOC = "\n\n".join(f"Section {i}. The river Alder passes mill {i * 7}; its miller keeps {i + 3} cats and a grain "
                  "ledger." for i in range(24))
MANUAL = "\n".join(f"Rule {i}: a lantern of colour {c} hangs at gate {i}, lit at {i % 12 + 1} o'clock."
                   for i, c in enumerate(["red", "green", "blue", "amber"] * 6))


def _ask(client, messages):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=3)


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _docs(home) -> dict[str, int]:
    """``kvchat doc list`` as {title: tokens}."""
    out = run_kvchat(home, "doc", "list")
    assert out.returncode == 0, out.stderr
    rows = [line.split(None, 3) for line in out.stdout.splitlines()[1:]]  # ID TOKENS CACHED TITLE
    return {title: int(tokens) for _, tokens, _, title in rows}


def test_pasted_documents_are_reused_in_full_across_conversations_and_restarts(tmp_path, smol_info, smol_dir):
    tok = AutoTokenizer.from_pretrained(smol_dir)
    home = tmp_path / "home"
    srv = Server(home).start()
    try:
        c = srv.client()
        first = _ask(c, [SYSTEM, _user(DOC + "\n\nWhat does the miller keep?")])
        on_manual = _ask(c, [{"role": "system", "content": MANUAL}, _user("Which gate has a red lantern?")])
        docs = _docs(home)
        assert len(docs) == 2, docs
        pasted = next(n for t, n in docs.items() if t.startswith("pasted: Section 0. The river Alder"))
        manual = next(n for t, n in docs.items() if t.startswith("system prompt: Rule 0: a lantern"))
        # the document part: the system prompt, the user turn's head and the document, not the question
        assert len(tok.encode(DOC)) < pasted <= first.usage.prompt_tokens - len(tok.encode(" What does the miller keep?"))
        assert len(tok.encode(MANUAL)) < manual < on_manual.usage.prompt_tokens
        # a new conversation pasting the same document with another question: the pool has it, block by block
        again = _ask(c, [SYSTEM, _user(DOC + "\n\nHow many cats live at mill 98?")])
        assert pasted - 16 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens - 8
    finally:
        srv.stop()

    srv = Server(home).start()  # a new process: nothing in memory, the documents' snapshots on disk
    try:
        c = srv.client()
        after = _ask(c, [SYSTEM, _user(DOC + "\n\nWhich mill is number 21? Answer in one line.")])
        k = after.model_extra["kvchat"]
        assert after.usage.prompt_tokens_details.cached_tokens >= pasted, k  # the whole document part, from its tail
        assert k["from_disk"] >= pasted - 1 and k["from_memory"] == 0, k
        manual_again = _ask(c, [{"role": "system", "content": MANUAL}, _user("What is lit at three o'clock?")])
        k = manual_again.model_extra["kvchat"]
        assert manual_again.usage.prompt_tokens_details.cached_tokens >= manual and k["from_disk"] > 0, k
    finally:
        srv.stop()
