"""One contract, three backends: the scripted FakeBackend, the RealBackend on SmolLM2-135M, and the
RemoteBackend on a real ``kvchat serve`` process running it.

Every check here runs against each, so the fake the UI tests rely on cannot
drift from the real engine. Real turns use ``max_tokens=8`` and a 1,024-token
pool to stay fast on CPU. The checks of what only a local engine has (document
prefill progress, snapshots here, carrying a chat over by its token counts) skip
the remote backend, saying why.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from server_helpers import API_KEY, Server

from kvchat.conversation.events import AttachStep, PrefillProgress, TokenBatch, TurnDone
from kvchat.conversation.views import AttachCancelled, ContextFullError
from kvchat.documents import DocumentError
from kvchat.engine.turn import SamplingParams
from kvchat.tui.fake_backend import FakeBackend
from kvchat.tui.remote_backend import RemoteBackend

POOL_BYTES = 12 * 2**20  # 64 blocks of SmolLM2-135M fp8 KV = 1,024 tokens of context
GS = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def real_backend(smol_info, tmp_path_factory):
    import torch

    from kvchat.tui.real_backend import RealBackend

    # module-scoped, so it runs before the per-test data dir: give it its own, never the user's
    mp = pytest.MonkeyPatch()
    mp.setenv("KVCHAT_HOME", str(tmp_path_factory.mktemp("contract-home")))
    torch.set_num_threads(1)
    backend = RealBackend(str(smol_info.path), "fp8", pool_bytes=POOL_BYTES, threads=1)
    backend.load(lambda event: None)
    yield backend
    backend.shutdown()
    mp.undo()


@pytest.fixture(scope="module")
def remote_backend(smol_info, tmp_path_factory):
    """A RemoteBackend on ``kvchat serve`` (its own data dir and key; the chats go to each test's data dir)."""
    server = Server(tmp_path_factory.mktemp("contract-serve") / "home", env={"KVCHAT_KV_BUDGET_MB": "12"}).start()
    mp = pytest.MonkeyPatch()
    mp.setenv("KVCHAT_HOME", str(tmp_path_factory.mktemp("contract-remote-home")))
    backend = RemoteBackend(server.url, API_KEY)
    backend.load(lambda event: None)
    yield backend
    backend.shutdown()
    mp.undo()
    server.stop()


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.model),
                        pytest.param("remote", marks=pytest.mark.model)])
def backend(request):
    if request.param in ("real", "remote"):
        return request.getfixturevalue(f"{request.param}_backend")
    fake = FakeBackend(context_limit=1024)
    fake.load(lambda event: None)
    return fake


def engine_only(backend, why: str) -> None:
    """Skip a check of what only a local engine has when ``backend`` is the remote one."""
    if isinstance(backend, RemoteBackend):
        pytest.skip(f"a chat held with a server: {why}")


def run(backend, text="Count from one to ten.", cancel=None, op="send"):
    """Call ``op`` and return (events, result)."""
    events = []
    cancel = cancel or threading.Event()
    if op == "send":
        done = backend.send(text, GS, cancel, events.append)
    elif op == "regenerate":
        done = backend.regenerate(GS, cancel, events.append)
    else:
        done = backend.edit_last(text, GS, cancel, events.append)
    return events, done


def test_status_after_load(backend):
    st = backend.status()
    assert st.phase == "ready" and st.model and st.device and st.kv_dtype == "fp8"
    assert st.pool_blocks_total > 0 and st.context_limit > 0
    assert st.pool_bytes > 0 or isinstance(backend, RemoteBackend), "kvchat serve's /health has no pool bytes"


def test_models_name_the_one_in_use_and_only_those_can_be_used(backend):
    st = backend.status()
    assert st.model in backend.models()
    assert backend.use_model(st.model).model == st.model
    with pytest.raises(LookupError):
        backend.use_model("no-such-model")
    assert backend.status().model == st.model


def test_send_streams_batches_then_one_done(backend):
    backend.new_chat(None, [], lambda e: None)
    events, done = run(backend)
    assert events[-1] is done and sum(isinstance(e, TurnDone) for e in events) == 1
    kinds = [type(e) for e in events[:-1]]
    assert set(kinds) <= {PrefillProgress, TokenBatch}
    assert kinds == sorted(kinds, key=lambda k: k is TokenBatch)  # progress, then batches
    assert "".join(e.text for e in events if isinstance(e, TokenBatch)) == done.text
    assert done.text and 1 <= done.stats.new_tokens <= GS.max_tokens
    assert done.stats.finish_reason in ("stop", "length")
    assert done.context_used >= done.stats.prompt_tokens + done.stats.new_tokens
    st = backend.status()
    assert st.context_used == done.context_used and st.last_ttft_ms == done.stats.ttft_ms > 0


def test_the_last_turn_figures_follow_the_open_chat(backend):
    """Status's TTFT and tokens/s are the open chat's last answer's: none in a new chat, a reopened chat's own."""
    backend.new_chat(None, [], lambda e: None)
    _, first = run(backend, "Name a fruit.")
    backend.new_chat(None, [], lambda e: None)
    st = backend.status()
    assert (st.last_ttft_ms, st.last_tokens_per_s) == (None, None)
    _, second = run(backend, "Name a tree.")
    view = backend.open_chat(first.chat_id)
    answer = view.messages[-1]
    st = backend.status()
    assert (st.last_ttft_ms, st.last_tokens_per_s) == (answer.ttft_ms, answer.tokens_per_s)
    assert st.last_ttft_ms == first.stats.ttft_ms
    assert backend.open_chat(second.chat_id).messages[-1].ttft_ms == backend.status().last_ttft_ms == second.stats.ttft_ms


def test_turn_is_stored_and_listed(backend):
    backend.new_chat(None, [], lambda e: None)
    _, done = run(backend, "Name a colour.\nSecond line")
    [row] = backend.list_chats()
    assert (row.id, row.title, row.num_messages) == (done.chat_id, "Name a colour.", 2)
    assert row.num_tokens == done.context_used
    assert backend.current().id == done.chat_id


def test_reopen_restores_messages_and_reports_resume(backend):
    backend.new_chat(None, [], lambda e: None)
    _, done = run(backend, "Name a fruit.")
    backend.new_chat(None, [], lambda e: None)
    assert backend.status().resume is None
    view = backend.open_chat(done.chat_id)
    assert [(m.role, m.text) for m in view.messages] == [("user", "Name a fruit."), ("assistant", done.text)]
    assert view.messages[1].finish_reason == done.stats.finish_reason in ("stop", "length")
    assert view.num_tokens == done.context_used == backend.status().context_used
    if isinstance(backend, RemoteBackend):  # opening reads no cache here: the next turn says what the server reused
        assert view.resume is None and backend.status().resume is None
        return
    assert view.resume is not None and 0 < view.resume.tokens <= view.num_tokens
    assert view.resume.source in ("memory", "disk") and backend.status().resume == view.resume


def test_second_turn_reuses_the_cached_history(backend):
    backend.new_chat(None, [], lambda e: None)
    _, first = run(backend, "Name a fruit.")
    _, second = run(backend, "Name another one.")
    assert second.stats.reused_tokens >= first.context_used - 16  # whole blocks of the history
    assert second.stats.prefilled_tokens < second.stats.prompt_tokens - first.context_used + 16


def test_regenerate_and_edit_replace_the_last_turn(backend):
    backend.new_chat(None, [], lambda e: None)
    run(backend, "Name a fruit.")
    _, regen = run(backend, op="regenerate")
    assert regen.stats.reused_tokens > 0
    _, edited = run(backend, "Name a vegetable.", op="edit")
    view = backend.current()
    assert [m.text for m in view.messages] == ["Name a vegetable.", edited.text]
    backend.new_chat(None, [], lambda e: None)
    stored = backend.open_chat(edited.chat_id)
    assert [m.text for m in stored.messages] == ["Name a vegetable.", edited.text]
    assert stored.num_tokens == edited.context_used


def test_cancel_ends_the_turn_and_keeps_it(backend):
    backend.new_chat(None, [], lambda e: None)
    cancel = threading.Event()
    cancel.set()
    _, done = run(backend, cancel=cancel)
    assert done.stats.finish_reason == "cancelled"
    assert backend.list_chats()[0].num_messages == 2
    backend.new_chat(None, [], lambda e: None)
    assert [m.finish_reason for m in backend.open_chat(done.chat_id).messages] == ["", "cancelled"]


def test_bad_input_raises_and_changes_nothing(backend, tmp_path):
    backend.new_chat(None, [], lambda e: None)
    used = backend.status().context_used
    with pytest.raises(ValueError):
        run(backend, "   ")
    limit = backend.status().context_limit
    with pytest.raises(ContextFullError) as info:
        run(backend, "word " * (limit + 10))
    assert info.value.limit == limit and info.value.needed > limit
    (tmp_path / "bin.txt").write_bytes(b"\0\1\2")
    for path in (tmp_path / "missing.txt", tmp_path / "bin.txt"):
        with pytest.raises(DocumentError):
            backend.new_chat(None, [str(path)], lambda e: None)
    assert backend.status().context_used == used and backend.list_chats() == []


def test_document_chat_prefills_with_progress_and_reuses_its_prefix(backend, tmp_path):
    engine_only(backend, "the server prefills documents at the first turn, with no progress here")
    doc = tmp_path / "notes.txt"
    doc.write_text(f"Notes {tmp_path.name}. " + "The blue heron nests near the old mill. " * 30)
    events = []
    view = backend.new_chat(None, [str(doc)], events.append)
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    assert view.documents == ["notes.txt"] and progress and progress[-1].done == progress[-1].total
    assert [d.title for d in backend.list_documents()] == ["notes.txt"]
    assert backend.list_documents()[0].tokens > 100 and backend.list_documents()[0].cached
    _, done = run(backend, "Where does the heron nest?")
    assert done.stats.reused_tokens >= progress[-1].total - 16
    again = []
    backend.new_chat(None, [str(doc)], again.append)
    # known: the prefix comes back whole (pool blocks, then its files' tail), nothing of it is prefilled
    assert max((e.total for e in again if isinstance(e, PrefillProgress)), default=0) < 16


def test_an_attach_says_each_step_from_its_first_moment(backend, tmp_path):
    engine_only(backend, "no tokenizing or prefill here")
    doc = tmp_path / "steps.txt"
    doc.write_text(f"Steps {tmp_path.name}. " + "The otter swims past the weir at dawn. " * 30)
    events = []
    backend.new_chat(None, [str(doc)], events.append)
    steps = [e.message.split()[0] for e in events if isinstance(e, AttachStep)]
    assert steps == ["reading", "tokenizing"] and all(isinstance(e, AttachStep) for e in events[:2])
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    assert progress[0].done == 0 and progress[0].total > 100, "prefilling 0 / N before the first chunk"
    assert progress[-1].done == progress[-1].total == progress[0].total


def test_a_cancelled_attach_keeps_nothing(backend, tmp_path):
    engine_only(backend, "no prefill here to cancel")
    backend.new_chat(None, [], lambda e: None)
    _, done = run(backend, "Name a fruit.")
    before = (backend.current(), backend.list_chats(), backend.list_documents(), backend.status().pool_blocks_used)
    doc = tmp_path / "long.txt"
    doc.write_text(f"Long {tmp_path.name}. " + "The kingfisher dives from the alder branch. " * 60)
    cancel = threading.Event()

    def emit(event):
        if isinstance(event, PrefillProgress) and event.done > 0:
            cancel.set()  # Esc after the first chunk: the prefill stops at the next step

    with pytest.raises(AttachCancelled):
        backend.new_chat(None, [str(doc)], emit, cancel)
    after = (backend.current(), backend.list_chats(), backend.list_documents(), backend.status().pool_blocks_used)
    assert after == before, "no document, no chat, the open chat and the pool's use as they were"
    assert [r.chat_id for r in backend.cache_report().rows] == [done.chat_id]


def test_rename_search_pin_delete(backend):
    backend.new_chat(None, [], lambda e: None)
    _, a = run(backend, "Tell me about zebras.")
    backend.new_chat(None, [], lambda e: None)
    _, b = run(backend, "Tell me about owls.")
    backend.rename_chat(a.chat_id, "Stripes [bold]")
    assert {r.id: r.title for r in backend.list_chats()}[a.chat_id] == "Stripes [bold]"
    assert [r.id for r in backend.list_chats("zebr")] == [a.chat_id]
    assert [r.id for r in backend.list_chats("stripes")] == [a.chat_id]
    assert backend.list_chats("platypus") == []
    backend.pin_chat(a.chat_id, True)
    assert backend.list_chats()[0].id == a.chat_id and backend.list_chats()[0].pinned
    assert {r.chat_id for r in backend.cache_report().rows} == {a.chat_id, b.chat_id}
    backend.delete_chat(b.chat_id)
    assert [r.id for r in backend.list_chats()] == [a.chat_id] and backend.current() is None
    with pytest.raises(LookupError):
        backend.open_chat(b.chat_id)


def test_turns_are_snapshotted_to_disk_and_purgeable(backend):
    engine_only(backend, "its KV snapshots are the server's")
    backend.new_chat(None, [], lambda e: None)
    _, done = run(backend, "Name a fruit.")
    [row] = backend.cache_report().rows
    assert row.chat_id == done.chat_id and row.disk_bytes > 0 and row.cache_state == "memory"
    assert row.num_tokens - 16 <= row.cached_tokens <= row.num_tokens, "a resume reuses the history, at most all of it"
    assert backend.cache_report().disk_bytes >= row.disk_bytes
    assert backend.purge_cache(done.chat_id) > 0
    assert backend.cache_report().rows[0].disk_bytes == 0


def test_continue_in_new_chat_carries_the_last_turns_that_fit(backend):
    engine_only(backend, "carrying turns needs their token counts")
    backend.new_chat(None, [], lambda e: None)
    _, first = run(backend, "Name a fruit.")
    _, last = run(backend, "Name a tree.")
    plan = backend.continuation("Name a bird.", GS.max_tokens)
    assert plan.limit == backend.status().context_limit and plan.room == plan.message + GS.max_tokens
    assert plan.offered() == ["all"] and plan.carried_turns("all") == len(plan.turns) == 2
    with pytest.raises(ContextFullError, match="no documents to leave out"):
        backend.continue_in_new_chat("turns", "Name a bird.", GS.max_tokens)
    assert len(backend.list_chats()) == 1, "a way that does not fit stores nothing"
    view = backend.continue_in_new_chat("all", "Name a bird.", GS.max_tokens)
    assert view.id not in (None, last.chat_id) and view.title.endswith("(continued)")
    assert [m.text for m in view.messages] == ["Name a fruit.", first.text, "Name a tree.", last.text]
    assert view.num_tokens == plan.tokens("all")
    _, done = run(backend, "Name a bird.")
    assert done.chat_id == view.id and len(backend.current().messages) == 6


def test_continue_without_the_documents_or_on_the_documents_alone(backend, tmp_path):
    engine_only(backend, "carrying turns needs their token counts")
    doc = tmp_path / "notes.txt"
    doc.write_text(f"Notes {tmp_path.name}. " + "The blue heron nests near the old mill. " * 10)
    backend.new_chat(None, [str(doc)], lambda e: None)
    _, first = run(backend, "Where does the heron nest?")
    plan = backend.continuation("And the mill?", GS.max_tokens)
    assert plan.documents == 1 and plan.turns == (first.context_used - plan.prefix,)
    turns = backend.continue_in_new_chat("turns", "And the mill?", GS.max_tokens)
    assert turns.documents == [] and [m.text for m in turns.messages] == ["Where does the heron nest?", first.text]
    assert turns.num_tokens == plan.tokens("turns") == plan.bare_prefix + plan.turns[0]
    _, done = run(backend, "And the mill?")
    assert done.chat_id == turns.id and len(backend.current().messages) == 4
    backend.open_chat(first.chat_id)
    docs = backend.continue_in_new_chat("documents", "And the mill?", GS.max_tokens)
    assert docs.documents == ["notes.txt"] and docs.messages == [] and docs.num_tokens == plan.prefix
    _, done = run(backend, "And the mill?")
    assert done.chat_id == docs.id and [m.text for m in backend.current().messages][0] == "And the mill?"
    # the prefix without the documents is the one a new chat without documents starts with
    assert backend.new_chat(None, [], lambda e: None).num_tokens == plan.bare_prefix


def test_system_prompt_only_before_the_first_turn(backend):
    backend.new_chat(None, [], lambda e: None)
    assert backend.set_system_prompt("Answer in one word.").system_prompt == "Answer in one word."
    run(backend, "Name a fruit.")
    with pytest.raises(ValueError):
        backend.set_system_prompt("Something else.")


def test_boundary_types_are_torch_free():
    """The UI shares the engine's dataclasses; importing them must not pull in torch."""
    code = "import sys, kvchat.engine.turn, kvchat.tui.backend, kvchat.conversation.events; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
