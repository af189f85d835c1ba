"""Sidebar cache states and "why missed" on the real engine, for every chat, not only the open one.

Fast checks of :mod:`kvchat.conversation.cache_state` on a fresh store, then one run
of the real model across three processes' worth of backends: fp8 (write two
chats on a document), fp8 again after one chat's snapshot files were deleted
(open the intact chat, then the damaged one from the sidebar), and bf16.
"""

from __future__ import annotations

import time

import pytest
from textual.widgets import Input, ListView

from kvchat.conversation.cache_state import all_in_memory, disk_bytes
from kvchat.engine.cache_identity import CacheIdentity, cache_fingerprint
from kvchat.engine.cache_miss import why_not_restored
from kvchat.engine.turn import SamplingParams
from kvchat.index import get_db
from kvchat.store.db import write_transaction
from kvchat.tui.app import KvchatApp
from kvchat.tui.widgets.chat_input import ChatInput
from kvchat.tui.widgets.status_bar import StatusBar

pytestmark = pytest.mark.tui

SIZE = (120, 40)
MODEL_FP = "m" * 64


def add_chunk_row(db, key: str, fingerprint: str, owner: str, nbytes: int = 100) -> None:
    with write_transaction(db):
        db["kv_chunks"].insert({"key": key, "parent_key": None, "fingerprint": fingerprint, "token_count": 16,
                                "file_path": f"{key}.safetensors", "bytes": nbytes, "checksum": "x", "created": 0.0,
                                "last_used": 0.0, "pinned": 0, "ref_count": 1})
        db["chunk_refs"].insert({"owner": owner, "key": key})


def test_why_not_restored_names_the_cause():
    db = get_db()
    from kvchat.kernels.reference import SCALE_SCHEME

    fp8 = cache_fingerprint(MODEL_FP, "fp8", SCALE_SCHEME, 16)
    bf16 = cache_fingerprint(MODEL_FP, "bf16", "none", 16)
    bf16_run = CacheIdentity(MODEL_FP, "bf16", 16)
    assert bf16_run.fingerprint == bf16
    assert "no KV snapshot" in why_not_restored(db, "c_1", bf16_run)
    add_chunk_row(db, "k1", fp8, "c_1")
    add_chunk_row(db, "k2", "f" * 32, "c_2")
    add_chunk_row(db, "k3", bf16, "c_3", nbytes=7)
    assert "saved as fp8; this run uses bf16" in why_not_restored(db, "c_1", bf16_run)
    assert "another cache fingerprint" in why_not_restored(db, "c_2", bf16_run)
    assert "chain stops early" in why_not_restored(db, "c_3", bf16_run)
    assert disk_bytes(db, bf16) == {"c_3": 7} and disk_bytes(db) == {"c_1": 100, "c_2": 100, "c_3": 7}


def test_why_not_restored_names_the_other_int8_kernel():
    """int8 K/V made with the compiled kernel, resumed where it is off (KVCHAT_CPU_KERNEL=0, no compiler),
    and the other way round: the line names the kernel and the setting that restores it."""
    from kvchat.engine.cache_identity import weight_scheme

    db = get_db()
    by_kernel = {k: cache_fingerprint(MODEL_FP, "bf16", "none", 16, weights=weight_scheme("int8", k))
                 for k in ("avx2", "int8mm")}
    runs = {k: CacheIdentity(MODEL_FP, "bf16", 16, "int8", int8_kernel=k) for k in by_kernel}
    assert {k: run.fingerprint for k, run in runs.items()} == by_kernel
    add_chunk_row(db, "k1", by_kernel["avx2"], "c_1")
    add_chunk_row(db, "k2", by_kernel["int8mm"], "c_2")
    off = why_not_restored(db, "c_1", runs["int8mm"])
    assert off == ("its KV was computed with the compiled int8 kernel; this run uses torch's int8 kernel "
                   "(KVCHAT_CPU_KERNEL=1 and a C compiler restore it)")
    on = why_not_restored(db, "c_2", runs["avx2"])
    assert "computed with torch's int8 kernel" in on and "KVCHAT_CPU_KERNEL=0 restores it" in on
    assert "chain stops early" in why_not_restored(db, "c_1", runs["avx2"])


def test_a_chain_cut_by_turns_under_another_weight_format_names_the_format():
    """A chat whose first turn was stored with int8 weights and its next with int4, resumed with int8: the
    chain stops where the int4 turns begin, and the line says so rather than blaming eviction."""
    db = get_db()
    int8_run = CacheIdentity(MODEL_FP, "fp8", 16, "int8", int8_kernel="avx2")
    add_chunk_row(db, "k1", int8_run.fingerprint, "c_1")
    add_chunk_row(db, "k2", CacheIdentity(MODEL_FP, "fp8", 16, "int4").fingerprint, "c_1")
    assert why_not_restored(db, "c_1", int8_run) == (
        "its snapshot chain stops early: other turns' KV was saved with int4 weights; this run uses int8 "
        "(--weights int4 restores it)")
    add_chunk_row(db, "k3", int8_run.fingerprint, "c_2")
    add_chunk_row(db, "k4", CacheIdentity(MODEL_FP, "bf16", 16, "int8", int8_kernel="avx2").fingerprint, "c_2")
    assert why_not_restored(db, "c_2", int8_run) == (
        "its snapshot chain stops early: other turns' KV was saved as bf16; this run uses fp8 "
        "(caches never cross KV dtypes)")
    add_chunk_row(db, "k5", int8_run.fingerprint, "c_3")
    add_chunk_row(db, "k6", "f" * 32, "c_3")
    assert "another model, scale scheme or kvchat version" in why_not_restored(db, "c_3", int8_run)


def test_a_shared_system_prompt_block_does_not_make_a_chat_in_memory():
    assert not all_in_memory(16, 120, 16)  # only the first block (the system prompt) is cached
    assert all_in_memory(112, 120, 16) and all_in_memory(48, 51, 16)
    assert not all_in_memory(0, 10, 16)


async def until(pilot, condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await pilot.pause(0.05)


def rows(screen, list_id: str) -> dict[str, str]:
    """Sidebar rows of ``#chats`` / ``#documents``: item name (chat id or document path) -> text."""
    items = screen.query_one(list_id, ListView).children
    return {item.name: "".join(str(label.render()) for label in item.query("Label")) for item in items}


async def send(pilot, screen, text: str) -> None:
    view_len = len(screen.query("MessageBlock"))
    await pilot.click(ChatInput)
    screen.query_one(ChatInput).text = text
    await pilot.press("enter")
    await until(pilot, lambda: not screen.generating and len(screen.query("MessageBlock")) >= view_len + 2)


async def choose_chat(pilot, screen, chat_id: str) -> None:
    ids = list(rows(screen, "#chats"))
    chats = screen.query_one("#chats", ListView)
    chats.focus()
    await until(pilot, lambda: chats.has_focus)  # focus() lands later: an earlier Enter goes to the chat input
    chats.index = ids.index(chat_id)
    await pilot.press("enter")
    await until(pilot, lambda: screen.backend.current() is not None and screen.backend.current().id == chat_id
                and not screen.workers)


def real_app(smol_info, kv_dtype: str = "fp8"):
    from kvchat.tui.real_backend import RealBackend

    backend = RealBackend(str(smol_info.path), kv_dtype, pool_bytes=12 * 2**20, threads=1)
    return backend, KvchatApp(backend)


@pytest.mark.asyncio
async def test_real_sidebar_states_and_why_missed_for_a_chat_opened_after_another(smol_info, tmp_path):
    import torch

    torch.set_num_threads(1)
    doc = tmp_path / "heron.txt"
    doc.write_text("The grey heron nests in the old mill by the river. " * 8)

    backend, app = real_app(smol_info)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen_stack[0]
        await until(pilot, lambda: screen.ready, timeout=120)
        screen.settings = SamplingParams(max_tokens=6)
        await pilot.press("ctrl+o")
        app.screen.query_one(Input).value = str(doc)
        await pilot.press("enter")
        await until(pilot, lambda: len(rows(screen, "#documents")) == 1 and "".join(rows(screen, "#documents").values()))
        assert "● cached in memory" in next(iter(rows(screen, "#documents").values()))
        await send(pilot, screen, "Where does the heron nest?")
        chat_a = backend.current().id
        await pilot.press("ctrl+n")
        await send(pilot, screen, "Name a colour.")
        chat_b = backend.current().id
        await until(pilot, lambda: set(rows(screen, "#chats")) == {chat_a, chat_b})
        await pilot.press("ctrl+q")
        await until(pilot, lambda: app._shut_down)

    db = get_db()
    only_b = [r["file_path"] for r in db.query(
        "SELECT k.file_path FROM chunk_refs r JOIN kv_chunks k ON k.key = r.key WHERE r.owner = ?"
        " AND r.key NOT IN (SELECT key FROM chunk_refs WHERE owner != ?)", [chat_b, chat_b])]
    assert only_b, "chat B has snapshot chunks of its own"
    from kvchat.index import kv_dir

    for path in only_b:
        (kv_dir() / path).unlink()

    backend, app = real_app(smol_info)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen_stack[0]
        await until(pilot, lambda: screen.ready, timeout=120)
        await until(pilot, lambda: "◐ cached on disk" in "".join(rows(screen, "#documents").values()))
        # nothing in memory in a new process (waited for: a second sidebar refresh may be redrawing the rows)
        await until(pilot, lambda: all("◐ disk" in rows(screen, "#chats").get(c, "") for c in (chat_a, chat_b)))
        await choose_chat(pilot, screen, chat_a)
        status = str(screen.query_one(StatusBar).render())
        assert "from disk" in status and "prefill skipped" in status
        await until(pilot, lambda: "● mem" in rows(screen, "#chats")[chat_a] and rows(screen, "#chats")[chat_b])
        assert "◐ disk" in rows(screen, "#chats")[chat_b]  # sharing the system prompt's block is not enough
        await choose_chat(pilot, screen, chat_b)  # a chat opened after another one
        status = str(screen.query_one(StatusBar).render()).split("\n")[1]
        resume = backend.status().resume
        assert resume.from_disk == 0 and resume.prefill > 0 and "missing chunk" in resume.miss_reason
        assert "missing chunk" in status and "prefill skipped" not in status
        await pilot.press("ctrl+q")
        await until(pilot, lambda: app._shut_down)

    from kvchat.tui.real_backend import RealBackend

    other = RealBackend(str(smol_info.path), "bf16", pool_bytes=12 * 2**20, threads=1)
    try:
        other.load(lambda e: None)
        assert {c.id: c.cache_state for c in other.list_chats()} == {chat_a: "none", chat_b: "none"}
        assert [d.cache_state for d in other.list_documents()] == ["none"]
        view = other.open_chat(chat_a)
        assert view.resume.from_disk == 0 and "saved as fp8; this run uses bf16" in view.resume.miss_reason
        assert "saved as fp8; this run uses bf16" in view.resume.line
        report = {r.chat_id: r.miss_reason for r in other.cache_report().rows}
        assert "saved as fp8" in report[chat_b]  # explained for a chat that is not open too
    finally:
        other.shutdown()
