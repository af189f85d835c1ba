"""A scripted, instant, deterministic :class:`kvchat.tui.backend.Backend` for fast UI tests (no torch).

Tokens are counted as words (``\\w+`` runs and punctuation marks) plus
``TURN_OVERHEAD`` per message; answers come from ``answers`` in order, then
``"You said: <text>"``. ``hold_after`` pauses a stream after that many pieces
until ``cancel`` is set, so a test can press Esc mid-answer deterministically.
``import_steps`` scripts a first-run model import in :meth:`FakeBackend.load`
(one ``LoadProgress`` per step); with ``step_gate`` each step waits for one
``release()`` before the next (or the load) goes on, so a test can look at every step.
``prefill_gate`` holds a document attach open (after its "prefilling 0 / N" event) until the gate is set
or the attach's ``cancel`` is, so a test can act while a document prefills.
``model_names``: the models :meth:`FakeBackend.use_model` switches between (the status names the one in use).
The contract suite (``tests/tui/test_tui_backend_contract.py``) runs the same
checks against this and the real backend.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from kvchat.conversation.continuation import CarryWay, Continuation, answer_room
from kvchat.conversation.events import AttachStep, Emit, LoadProgress, PrefillProgress, TurnDone
from kvchat.conversation.streaming import TokenBatcher
from kvchat.conversation.views import (
    SYSTEM_PROMPT_FIXED,
    AttachCancelled,
    CacheReport,
    CacheRow,
    ChatMessage,
    ChatSummary,
    ChatView,
    ContextFullError,
    DocumentSummary,
    ResumeInfo,
    Status,
    answer_figures,
)
from kvchat.documents import read_document
from kvchat.engine.turn import SamplingParams, TurnStats

TURN_OVERHEAD = 4
BLOCK_SIZE = 16
CHUNK_TOKENS = 256
BYTES_PER_TOKEN = 12_240
POOL_BLOCKS = 1024
DEFAULT_SYSTEM = "You are a helpful assistant."


def count_tokens(text: str) -> int:
    """Fake token count: words and punctuation marks."""
    return len(re.findall(r"\w+|[^\w\s]", text))


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


@dataclass(slots=True)
class _Chat:
    id: str | None
    title: str
    system: str
    documents: list[str]
    prefix_tokens: int
    messages: list[ChatMessage] = field(default_factory=list)
    turn_tokens: list[int] = field(default_factory=list)
    pinned: bool = False
    disk_tokens: int = 0  # "snapshot" written after each turn
    order: int = 0  # last use, as a counter (deterministic sort)
    updated: float = 0.0  # last use, Unix seconds (display)

    @property
    def num_tokens(self) -> int:
        return self.prefix_tokens + sum(self.turn_tokens)


class FakeBackend:
    """Scripted backend; see the module docstring. ``context_limit`` is in (fake) tokens."""

    def __init__(self, answers: Sequence[str] = (), context_limit: int = 4096, hold_after: int | None = None,
                 import_steps: Sequence[str] = (), step_gate: threading.Semaphore | None = None,
                 prefill_gate: threading.Event | None = None, model_names: Sequence[str] = ("fake-model",)):
        self.answers = list(answers)
        self.model_names = tuple(model_names)
        self.model = self.model_names[0]
        self.import_steps = list(import_steps)
        self.step_gate = step_gate
        self.context_limit = context_limit
        self.hold_after = hold_after
        self.prefill_gate = prefill_gate
        self.chats: dict[str, _Chat] = {}
        self.documents: dict[str, DocumentSummary] = {}
        self.chat: _Chat | None = None
        self.loaded = False
        self.shutdown_called = False
        self._resume: ResumeInfo | None = None
        self._prefilled: set[tuple[str, ...]] = set()
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)

    def load(self, emit: Emit) -> Status:
        for i, text in enumerate(self.import_steps):
            emit(LoadProgress(f"first run: importing fake-model — {text}", i, len(self.import_steps)))
            if self.step_gate is not None and not self.step_gate.acquire(timeout=10):
                raise TimeoutError("the scripted import was never released")
        emit(LoadProgress("loading weights"))
        self.loaded = True
        return self.status()

    def status(self) -> Status:
        if not self.loaded:
            return Status(phase="loading", message="starting")
        used = self.chat.num_tokens if self.chat else 0
        ttft_ms, tokens_per_s = answer_figures(self.chat.messages if self.chat else [])
        return Status("ready", "ready", self.model, "cpu", "fp8", -(-used // BLOCK_SIZE), POOL_BLOCKS,
                      POOL_BLOCKS * BLOCK_SIZE * BYTES_PER_TOKEN, used, self.context_limit, ttft_ms,
                      tokens_per_s, self._resume if self.chat else None)

    def models(self) -> list[str]:
        return list(self.model_names) if self.loaded else []

    def use_model(self, name: str) -> Status:
        if name not in self.models():
            raise LookupError(f"no model {name!r} here (only {', '.join(self.model_names)})")
        self.model = name
        return self.status()

    def current(self) -> ChatView | None:
        c = self.chat
        if c is None:
            return None
        return ChatView(c.id, c.title, c.system, list(c.documents), list(c.messages), c.num_tokens, self.context_limit,
                        self._resume)

    def list_chats(self, query: str = "") -> list[ChatSummary]:
        rows = sorted(self.chats.values(), key=lambda c: (not c.pinned, -c.order))
        if query.strip():
            rows = [c for c in rows if self._matches(c, _words(query))]
        return [ChatSummary(c.id, c.title, c.updated, c.num_tokens, len(c.messages), c.pinned, "memory",
                            c.num_tokens // BLOCK_SIZE * BLOCK_SIZE) for c in rows]

    @staticmethod
    def _matches(chat: _Chat, query: list[str]) -> bool:
        for text in [chat.title] + [m.text for m in chat.messages]:
            words = _words(text)
            if all(any(w.startswith(q) for w in words) for q in query):
                return True
        return False

    def list_documents(self) -> list[DocumentSummary]:
        return list(reversed(self.documents.values()))

    def new_chat(self, system: str | None, document_paths: Sequence[str], emit: Emit,
                 cancel: threading.Event | None = None) -> ChatView:
        def check_cancel() -> None:
            if cancel is not None and cancel.is_set():
                raise AttachCancelled("attach cancelled; nothing was stored")

        if document_paths:
            emit(AttachStep(f"reading {len(document_paths)} file(s)"))
        docs = [read_document(p) for p in document_paths]
        system = DEFAULT_SYSTEM if system is None else system
        if docs:
            check_cancel()
            emit(AttachStep(f"tokenizing {sum(len(d.text) for d in docs):,} characters"))
        prefix = count_tokens(system) + TURN_OVERHEAD + sum(count_tokens(d.text) + TURN_OVERHEAD for d in docs)
        if prefix + 1 > self.context_limit:
            raise ContextFullError(f"the documents are {prefix:,} tokens with the system prompt; the context "
                                   f"limit is {self.context_limit:,} tokens", prefix + 1, self.context_limit)
        key = (system, *(d.text for d in docs))
        todo = max(1, prefix % BLOCK_SIZE) if key in self._prefilled else prefix
        for done in (0, todo // 2, todo) if docs else ():
            check_cancel()
            emit(PrefillProgress(done, todo, 0.5 if done < todo else 0.0))
            if done == 0 and self.prefill_gate is not None:
                deadline = time.monotonic() + 10
                while not self.prefill_gate.wait(timeout=0.01):  # held open until released or cancelled
                    check_cancel()
                    if time.monotonic() > deadline:
                        raise TimeoutError("the scripted prefill was never released")
        check_cancel()
        if docs:
            self._prefilled.add(key)
        for d in docs:
            self.documents.pop(d.text, None)
            n = count_tokens(d.text)
            self.documents[d.text] = DocumentSummary(f"d{len(self.documents) + 1}", d.title, str(d.path), n, "memory", n)
        self.chat, self._resume = _Chat(None, "New chat", system, [d.title for d in docs], prefix), None
        return self.current()

    def open_chat(self, chat_id: str) -> ChatView:
        if chat_id not in self.chats:
            raise LookupError(f"no conversation with id {chat_id!r}")
        self.chat = self.chats[chat_id]
        cached = self.chat.num_tokens // BLOCK_SIZE * BLOCK_SIZE
        self._resume = ResumeInfo(cached, 0, 0.1) if cached else None
        return self.current()

    def _open(self) -> _Chat:
        if self.chat is None:
            raise LookupError("no chat is open")
        return self.chat

    def send(self, text: str, settings: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        return self._turn(self._open(), text, settings, cancel, emit)

    def regenerate(self, settings: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        return self.edit_last(self._answered().messages[-2].text, settings, cancel, emit)

    def _answered(self) -> _Chat:
        chat = self._open()
        if chat.id is None or not chat.messages:
            raise LookupError("this chat has no answer yet")
        return chat

    def edit_last(self, text: str, settings: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        chat = self._answered()
        old = (chat.messages[-2:], chat.turn_tokens[-1:])
        del chat.messages[-2:], chat.turn_tokens[-1:]
        try:
            return self._turn(chat, text, settings, cancel, emit)
        except BaseException:
            chat.messages += old[0]
            chat.turn_tokens += old[1]
            raise

    def _turn(self, chat: _Chat, text: str, settings: SamplingParams, cancel: threading.Event,
              emit: Emit) -> TurnDone:
        if not text.strip():
            raise ValueError("the prompt is empty")
        user = count_tokens(text) + TURN_OVERHEAD
        if chat.num_tokens + user + 1 > self.context_limit:
            raise ContextFullError(f"this turn needs {chat.num_tokens + user + 1} tokens; the context limit is "
                                   f"{self.context_limit} tokens", chat.num_tokens + user + 1, self.context_limit)
        answer = self.answers.pop(0) if self.answers else f"You said: {text}"
        batcher, shown, reason = TokenBatcher(emit, interval_s=0.0), [], "stop"
        for i, piece in enumerate(re.findall(r"\S+\s*|\s+", answer)):
            if i == settings.max_tokens or chat.num_tokens + user + i + TURN_OVERHEAD >= self.context_limit:
                reason = "length" if i == settings.max_tokens else "context"
                break
            if cancel.is_set():
                reason = "cancelled"
                break
            batcher.add(piece)
            shown.append(piece)
            if self.hold_after is not None and i + 1 == self.hold_after:
                cancel.wait(timeout=10)
        reply = "".join(shown)
        prompt = chat.num_tokens + user
        new_tokens = len(shown) + (reason == "stop")  # a stop token is generated but not shown
        stats = TurnStats(prompt_tokens=prompt, reused_tokens=chat.num_tokens, from_memory=chat.num_tokens,
                          prefilled_tokens=user, new_tokens=new_tokens, ttft_ms=12.0, prefill_ms=8.0,
                          decode_tokens_per_s=100.0, finish_reason=reason)
        chat.turn_tokens.append(user + len(shown) + TURN_OVERHEAD)
        chat.messages += [ChatMessage("user", text), ChatMessage("assistant", reply, 12.0, 100.0, reason)]
        if chat.id is None:
            chat.id, chat.title = f"c_{next(self._ids):06x}", text.strip().splitlines()[0][:60]
            self.chats[chat.id] = chat
        chat.order, chat.updated, chat.disk_tokens = next(self._clock), time.time(), chat.num_tokens
        done = TurnDone(chat.id, reply, stats, chat.num_tokens, self.context_limit)
        emit(done)
        return done

    def set_system_prompt(self, text: str) -> ChatView:
        chat = self._open()
        if chat.messages or chat.documents:
            raise ValueError(SYSTEM_PROMPT_FIXED)
        chat.system, chat.prefix_tokens = text, count_tokens(text) + TURN_OVERHEAD
        return self.current()

    def continuation(self, message: str, max_tokens: int) -> Continuation:
        chat = self._open()
        if chat.id is None:
            raise LookupError("this chat has no stored turns to carry")
        bare = count_tokens(chat.system) + TURN_OVERHEAD
        pending = count_tokens(message) + TURN_OVERHEAD if message.strip() else 0
        return Continuation(chat.id, self.context_limit, chat.prefix_tokens, bare, len(chat.documents),
                            tuple(chat.turn_tokens), pending, answer_room(max_tokens))

    def continue_in_new_chat(self, way: CarryWay, message: str, max_tokens: int) -> ChatView:
        plan = self.continuation(message, max_tokens)
        if not plan.fits(way):
            raise plan.error(way)
        old, keep = self._open(), plan.carried_turns(way)
        first = len(old.turn_tokens) - keep
        documents = [] if way == "turns" else list(old.documents)
        prefix = plan.bare_prefix if way == "turns" else old.prefix_tokens
        new = _Chat(f"c_{next(self._ids):06x}", f"{old.title} (continued)", old.system, documents, prefix,
                    old.messages[2 * first:], old.turn_tokens[first:], order=next(self._clock), updated=time.time())
        self.chats[new.id] = new
        return self.open_chat(new.id)

    def rename_chat(self, chat_id: str, title: str) -> None:
        self._get(chat_id).title = title

    def delete_chat(self, chat_id: str) -> None:
        self._get(chat_id)
        if self.chat is self.chats[chat_id]:
            self.chat = None
        del self.chats[chat_id]

    def pin_chat(self, chat_id: str, pinned: bool) -> None:
        self._get(chat_id).pinned = pinned

    def purge_cache(self, chat_id: str) -> int:
        chat = self._get(chat_id)
        files, chat.disk_tokens = -(-chat.disk_tokens // CHUNK_TOKENS), 0
        return files

    def _get(self, chat_id: str) -> _Chat:
        if chat_id not in self.chats:
            raise LookupError(f"no conversation with id {chat_id!r}")
        return self.chats[chat_id]

    def cache_report(self) -> CacheReport:
        rows = [CacheRow(s.id, s.title, s.num_tokens, s.cache_state,
                         min(max(s.cached_tokens, self.chats[s.id].disk_tokens), s.num_tokens - 1),
                         s.cached_tokens * BYTES_PER_TOKEN, self.chats[s.id].disk_tokens * BYTES_PER_TOKEN, s.pinned)
                for s in self.list_chats()]
        st = self.status()
        disk = sum(r.disk_bytes for r in rows)
        return CacheReport(rows, disk, None, st.pool_bytes, st.pool_blocks_used, st.pool_blocks_total)

    def shutdown(self) -> None:
        self.shutdown_called = True
