"""``kvchat serve --no-store`` writes nothing (docs/server.md): a resume from disk does not even stamp the chunks'
LRU time; and with ``stream_options.include_usage`` the last chunk carries the ``kvchat`` stats too."""

from __future__ import annotations

import sqlite3

import pytest
from server_helpers import MODEL, Server

pytestmark = pytest.mark.model
QUESTION = [{"role": "user", "content": "Name three colours, then explain why the sky is blue in two sentences."}]


def _rows(home) -> list[tuple]:
    db = sqlite3.connect(home / "kvchat.db")
    try:
        return db.execute("SELECT key, last_used, ref_count FROM kv_chunks ORDER BY key").fetchall() + \
            db.execute("SELECT count(*) FROM messages").fetchall()
    finally:
        db.close()


def test_no_store_resume_writes_nothing_and_the_last_chunk_has_the_stats(tmp_path, smol_info):
    home = tmp_path / "home"
    srv = Server(home, api_key=None).start()
    try:
        first = srv.client().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0)
    finally:
        srv.stop()
    before = _rows(home)
    srv = Server(home, "--no-store", api_key=None).start()
    try:
        follow = [*QUESTION, {"role": "assistant", "content": first.choices[0].message.content},
                  {"role": "user", "content": "Shorter?"}]
        chunks = list(srv.client().chat.completions.create(model=MODEL, messages=follow, max_tokens=2, temperature=0,
                                                          stream=True, stream_options={"include_usage": True}))
        srv.wait_idle()
    finally:
        srv.stop()
    last = chunks[-1]
    assert last.usage is not None and last.model_extra["kvchat"]["from_disk"] > 0, last  # restored from disk
    assert _rows(home) == before
