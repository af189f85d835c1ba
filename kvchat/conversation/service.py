"""The store side of the open chat: new/open, turns (send, regenerate, edit), carry-over, counters.

A turn's checks, its commit or rollback, its snapshot and its pasted documents are here; the engine work
runs on the engine loop (:class:`kvchat.engine.loop.EngineLoop`), to which every turn is submitted as
steps. Called from one thread at a time: the TUI calls it on its loop's thread
(:meth:`~kvchat.engine.loop.EngineLoop.call`), the CLI from its main thread (which drives a loop without a
thread), the server's scheduler from its admit hook on the loop's thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from kvchat.context_fit import check_fits
from kvchat.conversation.continuation import ANSWER_ROOM_TOKENS, CarryWay, Continuation, answer_room
from kvchat.conversation.events import AttachStep, Emit, TurnDone
from kvchat.conversation.pasted import register_turn_documents
from kvchat.conversation.records import drop_orphaned_documents, new_settings, save_new_chat, save_turn, session_from_store
from kvchat.conversation.rewind import carry_over, turn_spans
from kvchat.conversation.streaming import PrefillTimer, TokenBatcher
from kvchat.conversation.titles import UNTITLED, chat_title
from kvchat.conversation.views import (
    SYSTEM_PROMPT_FIXED,
    AttachCancelled,
    ChatMessage,
    ChatView,
    ResumeInfo,
    Status,
    answer_figures,
)
from kvchat.documents import Document, doc_id, read_document
from kvchat.engine.cache_miss import shortfall_reason, why_not_restored
from kvchat.engine.disk_budget import Eviction, enforce, eviction_note
from kvchat.engine.loop import EngineLoop
from kvchat.engine.sequence import PrefillChunk
from kvchat.engine.session import DEFAULT_SYSTEM_PROMPT, Session
from kvchat.engine.shared_prompt import SharedPrompt
from kvchat.engine.token_rules import TokenRules
from kvchat.engine.turn import SamplingParams, TurnStats
from kvchat.free_space import check_turn_space
from kvchat.index import get_db
from kvchat.model.chat_format import UserTurn, append_segment
from kvchat.paths import data_dir
from kvchat.phase_trace import mark
from kvchat.runtime import Runtime
from kvchat.store.conversations import get_conversation, rewind_conversation
from kvchat.store.db import write_transaction
from kvchat.store.documents import upsert_document
from kvchat.store.errors import ConversationConflictError


@dataclass(slots=True)
class _Chat:
    session: Session
    chat_id: str | None
    title: str
    system: str
    settings: dict
    messages: list[ChatMessage] = field(default_factory=list)
    resume: ResumeInfo | None = None
    version: int = 0  # the stored token_ids_version the session's history matches
    lazy: bool = False  # opened without restoring: the next turn restores, and names any shortfall
    history: list[tuple[str, str]] = field(default_factory=list)  # (user, assistant) texts of a new chat's given turns

    @property
    def stored_len(self) -> int:
        """Tokens of the session before the next turn (during a redo: the cut the new turn replaces from)."""
        return len(self.session.token_ids)


def _resume(stats: TurnStats, ms: float, prefill: int = 0) -> ResumeInfo | None:
    """What reusing cached KV did (memory hits, then snapshot files) as a resume line; None if nothing was stored."""
    if stats.reused_tokens or stats.miss_reason:
        return ResumeInfo(stats.reused_tokens, stats.from_disk, ms, stats.miss_reason, prefill)
    return None


class ChatService:
    """The runtime, the engine loop its turns run on (and its snapshot store, ``KVPersist``), the one open
    chat, the last turn's counters, and the prefix ids of documents prefilled in this process."""

    def __init__(self, rt: Runtime, batch_interval_s: float = 0.04, loop: EngineLoop | None = None,
                 store: bool = True, branch_on_conflict: bool = False):
        """``batch_interval_s``: answer text is emitted at most this often (0: every piece, as a CLI streams).
        ``loop``: the engine loop its turns run on, owned by the caller (the TUI's, the server's: one service per
        request, one loop); None: a loop without a thread, driven by the calling thread, which :meth:`close`
        closes.
        ``store``: store turns and their snapshots (``kvchat serve --no-store``: False, nothing is written).
        ``branch_on_conflict``: a turn whose chat another process changed meanwhile is stored as a new chat
        (its history + the turn), as a resent history is (the server); else ConversationConflictError."""
        self.rt = rt
        self.store = store
        self.branch_on_conflict = branch_on_conflict
        self.batch_interval_s = batch_interval_s
        self.loop = loop or EngineLoop(rt.engine, thread=False)
        self._own_loop = loop is None
        self.persist = self.loop.persist
        self.chat: _Chat | None = None
        self.last: TurnStats | None = None
        self.doc_prefixes: dict[str, list[int]] = {}
        self._noted = Eviction()  # evictions already shown (see _eviction_note)
        self._stored = False  # a turn or a document was stored by this service

    def _eviction_note(self) -> str | None:
        """The disk budget's evictions since the current turn started, as one line (None below a few chunks)."""
        now, seen = self.persist.evicted, self._noted
        return eviction_note(Eviction(now.chunks - seen.chunks, now.bytes - seen.bytes, now.budget_bytes, now.budget_gb))

    def close(self) -> Eviction:
        """Flush queued snapshot writes (closing the engine loop this service made, and its writer thread),
        then evict down to the disk budget.

        Returns everything the budget evicted in this service's life.
        """
        if self._own_loop:
            self.loop.close()
        else:
            self.persist.flush()
        if not self._stored:  # nothing written: leave the data dir as it was (bad input creates no database)
            return self.persist.evicted
        try:
            return self.persist.evicted.then(enforce(get_db()))
        except Exception as exc:  # noqa: BLE001 - e.g. locked past the busy timeout: the turns are stored; say it
            self.persist.errors.append(f"disk budget not enforced: {exc}")
            return self.persist.evicted

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.rt.engine.spec.block_size

    def explain_miss(self, db, chat_id: str) -> str:
        """Why this engine cannot restore ``chat_id``'s stored KV (another KV dtype, nothing stored, …)."""
        return why_not_restored(db, chat_id, self.rt.engine.identity)

    def _shortfall(self, chat_id: str, history_tokens: int, reused_tokens: int) -> str | None:
        """:func:`kvchat.engine.cache_miss.shortfall_reason` for this engine."""
        return shortfall_reason(get_db(), chat_id, history_tokens, reused_tokens, self.rt.engine.identity)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token in the pool (K + V + scales, all layers)."""
        return self.rt.engine.spec.bytes_per_token

    def cached_tokens(self, token_ids: list[int]) -> int:
        """Leading tokens of ``token_ids`` whose KV blocks are in the pool's prefix cache (whole blocks)."""
        return len(self.rt.engine.blocks.match_prefix(token_ids)) * self.rt.engine.spec.block_size

    def cached_documents(self) -> set[str]:
        """Ids of documents whose prefix (default system prompt + document) is still cached."""
        bs = self.rt.engine.spec.block_size
        prefixes = list(self.doc_prefixes.items())  # a copy: the engine loop's thread may add one meanwhile
        return {d for d, ids in prefixes if self.cached_tokens(ids) >= len(ids) // bs * bs}

    def status(self) -> Status:
        e = self.rt.engine
        chat, errors = self.chat, self.persist.errors
        ttft_ms, tokens_per_s = answer_figures(chat.messages if chat else [])
        return Status(
            phase="ready", message=errors[-1] if errors else self._eviction_note() or "ready", model=self.rt.info.name,
            device=str(e.device),
            kv_dtype=e.spec.kv_dtype,
            pool_blocks_used=e.pool.num_blocks - e.blocks.num_free_blocks, pool_blocks_total=e.pool.num_blocks,
            pool_bytes=e.pool.nbytes, context_used=len(chat.session.token_ids) if chat else 0,
            context_limit=e.max_context, last_ttft_ms=ttft_ms, last_tokens_per_s=tokens_per_s,
            resume=chat.resume if chat else None,
        )

    def view(self) -> ChatView | None:
        c = self.chat
        if c is None:
            return None
        return ChatView(c.chat_id, c.title, c.system, list(c.settings.get("documents", [])), list(c.messages),
                        len(c.session.token_ids), self.rt.engine.max_context, c.resume)

    def _switch(self, chat: _Chat) -> ChatView:
        if self.chat is not None:
            self.chat.session.close()
        self.chat = chat
        return self.view()

    def forget(self, chat_id: str) -> None:
        """Close the open chat if it is ``chat_id`` (before it is deleted)."""
        if self.chat is not None and self.chat.chat_id == chat_id:
            self.chat.session.close()
            self.chat = None

    def renamed(self, chat_id: str, title: str) -> None:
        if self.chat is not None and self.chat.chat_id == chat_id:
            self.chat.title = title

    def new_chat(self, system: str | None, document_paths: Sequence[str], emit: Emit,
                 cancel: threading.Event | None = None) -> ChatView:
        """A new chat (stored at its first turn) on ``document_paths``, read and prefilled now; each step is
        emitted as it starts (:class:`AttachStep` reading and tokenizing, then :class:`PrefillProgress` from
        0). ``cancel`` set: the attach stops at its next step or prefill chunk, nothing of it is kept.

        Raises:
            kvchat.documents.DocumentError: a document cannot be read; ContextFullError: they do not fit;
            AttachCancelled: ``cancel`` was set.
        """
        if document_paths:
            emit(AttachStep(f"reading {len(document_paths)} file(s)"))
        return self.start_chat(system, [read_document(p) for p in document_paths], emit, cancel=cancel)

    def start_chat(self, system: str | None, docs: Sequence[Document], emit: Emit,
                   prefill_now: bool = True, cancel: threading.Event | None = None) -> ChatView:
        """A new chat on ``docs`` (already read). ``prefill_now``: prefill and register the documents' prefix
        now (the TUI shows its progress and resume line), else the first turn prefills it with its message.
        ``cancel``: as in :meth:`new_chat`; the open chat stays as it was.

        Raises:
            ContextFullError: the system prompt and documents alone fill the context.
            AttachCancelled: ``cancel`` was set before the documents were registered.
        """
        def check_cancel(*_: int) -> None:
            if cancel is not None and cancel.is_set():
                raise AttachCancelled("attach cancelled; nothing was stored")

        settings = new_settings([d.title for d in docs])
        system = DEFAULT_SYSTEM_PROMPT if system is None else system
        fmt = self.rt.chat_format(settings)
        if docs and prefill_now:
            check_cancel()
            emit(AttachStep(f"tokenizing {sum(len(d.text) for d in docs):,} characters"))
        session = Session.new(self.rt.engine, fmt, system, [(d.title, d.text) for d in docs], self.persist)
        limit = self.rt.engine.max_context
        if prefill_now:  # else the first turn's check says it
            check_fits(len(session.token_ids) + 1, limit, lambda: f"the documents are {len(session.token_ids):,} "
                       f"tokens with the system prompt; the context limit is {limit:,} tokens")
        resume = None
        if docs and prefill_now:
            t0, timer = time.perf_counter(), PrefillTimer(emit)

            def progress(done: int, total: int) -> None:
                check_cancel()  # between chunks: the blocks computed so far are released below
                timer(done, total)

            try:
                stats = self.loop.run(session.prefix_steps(progress), progress)
                check_cancel()
            except BaseException:
                session.close()
                raise
            resume = _resume(stats, (time.perf_counter() - t0) * 1e3 - stats.prefill_ms)
            doc_ids = self._register_documents(fmt, docs)
            self._stored = True
            session.save_snapshot(doc_ids[0])  # the documents' prefix outlives this chat
        return self._switch(_Chat(session, None, UNTITLED, system, settings, resume=resume))

    def _register_documents(self, fmt, docs: Sequence[Document]) -> list[str]:
        """Record attached documents in the ``documents`` table as ``kvchat doc add`` does; returns their ids.

        Id = ``kvchat.documents.doc_id`` of the text; ``token_count`` = the
        document's own prefix (default system prompt + the document), whose ids
        are kept in :attr:`doc_prefixes` for the sidebar's "cached" mark. A
        document's ``pinned`` flag survives re-attaching.
        """
        db, ids = get_db(), []
        for d in docs:
            did = doc_id(d.text)
            own = fmt.prefix_ids(DEFAULT_SYSTEM_PROMPT, [(d.title, d.text)])
            self.doc_prefixes[did] = own
            upsert_document(db, did, str(d.path.resolve()), d.title, len(own))
            ids.append(did)
        return ids

    def start_given_chat(self, system: str, settings: dict, history: Sequence[tuple[str, str, list[int]]],
                         user_turns: Sequence[UserTurn] = ()) -> ChatView:
        """A new chat (stored at its first turn) whose history was given, not generated here: an API client's
        earlier messages, ``(user text, assistant text, assistant ids)`` per turn; ``settings`` as from
        :func:`kvchat.conversation.records.new_settings`, the ones the ids were rendered with.

        The assistant ids are appended as given (the ids kvchat produced, when the caller mapped the text
        back to them), so the token list matches the cached prefix token-exactly. ``user_turns``: the user
        messages as already rendered with these settings (:func:`kvchat.server.prefix.render`), else here.
        """
        fmt = self.rt.chat_format(settings)
        session = Session.new(self.rt.engine, fmt, system, [], self.persist)
        messages = []
        for (user, text, ids), turn in zip(history, user_turns or [fmt.user_turn(u) for u, _, _ in history]):
            session.append_user(turn)
            append_segment(session.token_ids, session.segments, "assistant", ids)
            messages += [ChatMessage("user", user), ChatMessage("assistant", text)]
        title = chat_title(history[0][0]) if history else UNTITLED
        chat = _Chat(session, None, title, system, settings, messages, history=[(u, t) for u, t, _ in history])
        return self._switch(chat)

    def open_chat(self, chat_id: str, restore: bool = True) -> ChatView:
        """Open a stored chat. ``restore``: map its cached KV now (:attr:`ChatView.resume`), else the first
        turn does, and its stats say what it reused and why stored history was recomputed.

        Raises:
            ConversationNotFoundError: unknown id; ChatModelMismatchError: made with another model.
        """
        conv = get_conversation(get_db(), chat_id)
        session = session_from_store(self.rt, conv)
        session.persist = self.persist
        messages = [ChatMessage(m.role, m.text, m.ttft_ms, m.decode_tokens_per_s, m.finish_reason or "")
                    for m in conv.messages]
        if not restore:
            return self._switch(_Chat(session, conv.id, conv.title, conv.system_prompt or "", conv.settings,
                                      messages, None, conv.token_ids_version, lazy=True))
        stats, t0 = TurnStats(prompt_tokens=len(session.token_ids)), time.perf_counter()
        self.loop.call(session.attach_cached_prefix, stats, True)  # on the loop: it holds the inference mode
        ms = (time.perf_counter() - t0) * 1e3
        shortfall = self._shortfall(conv.id, len(session.token_ids), stats.reused_tokens)
        prefill = 0 if shortfall is None else max(len(session.token_ids) - stats.reused_tokens, 0)
        stats.miss_reason = stats.miss_reason or shortfall
        resume = _resume(stats, ms, prefill)
        chat = _Chat(session, conv.id, conv.title, conv.system_prompt or "", conv.settings, messages, resume,
                     conv.token_ids_version)
        return self._switch(chat)

    def _open(self) -> _Chat:
        if self.chat is None:
            raise LookupError("no chat is open")
        return self.chat

    def send(self, text: str, gs: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        return self._turn(self._open(), text, gs, cancel, emit, rewind=None)

    def regenerate(self, gs: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        chat = self._open()
        return self._redo(chat, chat.messages[-2].text if len(chat.messages) >= 2 else "", gs, cancel, emit)

    def edit_last(self, text: str, gs: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        return self._redo(self._open(), text, gs, cancel, emit)

    def _redo(self, chat: _Chat, text: str, gs: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        turns = turn_spans(chat.session.segments)
        if chat.chat_id is None or not turns:
            raise LookupError("this chat has no answer yet")
        cut, kept = turns[-1].start, len(chat.messages) - 2
        before = list(chat.session.token_ids)
        chat.session.truncate(cut)
        del chat.messages[kept:]
        try:
            done = self._turn(chat, text, gs, cancel, emit, rewind=(cut, kept))
        except BaseException:
            self.open_chat(chat.chat_id)  # the store still has the old turn: resync from it
            raise
        if self.store:  # a document the edit took out of its last chat (the chat's own references keep
            try:        # what it still uses, its queued save included)
                drop_orphaned_documents(get_db(), before)
            except Exception as exc:  # noqa: BLE001 - e.g. locked past the busy timeout: the turn is stored
                self.persist.errors.append(f"pasted document not released: {exc}")
        return done

    def send_steps(self, text: str, gs: SamplingParams, cancel: threading.Event, emit: Emit,
                   answer_text: Callable[[str], str] | None = None, user: UserTurn | None = None,
                   rules: TokenRules | None = None, shared: SharedPrompt | None = None):
        """:meth:`send` as steps for the engine loop (:meth:`kvchat.engine.loop.EngineLoop.submit`), for a
        caller that runs several chats at once: the generator returns the :class:`TurnDone`. Same checks,
        storing, rollback and order as :meth:`send`: the ``TurnDone`` is emitted as soon as the turn is
        stored, before the answer's recompute (``PrefillChunk(settle=True)`` steps) and its snapshot; the
        generator holds the chat's blocks until it ends. A failure after that point keeps the stored turn and
        goes to ``persist.errors``.

        ``answer_text(generated text)``: the answer's text as stored and returned (a server cuts it at a
        stop string, as its client saw it, and sets the turn's ``finish_reason`` for it); the ids stay those
        generated, so a resent history maps the text back to them (:mod:`kvchat.server.prefix`). ``user``:
        ``text`` already rendered as the open chat renders it
        (:meth:`kvchat.model.chat_format.ChatFormat.user_turn`), not tokenized again. ``rules``: the request's
        logit bias, grammar and log-probabilities (:class:`kvchat.engine.token_rules.TokenRules`); ``shared``: the
        prompt its other choices share (:class:`kvchat.engine.shared_prompt.SharedPrompt`)."""
        return self._turn_steps(self._open(), text, gs, cancel, emit, rewind=None, answer_text=answer_text, user=user,
                                rules=rules, shared=shared)

    def _turn(self, chat: _Chat, text: str, gs: SamplingParams, cancel: threading.Event, emit: Emit,
              rewind: tuple[int, int] | None) -> TurnDone:
        """One turn on the engine loop; returns once its recompute and snapshot are queued too."""
        return self.loop.run(self._turn_steps(chat, text, gs, cancel, emit, rewind), PrefillTimer(emit))

    def _turn_steps(self, chat: _Chat, text: str, gs: SamplingParams, cancel: threading.Event, emit: Emit,
                    rewind: tuple[int, int] | None, answer_text: Callable[[str], str] | None = None,
                    user: UserTurn | None = None, rules: TokenRules | None = None,
                    shared: SharedPrompt | None = None):
        session, stored = chat.session, chat.stored_len
        user = session.check_turn_fits(text, user)
        check_turn_space(data_dir(), session, len(user.ids), gs.max_tokens)
        self._noted = self.persist.evicted  # the status bar says only evictions newer than this turn
        try:
            batcher = TokenBatcher(emit, self.batch_interval_s)
            steps, reply, settle = session.turn(text, SamplingParams(**asdict(gs)), cancel, user, rules,
                                                       shared), None, None
            while True:
                try:
                    item = steps.send(reply)
                except StopIteration:
                    break
                if isinstance(item, str):
                    batcher.add(item)
                    reply = None
                elif isinstance(item, PrefillChunk) and item.settle:
                    settle = item  # the answer is complete: stored and answered before its recompute
                    break
                else:
                    reply = yield item
            batcher.flush()
            if answer_text is not None:
                session.last_turn.text = answer_text(session.last_turn.text)
            mark("generated")  # phases for fault-injection runs (KVCHAT_PHASE_TRACE), see kvchat.bench.crash_loop
            if chat.lazy:
                self._name_shortfall(chat, stored)
            first_turn = chat.chat_id is None
            if self.store:
                self._store_turn(chat, text, rewind, stored)
            chat.lazy = False
            mark("committed")
        except ConversationConflictError:  # another process changed the chat: show what is stored now
            session.truncate(stored)
            if rewind is None:
                self.open_chat(chat.chat_id, restore=not chat.lazy)
            raise
        except BaseException:  # not stored: the session goes back to the stored history (ids, blocks, meter)
            session.truncate(stored)
            raise
        turn = session.last_turn
        self.last = turn.stats
        chat.messages += [ChatMessage("user", text),
                          ChatMessage("assistant", turn.text, turn.stats.ttft_ms, turn.stats.decode_tokens_per_s,
                                      turn.stats.finish_reason)]
        done = TurnDone(chat.chat_id, turn.text, self.last, len(session.token_ids), self.rt.engine.max_context)
        emit(done)  # every front end: the answer is delivered, then its recompute, then its snapshot
        try:
            yield settle
            yield from steps
        except Exception as exc:  # noqa: BLE001 - the stored turn stays; the next prefill recomputes the rest
            self.persist.errors.append(f"answer stored, its recompute failed: {exc}")
        if self.store:
            session.save_snapshot(chat.chat_id)
            try:
                register_turn_documents(session, chat.system, bool(chat.settings.get("documents")), text,
                                        first_turn)
            except Exception as exc:  # noqa: BLE001 - e.g. locked past the busy timeout: the turn is stored; say it
                self.persist.errors.append(f"pasted document not recorded: {exc}")
        return done

    def _name_shortfall(self, chat: _Chat, stored: int) -> None:
        """After the first turn of a lazily opened chat: why stored history was recomputed, if it was."""
        stats = chat.session.last_turn.stats
        if stats.miss_reason is None:
            stats.miss_reason = self._shortfall(chat.chat_id, stored, stats.reused_tokens)

    def cache_document(self, doc: Document, system: str | None, emit: Emit) -> tuple[str, TurnStats, int]:
        """Prefill ``doc`` as a prefix (``system`` + the document) and snapshot it for new chats.

        Returns ``(document id, prefill stats, prefix tokens)``.

        Raises:
            ContextFullError: the prefix does not fit the context.
        """
        system = DEFAULT_SYSTEM_PROMPT if system is None else system
        fmt = self.rt.chat_format(new_settings([doc.title]))
        session = Session.new(self.rt.engine, fmt, system, [(doc.title, doc.text)], self.persist)
        self.rt.engine.check_fits(len(session.token_ids) + 1)
        try:
            timer = PrefillTimer(emit)
            stats = self.loop.run(session.prefix_steps(timer), timer)
            did = doc_id(doc.text)
            upsert_document(get_db(), did, str(doc.path.resolve()), doc.title, len(session.token_ids))
            self._stored = True
            session.save_snapshot(did)
        finally:
            session.close()
        return did, stats, len(session.token_ids)

    def _store_turn(self, chat: _Chat, text: str, rewind: tuple[int, int] | None, stored: int) -> None:
        """Commit the session's last turn onto the stored version it was computed on (a new chat: create it).

        Raises:
            ConversationConflictError: another process changed the chat meanwhile (and the service does not
                branch on conflict, or the turn rewrote the last one); nothing was stored.
            sqlite3.Error: the database could not take the turn; nothing was stored.
        """
        db = get_db()
        if chat.chat_id is None:
            self._store_new(db, chat, text)
            return
        try:
            with write_transaction(db):
                version = chat.version
                if rewind is not None:
                    version = rewind_conversation(db, chat.chat_id, *rewind, expected_version=version)
                version = save_turn(db, chat.chat_id, chat.session, text, stored, version)
        except ConversationConflictError:
            if not self.branch_on_conflict or rewind is not None:
                raise
            # the turn was computed on the history this chat had: keep it, in a new chat holding that history
            msgs = chat.messages
            chat.history = [(u.text, a.text) for u, a in zip(msgs[::2], msgs[1::2])]
            self._store_new(db, chat, text)
            return
        chat.version = version
        self._stored = True

    def _store_new(self, db, chat: _Chat, text: str) -> None:
        """Store the session as a new chat (its given history, then the last turn); sets its id, title, version."""
        saved = save_new_chat(db, self.rt, chat.session, chat.system, chat.settings, text, chat.history)
        chat.chat_id, chat.title, chat.version = saved.id, saved.title, saved.version
        self._stored = True

    def set_system_prompt(self, text: str) -> ChatView:
        chat = self._open()
        if chat.messages:
            raise ValueError(SYSTEM_PROMPT_FIXED)
        if chat.settings.get("documents"):
            raise ValueError("set the system prompt before attaching documents (they follow it in the cached prefix)")
        session = Session.new(self.rt.engine, chat.session.fmt, text, [], self.persist)
        return self._switch(_Chat(session, None, chat.title, text, chat.settings))

    def continuation(self, message: str, max_tokens: int) -> Continuation:
        """How the open stored chat can go on in a new chat (:mod:`kvchat.conversation.continuation`), keeping
        room for ``message`` (its rendered tokens; "" for none) and an answer of up to ``max_tokens``.

        Raises:
            LookupError: no chat is open, or it has no stored turns.
        """
        chat = self._open()
        if chat.chat_id is None:
            raise LookupError("this chat has no stored turns to carry")
        session, documents = chat.session, chat.settings.get("documents", [])
        segments = session.segments
        prefix = segments[0].end if segments and segments[0].kind == "prefix" else 0
        bare = len(session.fmt.prefix_ids(chat.system, [])) if documents else prefix
        turns = tuple(t.end - t.start for t in turn_spans(segments))
        pending = len(session.fmt.user_turn(message).ids) if message.strip() else 0
        return Continuation(chat.chat_id, self.rt.engine.max_context, prefix, bare, len(documents), turns, pending,
                            answer_room(max_tokens))

    def continue_in_new_chat(self, way: CarryWay, message: str = "", max_tokens: int = ANSWER_ROOM_TOKENS,
                             restore: bool = True) -> ChatView:
        """Store and open a new chat that goes on from the open one by ``way`` (:func:`continuation` with
        ``message`` and ``max_tokens`` decides what it carries); the old chat stays as it is. ``restore``: as
        :meth:`open_chat`'s.

        Raises:
            LookupError: no stored chat is open. ContextFullError: ``way`` does not fit (the line says why
                and names the ways that do); nothing was stored.
        """
        plan = self.continuation(message, max_tokens)
        if not plan.fits(way):
            raise plan.error(way)
        chat, db = self._open(), get_db()
        conv = get_conversation(db, plan.chat_id)
        prefix_ids, settings = None, None
        if way == "turns":  # the system prompt rendered alone, as a chat without documents starts
            prefix_ids = chat.session.fmt.prefix_ids(chat.system, [])
            settings = {**conv.settings, "documents": []}
        new_id, _ = carry_over(db, conv, plan.carried_turns(way), plan.limit - plan.room, prefix_ids, settings)
        self._stored = True
        self.chat = None  # close the old session first: its blocks stay cached for the new chat's shared prefix
        chat.session.close()
        return self.open_chat(new_id, restore)
