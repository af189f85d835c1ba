"""The one typed boundary between the TUI and the engine: operations, events, errors.

Contract (checked for both implementations by ``tests/test_tui_backend_contract.py``):

- Every operation except :meth:`Backend.status` may block (model load, prefill,
  decode, SQLite); the UI calls them from ``@work(thread=True)`` workers, never
  on the UI thread. They may be called from any thread; the backend serializes
  engine work itself. :meth:`Backend.status` never blocks.
- ``emit`` receives events (:mod:`kvchat.tui.events`) in order:
  ``PrefillProgress`` (zero or more), then ``TokenBatch`` (zero or more; their
  texts joined equal the answer), then exactly one ``TurnDone``, last. Token
  pieces are coalesced into batches (``kvchat.tui.streaming.TokenBatcher``),
  so a UI posts one message per batch, not per token.
- Bad user input raises a ``ValueError`` subclass with a one-line message and
  changes nothing: :class:`ContextFullError` when a message does not fit,
  ``kvchat.documents.DocumentError`` for a bad document, an empty prompt, an
  unknown chat id (``LookupError``). Nothing else is swallowed.
- Cache fields (:attr:`ChatSummary.cache_state`, :class:`ResumeInfo`) report
  what the engine's counters and the store say: ``"memory"`` when the pool
  holds the whole history, ``"disk"`` when snapshots under this engine's
  cache fingerprint exist, ``"none"`` otherwise.
- :class:`StoreUnavailableError` from any operation means the data dir or its
  database cannot be opened: the app cannot run and should exit with that line.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence

from kvchat.tui.events import Emit, TurnDone
from kvchat.turn import SamplingParams

CacheState = Literal["memory", "disk", "none"]
SYSTEM_PROMPT_FIXED = "the system prompt starts the chat's cached prefix; it can be set only before the first message"


class ContextFullError(ValueError):
    """A message does not fit in the chat's context (``needed`` > ``limit`` tokens)."""

    def __init__(self, message: str, needed: int, limit: int):
        super().__init__(message)
        self.needed = needed
        self.limit = limit


class BackendNotReadyError(RuntimeError):
    """An engine operation was called before :meth:`Backend.load` finished."""


class StoreUnavailableError(RuntimeError):
    """The data dir or its database cannot be opened (damaged file, read-only dir): the app cannot run.

    The message is one line naming the path and the cause; nothing on disk was changed.
    """


@dataclass(slots=True)
class ResumeInfo:
    """How a chat's history got into the KV pool when it was opened (engine counters).

    ``tokens`` were reused in ``ms``: ``from_disk`` of them read from snapshot
    files, the rest found in the pool's prefix cache; ``prefill`` history
    tokens were not cached and will be prefilled (0 when less than a block
    short: the last token and the end-of-turn tokens the last answer never ran
    through the model are always recomputed); ``miss_reason`` says why stored
    KV could not be used, if some was skipped.
    """

    tokens: int
    from_disk: int
    ms: float
    miss_reason: str | None = None
    prefill: int = 0

    @property
    def source(self) -> CacheState:
        """Where most of it came from: ``disk`` if any was read from files."""
        return "disk" if self.from_disk else "memory" if self.tokens else "none"

    @property
    def line(self) -> str:
        """E.g. ``resumed 3,812 tokens from disk in 41 ms — prefill skipped``."""
        if not self.tokens:
            return f"no cached KV ({self.miss_reason or 'none stored'}): the history will be prefilled"
        memory = self.tokens - self.from_disk
        where = ("from disk" if not memory else "from memory" if not self.from_disk
                 else f"({memory:,} from memory, {self.from_disk:,} from disk)")
        line = f"resumed {self.tokens:,} tokens {where} in {self.ms:.0f} ms"
        if self.prefill:
            line += f"; {self.prefill:,} more will be prefilled"
            return line + (f" ({self.miss_reason})" if self.miss_reason else "")
        line += " — prefill skipped"
        return line + (f" (partly: {self.miss_reason})" if self.miss_reason else "")


@dataclass(slots=True)
class Status:
    """What the status bar shows. Sizes in blocks and bytes; context in tokens; times in ms."""

    phase: Literal["loading", "ready", "error"] = "loading"
    message: str = ""
    model: str = ""
    device: str = ""
    kv_dtype: str = ""
    pool_blocks_used: int = 0
    pool_blocks_total: int = 0
    pool_bytes: int = 0
    context_used: int = 0
    context_limit: int = 0
    last_ttft_ms: float | None = None
    last_tokens_per_s: float | None = None
    resume: ResumeInfo | None = None


@dataclass(slots=True)
class ChatSummary:
    """A sidebar row: a stored chat, its size and where its KV lives (``cached_tokens``: tokens in the pool)."""

    id: str
    title: str
    updated: float
    num_tokens: int
    num_messages: int
    pinned: bool
    cache_state: CacheState
    cached_tokens: int


@dataclass(slots=True)
class DocumentSummary:
    """A document attached in some chat: its title, token count and where its prefix's KV lives.

    ``cache_state``: ``memory`` (in the pool), ``disk`` (a snapshot this
    engine can restore), ``none``.
    """

    id: str
    title: str
    path: str
    tokens: int
    cache_state: CacheState

    @property
    def cached(self) -> bool:
        """True when the document's prefix need not be prefilled again (in memory or on disk)."""
        return self.cache_state != "none"


@dataclass(slots=True)
class ChatMessage:
    """One displayed message; ``ttft_ms``/``tokens_per_s`` for answers when known."""

    role: Literal["user", "assistant"]
    text: str
    ttft_ms: float | None = None
    tokens_per_s: float | None = None


@dataclass(slots=True)
class ChatView:
    """The open chat. ``id`` is None for a new chat until its first turn is stored."""

    id: str | None
    title: str
    system_prompt: str
    documents: list[str]
    messages: list[ChatMessage]
    num_tokens: int
    context_limit: int
    resume: ResumeInfo | None = None


@dataclass(slots=True)
class CacheRow:
    """One chat on the cache screen: KV bytes on disk and in the pool, pin, and why it would miss (if known).

    ``cached_tokens``: the history tokens a resume reuses, from the pool or from disk, whichever covers
    more (never the last token, which a resume always recomputes).
    """

    chat_id: str
    title: str
    num_tokens: int
    cache_state: CacheState
    cached_tokens: int
    memory_bytes: int
    disk_bytes: int
    pinned: bool
    miss_reason: str = ""


@dataclass(slots=True)
class CacheReport:
    """The cache screen: per-chat rows and totals vs budgets (bytes)."""

    rows: list[CacheRow] = field(default_factory=list)
    disk_bytes: int = 0
    disk_budget_bytes: int | None = None
    pool_bytes: int = 0
    pool_blocks_used: int = 0
    pool_blocks_total: int = 0


class Backend(Protocol):
    """What the TUI needs from the engine and the store (see the module docstring for the contract)."""

    def load(self, emit: Emit) -> Status:
        """Import/load the model (emitting :class:`LoadProgress`); the first call that may import torch."""

    def status(self) -> Status:
        """Current counters; never blocks."""

    def current(self) -> ChatView | None:
        """The open chat, if any."""

    def list_chats(self, query: str = "") -> list[ChatSummary]:
        """Stored chats, pinned then most recent first; ``query`` searches titles and message text."""

    def list_documents(self) -> list[DocumentSummary]:
        """Documents attached so far, most recent first."""

    def new_chat(self, system: str | None, document_paths: Sequence[str], emit: Emit) -> ChatView:
        """Open a new chat; documents are read and prefilled now (emitting :class:`PrefillProgress`)."""

    def open_chat(self, chat_id: str) -> ChatView:
        """Open a stored chat and map its cached KV (:attr:`ChatView.resume`)."""

    def send(self, text: str, settings: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        """Add a user message to the open chat and generate the answer (events as in the contract)."""

    def regenerate(self, settings: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        """Replace the last answer by a new one for the same user message (cached prefix reused)."""

    def edit_last(self, text: str, settings: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        """Replace the last user message by ``text`` and answer it (cached prefix reused)."""

    def set_system_prompt(self, text: str) -> ChatView:
        """Set the open chat's system prompt; only before its first turn (it starts the cached prefix)."""

    def continue_in_new_chat(self, keep_turns: int) -> ChatView:
        """Open a new stored chat with the open chat's prefix and its last ``keep_turns`` turns (fewer if too long)."""

    def rename_chat(self, chat_id: str, title: str) -> None:
        """Set a chat's title."""

    def delete_chat(self, chat_id: str) -> None:
        """Delete a chat, its messages and its unshared cache."""

    def pin_chat(self, chat_id: str, pinned: bool) -> None:
        """Pin (exempt from eviction) or unpin a chat."""

    def purge_cache(self, chat_id: str) -> int:
        """Drop a chat's KV snapshots on disk (shared chunks stay); returns the number of chunk files deleted."""

    def cache_report(self) -> CacheReport:
        """Per-chat cache use and totals."""

    def shutdown(self) -> None:
        """Flush queued work (e.g. snapshot writes) and release threads; called once on quit."""
