"""``kvchat ask --json`` counters when a restored snapshot chain is cut back to a chunk edge (README:
reused_tokens = from_memory + from_disk; the rest of the prompt is prefilled)."""

from __future__ import annotations

import json

import pytest
from process_helpers import run_kvchat

from kvchat.texts import stdlib_text

pytestmark = pytest.mark.model

DOC_CHARS = 3500  # about 800 tokens: the document's own snapshot ends inside the two-document prefix


def test_a_chain_cut_back_to_a_chunk_edge_counts_only_what_is_reused(tmp_path, smol_info, kvchat_home):
    paper = tmp_path / "paper.txt"
    paper.write_text(stdlib_text().text[:DOC_CHARS])
    added = run_kvchat(kvchat_home, "doc", "add", str(paper), "--threads", "1", timeout=300)
    assert added.returncode == 0, added.stderr
    asked = run_kvchat(kvchat_home, "ask", "hi", "--doc", str(paper), "--doc", str(paper), "--json", "--max-tokens", "1",
                       "--threads", "1", timeout=300)
    assert asked.returncode == 0, asked.stderr
    s = json.loads(asked.stdout)
    assert s["reused_tokens"] > 0, s  # the document's snapshot was reused up to a chunk edge
    assert s["reused_tokens"] == s["from_memory"] + s["from_disk"], s
    assert s["prefilled_tokens"] == s["prompt_tokens"] - s["reused_tokens"], s
