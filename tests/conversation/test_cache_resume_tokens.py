"""``kvchat cache ls`` TOKENS and the F5 screen's Cached column: the tokens a resume restores.

A real store (SQLite index, safetensors chunk files keyed as the engine keys
them) holds chats whose chains end at segment ends, one with a chunk gone,
one stored under another cache fingerprint, and a document. A chat's
referenced chunks overlap (the system prompt's tail and the conversation's
tail both start at token 0), so their sum is not what a resume restores: the
chain that matches the chat's token ids (all of them when it covers the history: opening a chat restores
it whole).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from textual.widgets import DataTable

from kvchat.cli.main import main
from kvchat.conversation import listing
from kvchat.engine.persistence import chain
from kvchat.index import get_db
from kvchat.store.chunk_index import add_chunk, delete_chunk, ref_chunks
from kvchat.store.conversations import append_turn, create_conversation
from kvchat.store.db import write_transaction
from kvchat.store.snapshot import ChunkData
from kvchat.tui.app import KvchatApp
from kvchat.tui.fake_backend import FakeBackend

FP = "a" * 32  # the running engine's cache fingerprint
OTHER_FP = "b" * 32  # another KV dtype's
IN_POOL = 32  # the system prompt's two blocks, cached in the pool for another chat


def store_chain(db, owner: str, token_ids: list[int], ends: list[int], fingerprint: str = FP) -> list[str]:
    """Write the chunks the engine would save for ``token_ids`` computed up to ``ends`` and reference them."""
    keys = []
    for link in chain(fingerprint, token_ids, ends):
        n = link.end - link.start
        data = ChunkData(torch.zeros(1, n, 1, 8, dtype=torch.float16), torch.zeros(1, n, 1, 8, dtype=torch.float16))
        add_chunk(db, data, key=link.key, parent_key=link.parent_key, fingerprint=fingerprint)
        keys.append(link.key)
    with write_transaction(db):
        db["chunk_refs"].insert_all([{"owner": owner, "key": k} for k in keys])
    ref_chunks(db, keys)
    return keys


def stored_chat(db, title: str, first: int, n: int, ends: list[int], fingerprint: str = FP) -> tuple[str, list[str]]:
    """A chat of token ids ``first..first+n`` with its chain stored; returns its id and chunk keys."""
    conv = create_conversation(db, title=title)
    ids = list(range(first, first + n))
    append_turn(db, conv.id, ids, [])
    return conv.id, store_chain(db, conv.id, ids, ends, fingerprint)


@pytest.fixture
def chats() -> dict[str, tuple[str, int]]:
    """Chat title -> (id, the tokens a resume restores)."""
    db = get_db()
    short, _ = stored_chat(db, "short", 1000, 71, [30, 70])  # system prompt tail + the turn's tail: 100 chunk tokens
    full, _ = stored_chat(db, "full", 2000, 600, [40, 600])  # chain covers every token: all restored
    broken, keys = stored_chat(db, "broken", 3000, 600, [40, 590])
    delete_chunk(db, keys[1])  # the second full chunk evicted: the chain stops at 256
    other, _ = stored_chat(db, "other dtype", 4000, 301, [300], OTHER_FP)
    store_chain(db, "d_0123456789", list(range(50)), [50])
    return {"short": (short, 70), "full": (full, 600), "broken": (broken, 256), "other dtype": (other, 300)}


def test_cache_ls_tokens_are_what_a_resume_restores(chats, capsys):
    assert main(["cache", "ls"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    tokens = {line.split()[0]: int(line.split()[1]) for line in lines}
    assert tokens == {cid: n for cid, n in chats.values()} | {"d_0123456789": 50}


def test_cache_screen_counts_pool_or_disk_under_the_engines_fingerprint(chats):
    before_load = {r.chat_id: r.cached_tokens for r in listing.cache_report(None).rows}
    assert before_load == {cid: n for cid, n in chats.values()}, "before load, any stored fingerprint counts"
    engine = SimpleNamespace(persist=SimpleNamespace(fingerprint=FP, flush=lambda: None), block_size=16,
                             cached_tokens=lambda ids: IN_POOL, bytes_per_token=10, chat=None,
                             explain_miss=lambda db, chat_id: "saved as another KV dtype")
    rows = {r.chat_id: r for r in listing.cache_report(engine).rows}
    assert {cid: rows[cid].cached_tokens for cid, _ in chats.values()} == {
        cid: IN_POOL if title == "other dtype" else n for title, (cid, n) in chats.items()}
    assert all(r.memory_bytes == IN_POOL * 10 for r in rows.values())


class StoreReport(FakeBackend):
    """The fake engine, with the real store's cache report (before load)."""

    def cache_report(self):
        return listing.cache_report(None)


@pytest.mark.asyncio
async def test_f5_shows_the_resume_tokens(chats):
    app = KvchatApp(StoreReport())
    async with app.run_test(size=(140, 40)) as pilot:
        await pilot.press("f5")
        table = app.screen.query_one(DataTable)
        while table.row_count < len(chats):
            await pilot.pause(0.05)
        column = [str(c.label) for c in table.columns.values()].index("Cached")
        shown = {str(table.get_row(cid)[0]): str(table.get_row(cid)[column]) for cid, _ in chats.values()}
        assert shown == {title: str(n) for title, (_, n) in chats.items()}
