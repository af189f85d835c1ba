"""Conversations: turns stored atomically, token ids exact, clear errors, crash mid-transaction."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvchat.index import get_db
from kvchat.store.conversations import (
    NewMessage,
    append_turn,
    create_conversation,
    decode_token_ids,
    delete_conversation,
    encode_token_ids,
    get_conversation,
    list_conversations,
    pin_conversation,
    rename_conversation,
)
from kvchat.store.db import close_thread_dbs
from kvchat.store.errors import ConversationConflictError, ConversationNotFoundError


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    yield
    close_thread_dbs()


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300))
def test_token_ids_round_trip(ids):
    blob = encode_token_ids(ids)
    assert len(blob) == 4 * len(ids) and decode_token_ids(blob) == ids
    if ids:
        assert blob[:4] == ids[0].to_bytes(4, "little", signed=True)


def test_create_append_get():
    db = get_db()
    conv = create_conversation(db, title="t", model_fingerprint="fp", model_name="smol", system_prompt="be brief",
                               settings={"temperature": 0})
    assert conv.id.startswith("c_") and len(conv.id) == 8
    assert conv.token_ids == [] and conv.token_ids_version == 0 and conv.messages == []
    v1 = append_turn(db, conv.id, [1, 2, 3, 4, 5], [NewMessage("user", "hi", 2, 5)], segment_kind="prefix")
    v2 = append_turn(db, conv.id, [6, 7, 8], [NewMessage("user", "more", 0, 1),
                                              NewMessage("assistant", "ok", 1, 3, ttft_ms=12.5, decode_tokens_per_s=40.0)],
                     expected_version=v1)
    assert (v1, v2) == (1, 2)
    got = get_conversation(db, conv.id)
    assert got.token_ids == [1, 2, 3, 4, 5, 6, 7, 8] and got.token_ids_version == 2
    assert got.segments == [(0, 5, "prefix"), (5, 8, "turn")]
    assert [(m.idx, m.role, m.text, m.token_start, m.token_end) for m in got.messages] == [
        (0, "user", "hi", 2, 5), (1, "user", "more", 5, 6), (2, "assistant", "ok", 6, 8)]
    assert got.messages[2].ttft_ms == 12.5 and got.messages[2].decode_tokens_per_s == 40.0
    assert got.settings == {"temperature": 0} and got.system_prompt == "be brief" and got.updated >= got.created


def test_conflict_and_bad_span_write_nothing():
    db = get_db()
    cid = create_conversation(db).id
    append_turn(db, cid, [1], [])
    with pytest.raises(ConversationConflictError, match="stored version 1, this turn saw version 0"):
        append_turn(db, cid, [2], [NewMessage("user", "x", 0, 1)], expected_version=0)
    with pytest.raises(ValueError, match="outside"):
        append_turn(db, cid, [2], [NewMessage("user", "x", 0, 2)])
    got = get_conversation(db, cid)
    assert got.token_ids == [1] and got.messages == [] and got.token_ids_version == 1


def test_not_found_errors_are_clear():
    db = get_db()
    for call in (lambda: get_conversation(db, "c_nope"), lambda: append_turn(db, "c_nope", [1], []),
                 lambda: rename_conversation(db, "c_nope", "x"), lambda: delete_conversation(db, "c_nope"),
                 lambda: pin_conversation(db, "c_nope", True)):
        with pytest.raises(ConversationNotFoundError, match="no conversation with id 'c_nope'"):
            call()


def test_list_rename_pin_delete():
    db = get_db()
    a = create_conversation(db, title="a").id
    b = create_conversation(db, title="b").id
    append_turn(db, a, [1, 2], [NewMessage("user", "q", 0, 2)])
    assert [c.id for c in list_conversations(db)] == [a, b]  # a updated last
    pin_conversation(db, b, True)
    rename_conversation(db, a, "renamed")
    rows = list_conversations(db)
    assert [(c.id, c.title, c.pinned, c.num_tokens, c.num_messages) for c in rows] == [
        (b, "b", True, 0, 0), (a, "renamed", False, 2, 1)]
    assert [c.id for c in list_conversations(db, limit=1)] == [b]
    delete_conversation(db, a)
    assert [c.id for c in list_conversations(db)] == [b]
    assert db["messages"].count == 0
    assert db.execute("SELECT count(*) FROM messages_fts WHERE messages_fts MATCH 'q'").fetchone() == (0,)


def test_fts_indexes_titles_and_messages():
    db = get_db()
    cid = create_conversation(db, title="Paris trip").id
    append_turn(db, cid, [1, 2], [NewMessage("user", "what about the Louvre", 0, 2)])
    assert db.execute("SELECT title FROM conversations_fts WHERE conversations_fts MATCH 'paris'").fetchall() == [
        ("Paris trip",)]
    assert db.execute("SELECT text FROM messages_fts WHERE messages_fts MATCH 'louvre'").fetchall() == [
        ("what about the Louvre",)]


@pytest.mark.fault
def test_crash_inside_append_turn_keeps_previous_turn():
    db = get_db()
    cid = create_conversation(db, title="t").id
    append_turn(db, cid, [1, 2], [NewMessage("user", "first", 0, 2)])
    code = ("from kvchat.index import get_db; from kvchat.store.conversations import *; "
            f"append_turn(get_db(), {cid!r}, [3, 4], [NewMessage('user', 'second', 0, 2)])")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVCHAT_CRASH_AT": "message_insert"})
    assert proc.returncode == -9
    close_thread_dbs()
    db = get_db()
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    got = get_conversation(db, cid)
    assert got.token_ids == [1, 2] and [m.text for m in got.messages] == ["first"] and got.token_ids_version == 1
    append_turn(db, cid, [3], [NewMessage("user", "again", 0, 1)])
    assert get_conversation(db, cid).token_ids == [1, 2, 3]
