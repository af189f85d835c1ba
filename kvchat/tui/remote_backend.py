""":class:`kvchat.tui.backend.Backend` on an OpenAI-compatible server (``kvchat --server URL``).

The model and its KV cache are the server's; the chats are kvchat's, in the local SQLite store, through
:class:`kvchat.remote.chats.RemoteChats`. Threads, as the real backend's: turns and chat changes run on one
"turn" thread in submission order; store-only calls (list, search, rename, pin) on one "store" thread, so the
sidebar answers while an answer streams. Each thread keeps its own SQLite connection.

The server need not be up: its chats are listed and opened from the store whatever it answers, the status
line says why it could not be used, and each message sent asks it again until it answers (a server started
after the app is used from then on).

What differs from a local model: opening a chat reads nothing from a cache (no resume line; the next turn's
line says what the server reused), documents go in the system message and are prefilled by the server at
the first turn (no progress here), the cache screen's figures are the server's (none on disk here), and a
chat cannot be carried into a new one (that needs the model's token counts).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

from kvchat.conversation.continuation import CarryWay, Continuation
from kvchat.conversation.events import AttachStep, Emit, LoadProgress, TurnDone
from kvchat.conversation.views import (
    AttachCancelled,
    CacheReport,
    ChatSummary,
    ChatView,
    DocumentSummary,
    Status,
    answer_figures,
)
from kvchat.engine.turn import SamplingParams
from kvchat.tui.backend import BackendNotReadyError

RETRY = "kvchat asks it again at the next message you send"
NO_CARRY = "carrying a chat into a new one needs a local model (its token counts); with a server, start a new chat"


class _Lane:
    """One thread running submitted calls in order; ``close`` closes its SQLite connections."""

    def __init__(self, name: str):
        self._ex = ThreadPoolExecutor(1, thread_name_prefix=name)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._ex.submit(fn, *args).result()

    def close(self) -> None:
        from kvchat.store.db import close_thread_dbs

        self._ex.submit(close_thread_dbs).result()
        self._ex.shutdown(wait=True)


class RemoteBackend:
    """The TUI's backend on the server ``url`` (see the module docstring).

    Args:
        url: the server, as :func:`kvchat.server_address.base_url` records it.
        api_key: sent as ``Authorization: Bearer`` (None: none).
        model: the server's model to use (None: the first it lists).
        read_timeout_s: the longest silence accepted inside an answer, seconds (None: ``KVCHAT_SERVER_TIMEOUT_S``).
    """

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 read_timeout_s: float | None = None):
        self.url, self._api_key, self.model = url, api_key, model
        self.read_timeout_s = read_timeout_s
        self._models: list[str] = []  # the server's, once loaded
        self._turn_lane = _Lane("kvchat-remote")
        self._store_lane = _Lane("kvchat-store")
        self._chats = None  # kvchat.remote.chats.RemoteChats once loaded (the store open, the server or not)
        self._connected = False  # the server has listed its models (and the model is picked)
        self._counters = None  # kvchat serve's /health figures (None elsewhere)
        self._status = Status(phase="loading", message="starting")

    # --- turn lane --------------------------------------------------------------------------------
    def load(self, emit: Emit) -> Status:
        return self._turn_lane.call(self._load, emit)

    def _load(self, emit: Emit) -> Status:
        from kvchat.remote.chats import RemoteChats
        from kvchat.remote.client import ServerClient, ServerError
        from kvchat.tui.store_open import open_store

        try:
            open_store()
        except Exception as exc:
            self._status = Status(phase="error", message=str(exc))
            raise
        emit(LoadProgress(f"connecting to {self.url}"))
        # the chats are the local store's: listed and opened whether or not the server answers
        self._chats = RemoteChats(ServerClient(self.url, self._api_key, self.read_timeout_s), self.model or "")
        try:
            self._connect()
        except (ServerError, LookupError):
            pass  # the status line says why; the next send tries again
        return self.status()

    def _connect(self) -> None:
        """Ask the server for its models (and kvchat serve's counters) and pick the model; the status line says
        the outcome. Run at load and, until it has worked, again before each turn or model change.

        Raises:
            kvchat.remote.client.ServerError: unreachable, a refused key, not an OpenAI-compatible server.
            LookupError: the server lists no model, or not the one asked for.
        """
        from kvchat.remote.client import context_limit, pick_model
        from kvchat.server_address import plain_http_warning

        chats = self._chats
        try:
            models = chats.client.models()
            counters = chats.client.counters()
        except Exception as exc:
            self._status = Status(phase="ready", message=f"{exc}; {RETRY}")
            raise
        self._models = [m.id for m in models]  # known even when the one asked for is not among them: Ctrl+L picks
        try:
            chosen = pick_model(self._models, self.model, self.url)
        except LookupError as exc:
            self._status = Status(phase="ready", message=f"{exc}; pick one with Ctrl+L" if self._models else
                                  f"{exc}; {RETRY}")
            raise
        self._counters, self._connected = counters, True
        chats.model, chats.context_limit = chosen, context_limit(models, chosen, counters)
        warning = plain_http_warning(self.url)  # said once, until the first answer's line replaces it
        self._status = Status(phase="ready", message=f"warning: {warning}" if warning else f"connected to {self.url}")

    def _require(self):
        if self._chats is None:
            failed = self._status.phase == "error"
            raise BackendNotReadyError(self._status.message if failed else "still connecting to the server")
        return self._chats

    def _require_connected(self):
        """The chats, once the server has answered (asked again here when it has not: it may be up now).

        Raises:
            kvchat.remote.client.ServerError, LookupError: as :meth:`_connect`.
        """
        chats = self._require()
        if not self._connected:
            self._connect()
        return chats

    def new_chat(self, system: str | None, document_paths: Sequence[str], emit: Emit,
                 cancel: threading.Event | None = None) -> ChatView:
        def run() -> ChatView:
            from kvchat.documents import read_document

            chats = self._require()
            if document_paths:
                emit(AttachStep(f"reading {len(document_paths)} file(s)"))
            docs = [read_document(p) for p in document_paths]
            if cancel is not None and cancel.is_set():
                raise AttachCancelled("attach cancelled; nothing was stored")
            return chats.new_chat(system, docs)

        return self._turn_lane.call(run)

    def open_chat(self, chat_id: str) -> ChatView:
        return self._turn_lane.call(lambda: self._require().open_chat(chat_id))

    def send(self, text: str, settings: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        return self._turn_lane.call(self._after_turn, lambda c: c.send(text, settings, cancel, emit))

    def regenerate(self, settings: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        return self._turn_lane.call(self._after_turn, lambda c: c.regenerate(settings, cancel, emit))

    def edit_last(self, text: str, settings: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        return self._turn_lane.call(self._after_turn, lambda c: c.edit_last(text, settings, cancel, emit))

    def _after_turn(self, turn: Callable[[Any], TurnDone]) -> TurnDone:
        """Run ``turn`` on the chats (connecting first if the server has not answered yet), then read kvchat
        serve's counters again (a failure there leaves the old). A server failure stays on the status line
        until the next answer's line replaces it."""
        from kvchat.remote.client import ServerError

        chats = self._require_connected()
        try:
            return turn(chats)
        except ServerError as exc:
            chats.last_line, self._status = "", Status(phase="ready", message=str(exc))
            raise
        finally:
            if self._counters is not None:
                try:
                    self._counters = chats.client.counters() or self._counters
                except ServerError:
                    pass  # the turn's own outcome is what the user sees; the pool figures stay as they were

    def set_system_prompt(self, text: str) -> ChatView:
        return self._turn_lane.call(lambda: self._require().set_system_prompt(text))

    def continuation(self, message: str, max_tokens: int) -> Continuation:
        raise ValueError(NO_CARRY)

    def continue_in_new_chat(self, way: CarryWay, message: str, max_tokens: int) -> ChatView:
        raise ValueError(NO_CARRY)

    def delete_chat(self, chat_id: str) -> None:
        self._turn_lane.call(lambda: self._require().delete_chat(chat_id))

    # --- no lane: non-blocking reads ------------------------------------------------------------
    def status(self) -> Status:
        chats = self._chats
        if chats is None:
            return Status(phase=self._status.phase, message=self._status.message)
        view, c = chats.view(), self._counters
        ttft_ms, tokens_per_s = answer_figures(view.messages if view else [])
        device = f"server {urlsplit(self.url).netloc}"
        line = chats.last_line if self._connected and chats.last_line else self._status.message
        return Status("ready", line, chats.model or "(no model yet)", device,
                      c.kv_dtype if c else "", c.pool_blocks_used if c else 0, c.pool_blocks_total if c else 0, 0,
                      view.num_tokens if view else 0, chats.context_limit, ttft_ms, tokens_per_s)

    def current(self) -> ChatView | None:
        return self._chats.view() if self._chats is not None else None

    def models(self) -> list[str]:
        return list(self._models)

    def use_model(self, name: str) -> Status:
        def run() -> Status:
            from kvchat.remote.client import pick_model

            if not self._connected:  # the model asked for at start is not the server's: this one is picked
                self.model = pick_model(self._models, name, self.url)
            chats = self._require_connected()
            chats.model = pick_model(self._models, name, self.url)
            return self.status()

        return self._turn_lane.call(run)

    # --- store lane ------------------------------------------------------------------------------
    def _store(self, op: Callable[[Any], Any]) -> Any:
        def run() -> Any:
            from kvchat.tui.store_open import open_store

            open_store()
            return op(self._require())

        return self._store_lane.call(run)

    def list_chats(self, query: str = "") -> list[ChatSummary]:
        if self._chats is None:
            return []  # which server's chats to list is known once connected
        return self._store(lambda chats: chats.list_chats(query))

    def list_documents(self) -> list[DocumentSummary]:
        return []  # the documents list is the local cache's prefixes; a server keeps its own

    def rename_chat(self, chat_id: str, title: str) -> None:
        self._store(lambda chats: chats.rename_chat(chat_id, title))

    def pin_chat(self, chat_id: str, pinned: bool) -> None:
        self._store(lambda chats: chats.pin_chat(chat_id, pinned))

    def purge_cache(self, chat_id: str) -> int:
        return 0  # nothing of a server's chat is cached here

    def cache_report(self) -> CacheReport:
        report = self._store(lambda chats: chats.cache_report())
        st = self.status()
        report.pool_blocks_used, report.pool_blocks_total = st.pool_blocks_used, st.pool_blocks_total
        return report

    def shutdown(self) -> None:
        """Finish the queued calls, close the connection pool, stop both threads."""
        if self._chats is not None:
            self._turn_lane.call(self._chats.client.close)
        self._turn_lane.close()
        self._store_lane.close()

