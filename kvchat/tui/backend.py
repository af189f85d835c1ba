"""The one typed boundary between the TUI and the engine: operations, events, errors.

Contract (checked for both implementations by ``tests/tui/test_tui_backend_contract.py``):

- Every operation except :meth:`Backend.status` may block (model load, prefill,
  decode, SQLite); the UI calls them from ``@work(thread=True)`` workers, never
  on the UI thread. They may be called from any thread; the backend serializes
  engine work itself. :meth:`Backend.status` never blocks.
- ``emit`` receives events (:mod:`kvchat.conversation.events`) in order. A document attach
  (:meth:`Backend.new_chat` with paths): ``AttachStep`` (reading, tokenizing) from its first moment, then
  ``PrefillProgress`` from ``0`` of the tokens to prefill (none when the prefix is cached whole); with its
  ``cancel`` set it raises ``AttachCancelled`` and keeps nothing (no document, no chat, the open chat as it
  was). A turn: ``PrefillProgress`` (zero or more), then ``TokenBatch`` (zero or more; their
  texts joined equal the answer), then exactly one ``TurnDone``, last. Token
  pieces are coalesced into batches (``kvchat.conversation.streaming.TokenBatcher``),
  so a UI posts one message per batch, not per token.
- Bad user input raises a ``ValueError`` subclass with a one-line message and
  changes nothing: :class:`kvchat.conversation.views.ContextFullError` when a message does not fit,
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
from typing import Protocol, Sequence

from kvchat.conversation.continuation import CarryWay, Continuation
from kvchat.conversation.events import Emit, TurnDone
from kvchat.conversation.views import CacheReport, ChatSummary, ChatView, DocumentSummary, Status
from kvchat.engine.turn import SamplingParams


class BackendNotReadyError(RuntimeError):
    """An engine operation was called before :meth:`Backend.load` finished."""


class StoreUnavailableError(RuntimeError):
    """The data dir or its database cannot be opened (damaged file, read-only dir): the app cannot run.

    The message is one line naming the path and the cause; nothing on disk was changed.
    """


class Backend(Protocol):
    """What the TUI needs from the engine and the store (see the module docstring for the contract)."""

    def load(self, emit: Emit) -> Status:
        """Import/load the model (emitting :class:`LoadProgress`); the first call that may import torch."""

    def status(self) -> Status:
        """Current counters; never blocks."""

    def models(self) -> list[str]:
        """The models :meth:`use_model` can switch to, the one in use among them (a local backend: its one
        model; a server: those it lists); empty before :meth:`load` finished. Never blocks."""

    def use_model(self, name: str) -> Status:
        """Answer the next turns with ``name``, one of :meth:`models` (``LookupError`` otherwise; nothing changes).
        A local backend has one model per run: any other name raises ``LookupError`` naming ``--model``."""

    def current(self) -> ChatView | None:
        """The open chat, if any."""

    def list_chats(self, query: str = "") -> list[ChatSummary]:
        """Stored chats, pinned then most recent first; ``query`` searches titles and message text."""

    def list_documents(self) -> list[DocumentSummary]:
        """Documents attached so far, most recent first."""

    def new_chat(self, system: str | None, document_paths: Sequence[str], emit: Emit,
                 cancel: threading.Event | None = None) -> ChatView:
        """Open a new chat; documents are read and prefilled now (events as in the contract); ``cancel``
        stops the attach between steps and chunks (``AttachCancelled``, nothing kept)."""

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

    def continuation(self, message: str, max_tokens: int) -> Continuation:
        """How the open stored chat can go on in a new chat, keeping room for ``message`` and an answer of up to
        ``max_tokens`` (:mod:`kvchat.conversation.continuation`); ``LookupError`` if no stored chat is open."""

    def continue_in_new_chat(self, way: CarryWay, message: str, max_tokens: int) -> ChatView:
        """Store and open a new chat that goes on from the open one by ``way`` (what :meth:`continuation`
        carries); ``ContextFullError`` (nothing stored) if ``way`` does not fit."""

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
