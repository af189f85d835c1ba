"""Pasted documents in the conversation layer: only a new chat's first user message, a document
then a question, gets a ``documents`` row; its chunks are written once (the chat's save), referenced by both
owners; a later turn's long message keeps its chunk edge in the chat's own snapshot but gets no row; the edge
is rebuilt when the chat is reopened and trimmed with the turn; deleting the last chat containing a pasted
document deletes its row and every chunk of its text. Real SmolLM2, real SQLite, real safetensors files."""

from __future__ import annotations

import threading

import pytest

from kvchat.conversation import listing
from kvchat.conversation.service import ChatService
from kvchat.engine import persistence
from kvchat.engine.persistence import chain
from kvchat.engine.turn import SamplingParams
from kvchat.index import get_db
from kvchat.paths import data_dir
from kvchat.runtime import load_runtime
from kvchat.store.chunk_index import totals
from kvchat.store.documents import list_documents, pin_document

pytestmark = pytest.mark.model
GS = SamplingParams(max_tokens=3, temperature=0)
DOC = "\n\n".join(f"Section {i}. The river Alder passes mill {i * 7}; its miller keeps {i + 3} cats and a grain "
                  "ledger." for i in range(24))


@pytest.fixture(scope="module")
def rt(smol_info):
    import torch

    torch.set_num_threads(1)
    return load_runtime(None, "fp8")


@pytest.fixture()
def service(rt, kvchat_home):
    s = ChatService(rt)
    yield s
    s.close()


def _send(service: ChatService, text: str):
    return service.send(text, GS, threading.Event(), lambda ev: None)


def _new(service: ChatService, *messages: str) -> str:
    service.start_chat(None, [], lambda ev: None)
    for m in messages:
        done = _send(service, m)
    service.persist.flush()
    return done.chat_id


def _chunk_files() -> list:
    return sorted(p for p in data_dir().rglob("*.safetensors"))


def test_a_pasted_document_is_written_once_and_deleted_with_the_last_chat_that_has_it(service, monkeypatch):
    reads = []
    read = persistence._read_tokens
    monkeypatch.setattr(persistence, "_read_tokens", lambda *a: reads.append(a[3:]) or read(*a))
    first = _new(service, DOC + "\n\nWhat does the miller keep?")
    db = get_db()
    (doc,) = list_documents(db)
    assert doc.title.startswith("pasted: Section 0. The river Alder") and doc.path == ""
    # every chunk was copied out of the pool once (the chat's save), none again for the document's owner
    assert len(reads) == len(set(reads)) == totals(db).count == len(_chunk_files())
    ids = service.chat.session.token_ids
    prefix_end = service.chat.session.segments[0].end  # the system prompt's tail is part of the document's prefix
    doc_keys = {link.key for link in chain(service.persist.fingerprint, ids, [prefix_end, doc.token_count])}
    refs = {r["key"] for r in db.query("SELECT key FROM chunk_refs WHERE owner = ?", [doc.id])}
    assert refs == doc_keys and len(doc_keys) >= 3  # its full chunk(s), the tails at the prompt's and its end

    second = _new(service, DOC + "\n\nHow many cats live at mill 98?")  # the same document: the same row
    assert [d.id for d in list_documents(db)] == [doc.id]
    listing.delete_chat(service, first)
    assert [d.id for d in list_documents(db)] == [doc.id]  # the other chat still has it
    listing.delete_chat(service, second)
    assert list_documents(db) == [] and totals(db).count == 0 and _chunk_files() == []


def test_a_pinned_pasted_document_outlives_its_chat(service):
    chat = _new(service, DOC + "\n\nWhat does the miller keep?")
    db = get_db()
    (doc,) = list_documents(db)
    pin_document(db, doc.id, True)
    listing.delete_chat(service, chat)
    assert [d.id for d in list_documents(db)] == [doc.id] and totals(db).count > 0


def test_a_long_message_in_a_later_turn_keeps_its_chunk_edge_but_gets_no_row(service, rt):
    chat = _new(service, "Hello", DOC + "\n\nWhat does the miller keep?", DOC.replace("\n\n", " "))
    ends = service.chat.session.sequence.document_ends  # turn 2: a document, then a question; turn 3: no break
    assert len(ends) == 2
    db = get_db()
    assert list_documents(db) == []
    # the chat's own snapshot has a tail at each document's end (a regenerate or edit restores up to it)
    tails = {r["token_count"] for r in db.query(
        "SELECT k.token_count FROM chunk_refs r JOIN kv_chunks k ON k.key = r.key WHERE r.owner = ?", [chat])}
    assert {e % persistence.CHUNK_TOKENS for e in ends} <= tails

    view = service.open_chat(chat)  # rebuilt from the stored text, as the turns were computed
    assert service.chat.session.sequence.document_ends == ends and view.resume.tokens > ends[-1]
    service.chat.session.truncate(ends[1] - 1)  # an edit of the last turn: its document end goes with it
    assert service.chat.session.sequence.document_ends == ends[:1]

    listing.delete_chat(service, chat)
    assert totals(db).count == 0 and _chunk_files() == []


def test_a_reopened_chat_takes_its_document_ends_from_the_store_and_an_old_row_from_its_text(service, monkeypatch):
    from kvchat.model.chat_format import ChatFormat

    chat = _new(service, "Hello", DOC + "\n\nWhat does the miller keep?", DOC.replace("\n\n", " "))
    ends = list(service.chat.session.sequence.document_ends)
    assert len(ends) == 2
    db = get_db()
    users = list(db.query("SELECT token_start, document_tokens FROM messages WHERE conversation_id = ? AND role = 'user'"
                          " ORDER BY idx", [chat]))
    assert [u["token_start"] + u["document_tokens"] for u in users if u["document_tokens"]] == ends
    assert users[0]["document_tokens"] == 0  # a short message: stored as having no document part

    rendered = []
    user_turn = ChatFormat.user_turn
    monkeypatch.setattr(ChatFormat, "user_turn", lambda self, text, *role: rendered.append(text) or user_turn(self, text, *role))
    service.open_chat(chat)
    assert service.chat.session.sequence.document_ends == ends and rendered == []  # no message tokenized again

    with db.conn:  # rows as a data dir from before the column holds them
        db.execute("UPDATE messages SET document_tokens = NULL WHERE conversation_id = ?", [chat])
    service.open_chat(chat)
    assert service.chat.session.sequence.document_ends == ends and len(rendered) == 2  # the two long ones, again


def test_a_message_is_tokenized_once_per_turn(service, monkeypatch):
    from kvchat.model.chat_format import ChatFormat
    from kvchat.server.prefix import render

    rendered = []
    user_turn = ChatFormat.user_turn
    monkeypatch.setattr(ChatFormat, "user_turn", lambda self, text, *role: rendered.append(text) or user_turn(self, text, *role))
    text = DOC + "\n\nWhat does the miller keep?"
    _new(service, text)
    assert rendered == [text]  # was twice: the fit check, then the turn
    settings = service.chat.settings
    fmt = service.rt.chat_format(settings)
    given = render(fmt, "You are terse.", [(text, "Cats.")], lambda ids, answer: None)
    rendered.clear()
    service.start_given_chat("You are terse.", settings, given.history, given.user_turns)
    assert rendered == [] and service.chat.session.token_ids == given.token_ids
    assert service.chat.session.sequence.document_ends  # the given turn's document end came with it


def test_editing_the_first_message_away_from_a_pasted_document_drops_it(service):
    _new(service, DOC + "\n\nWhat does the miller keep?")
    db = get_db()
    assert len(list_documents(db)) == 1
    service.edit_last("What does a miller keep?", GS, threading.Event(), lambda ev: None)
    service.persist.flush()
    assert list_documents(db) == []
    owners = {r["owner"] for r in db.query("SELECT DISTINCT owner FROM chunk_refs")}
    assert owners == {service.chat.chat_id}  # the chat's own chunks stay; the document's unshared ones went


def test_a_turn_rolled_back_takes_its_document_end_with_it(service):
    service.start_chat(None, [], lambda ev: None)
    session = service.chat.session

    class Stop(Exception):
        pass

    def stop(done: int, total: int) -> None:
        assert session.sequence.document_ends  # the turn's document end is a chunk edge of this prefill
        raise Stop

    with pytest.raises(Stop):
        service.loop.run(session.turn(DOC + "\n\nWhat does the miller keep?", GS), stop)
    assert session.sequence.document_ends == [] and len(session.token_ids) == session.segments[0].end
