"""A truncated chunk followed by a bit-flipped one in a chat's chain: the next ``ask --chat`` recomputes the
chat and rewrites both, so ``cache verify`` then finds nothing corrupt (the bad file does not stay on disk)."""

from __future__ import annotations

import json
import os
import sqlite3

import pytest
from process_helpers import run_kvchat

from kvchat.texts import stdlib_text

pytestmark = pytest.mark.model
PROMPT_CHARS = 4000  # about 900 tokens: a chain of three full chunks and a tail


def _chain_files(home, chat_id: str) -> list[str]:
    """The chat's chunk files, root first."""
    db = sqlite3.connect(home / "kvchat.db")
    rows = {r[0]: r[1:] for r in db.execute(
        "SELECT k.key, k.parent_key, k.file_path, k.token_count FROM chunk_refs r JOIN kv_chunks k ON k.key = r.key "
        "WHERE r.owner = ?", [chat_id])}
    children = {parent: key for key, (parent, _, n) in rows.items() if n == 256}
    files, key = [], children.get(None)
    while key is not None:
        files.append(str(home / "kv" / rows[key][1]))
        key = children.get(key)
    return files


def test_a_bad_chunk_after_a_truncated_one_is_rewritten_by_the_recompute(kvchat_home, smol_info):
    first = run_kvchat(kvchat_home, "ask", "Summarize: " + stdlib_text().text[:PROMPT_CHARS], "--max-tokens", "3",
                       "--json", "--threads", "1", timeout=300)
    assert first.returncode == 0, first.stderr
    chat_id = json.loads(first.stdout)["chat_id"]
    files = _chain_files(kvchat_home, chat_id)
    assert len(files) >= 3, files
    os.truncate(files[1], os.path.getsize(files[1]) // 2)
    with open(files[2], "r+b") as f:  # one flipped byte near the end (in the tensor data)
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    again = run_kvchat(kvchat_home, "ask", "And in one word?", "--chat", chat_id, "--max-tokens", "2", "--json",
                       "--threads", "1", timeout=300)
    assert again.returncode == 0, again.stderr
    assert "dropped" in json.loads(again.stdout)["miss_reason"]
    verify = run_kvchat(kvchat_home, "cache", "verify", timeout=300)
    assert verify.returncode == 0 and "; 0 corrupt chunk(s)" in verify.stdout, verify.stdout  # exit 1 when damaged
