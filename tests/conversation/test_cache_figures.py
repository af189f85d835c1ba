"""One figure, one reading, in every view: ``kvchat doc list``, ``kvchat cache ls``/``stats`` and the F5 screen.

A real store (SQLite index, safetensors chunk files keyed as the engine keys them) holds a document pasted
into a chat's first message, as the engine saves it: the chain to the document's end, plus the tail at the
system prompt's end; the chat references the same chunks and more.
"""

from __future__ import annotations

import re

import pytest
from test_cache_resume_tokens import StoreReport, store_chain
from textual.widgets import DataTable, Static

from kvchat.cli.main import main
from kvchat.documents import PASTED_PATH
from kvchat.index import get_db
from kvchat.store.conversations import append_turn, create_conversation
from kvchat.store.documents import upsert_document
from kvchat.tui.app import KvchatApp

DOC = "d_5cc92d75b0"
SYSTEM_END, DOC_END, CHAT_TOKENS = 30, 741, 774  # the system prompt's end, the pasted document's, the chat's


@pytest.fixture
def store(monkeypatch) -> str:
    """The chat's id; the budget set, so its figure does not move with the machine's free disk."""
    monkeypatch.setenv("KVCHAT_CACHE_BUDGET_GB", "15.6")
    db = get_db()
    ids = list(range(5000, 5000 + CHAT_TOKENS))
    conv = create_conversation(db, title="Section 0. The river Alder")
    append_turn(db, conv.id, ids, [])
    store_chain(db, conv.id, ids, [SYSTEM_END, DOC_END, CHAT_TOKENS])
    upsert_document(db, DOC, PASTED_PATH, "pasted: Section 0. The river Alder", DOC_END)
    store_chain(db, DOC, ids[:DOC_END], [SYSTEM_END, DOC_END])
    return conv.id


def run(capsys, *argv: str) -> list[str]:
    assert main(list(argv)) == 0
    return capsys.readouterr().out.splitlines()


def test_doc_list_and_cache_ls_show_the_same_cached_tokens(store, capsys):
    docs = run(capsys, "doc", "list")
    assert docs[0].split() == ["ID", "TOKENS", "CACHED", "TITLE"]
    assert docs[1].split()[:3] == [DOC, str(DOC_END), str(DOC_END)]
    owners = {line.split()[0]: line.split()[1] for line in run(capsys, "cache", "ls")[1:]}
    assert owners == {DOC: str(DOC_END), store: str(CHAT_TOKENS)}, "the tails overlap: not their sum"


def test_doc_list_says_when_a_document_is_no_longer_cached(store, capsys):
    run(capsys, "cache", "purge", "--all")
    assert run(capsys, "doc", "list")[1].split()[:3] == [DOC, str(DOC_END), "none"]


def test_columns_line_up_for_chat_and_document_ids(store, capsys):
    for argv in (("cache", "ls"), ("doc", "list")):
        lines = run(capsys, *argv)
        second_column_ends = {re.match(r"\S+\s+\S+", line).end() for line in lines}
        assert len(second_column_ends) == 1 and len(lines) >= 2, lines


@pytest.mark.asyncio
async def test_the_cli_and_the_f5_screen_write_sizes_alike(store, capsys):
    stats = run(capsys, "cache", "stats")[0]
    disk, budget = re.match(r"chunks \d+, (.+) of a (.+) budget;", stats).groups()
    assert budget == "15.6 GB"
    size = {line.split()[0]: re.search(r"\d+\s+(\S+ \S+)\s{2}", line).group(1) for line in run(capsys, "cache", "ls")[1:]}
    app = KvchatApp(StoreReport())
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("f5")
        table = app.screen.query_one(DataTable)
        while table.row_count < 1:
            await pilot.pause(0.05)
        column = [str(c.label) for c in table.columns.values()].index("On disk")
        assert str(table.get_row(store)[column]) == size[store]
        totals = str(app.screen.query_one("#cache-totals", Static).render())
        assert f"disk: {disk} of {budget} budget" in totals, totals
