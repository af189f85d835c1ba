"""The real engine behind the TUI: ``load_runtime`` + the engine loop + ``ChatService`` + the SQLite store.

Threads: the model loads on the caller's thread (a Textual worker); from then on every engine call (open,
new chat, turns, regenerate, delete) runs on the engine loop's thread
(:meth:`kvchat.engine.loop.EngineLoop.call`) in submission order, a turn as a batch of one; a call made
while the model loads waits for the load. Store-only work (list, search, rename, pin) runs on one "store"
thread, so the sidebar answers while an answer streams. Each thread keeps its own SQLite connection
(``get_db``). torch, transformers and sqlite-utils are imported only off the UI thread, so the first frame
never waits for them.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from kvchat.conversation.continuation import CarryWay, Continuation
from kvchat.conversation.events import Emit, LoadProgress, TurnDone
from kvchat.conversation.views import CacheReport, ChatSummary, ChatView, DocumentSummary, Status
from kvchat.engine.turn import SamplingParams
from kvchat.tui.backend import BackendNotReadyError, StoreUnavailableError


def _close_thread_dbs() -> None:
    from kvchat.store.db import close_thread_dbs

    close_thread_dbs()


class RealBackend:
    """:class:`kvchat.tui.backend.Backend` over the real engine (see the module docstring for threads).

    Args:
        model: ``--model`` value (None: the default model, imported on first use).
        kv_dtype: ``fp8`` | ``bf16`` | ``fp16``.
        pool_bytes: KV pool budget in bytes (None: the engine's default).
        threads: torch CPU threads (None: torch's default).
    """

    def __init__(self, model: str | None = None, kv_dtype: str = "fp8", pool_bytes: int | None = None,
                 threads: int | None = None):
        self.model, self.kv_dtype, self.pool_bytes, self.threads = model, kv_dtype, pool_bytes, threads
        self._store_lane = ThreadPoolExecutor(1, thread_name_prefix="kvchat-store")
        self._chats = None  # kvchat.conversation.service.ChatService once loaded (it starts the engine loop)
        self._load_lock = threading.Lock()  # held from load() to its end: engine calls made meanwhile wait
        self._loading = threading.Event()  # load() was called
        self._status = Status(phase="loading", message="starting")

    # --- the engine loop ---------------------------------------------------------------------
    def load(self, emit: Emit) -> Status:
        with self._load_lock:
            self._loading.set()
            try:
                return self._load(emit)
            finally:
                _close_thread_dbs()  # this thread opened the store; the loop and store threads use their own

    def _engine(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(ChatService)`` on the engine loop's thread, once the model has loaded.

        Raises:
            BackendNotReadyError: the model is not loaded (still loading, or its load failed).
        """
        if self._loading.is_set():
            with self._load_lock:  # a load under way ends first
                pass
        chats = self._require()
        return chats.loop.call(fn, chats)

    def _load(self, emit: Emit) -> Status:
        from kvchat.tui.store_open import open_store

        try:
            open_store()  # a damaged database or read-only data dir fails here, before torch is imported
        except StoreUnavailableError as exc:
            self._status = Status(phase="error", message=str(exc))
            raise
        emit(LoadProgress("importing torch and transformers"))
        from kvchat.conversation.service import ChatService
        from kvchat.cpu_threads import on_own_thread
        from kvchat.engine.loop import EngineLoop
        from kvchat.load_steps import listening
        from kvchat.model.importer import DEFAULT_MODEL_NAME, read_manifest
        from kvchat.paths import models_dir
        from kvchat.runtime import load_runtime, set_threads

        set_threads(self.threads)
        if self.model is None and read_manifest(models_dir() / DEFAULT_MODEL_NAME) is None:
            self._import_default(emit)
        try:
            # numbered steps (weights, kernel compiles) through ``progress``; the steps of code that takes no
            # callback (tokenizer, int8 quantization, kernel builds) through load_steps: both to the status bar
            def load():
                with listening(lambda text: emit(LoadProgress(text))):  # the loading thread's steps
                    return load_runtime(self.model, self.kv_dtype, pool_bytes=self.pool_bytes,
                                        progress=lambda text, done, total: emit(LoadProgress(text, done, total)))

            rt = on_own_thread(load)  # loaded on a thread that ends, run on the engine loop's: see on_own_thread
        except Exception as exc:
            self._status = Status(phase="error", message=f"model load failed: {exc}")
            raise
        self._chats = ChatService(rt, loop=EngineLoop(rt.engine))
        self._status = Status(phase="ready", message="ready")
        return self.status()

    def _import_default(self, emit: Emit) -> None:
        """First run: import the default model, each step shown as ``LoadProgress(…, done, total)``."""
        from kvchat.model.importer import DEFAULT_MODEL_NAME, import_default_model

        def progress(text: str, done: int, total: int) -> None:
            emit(LoadProgress(f"first run: importing {DEFAULT_MODEL_NAME} — {text}", done, total))

        try:
            import_default_model(progress=progress)
        except Exception as exc:
            self._status = Status(phase="error", message=f"importing the default model failed: {exc}")
            raise

    def _require(self):
        if self._chats is None:
            failed = self._status.phase == "error"
            raise BackendNotReadyError(self._status.message if failed else "the model is still loading")
        return self._chats

    def new_chat(self, system: str | None, document_paths: Sequence[str], emit: Emit,
                 cancel: threading.Event | None = None) -> ChatView:
        return self._engine(lambda chats: chats.new_chat(system, document_paths, emit, cancel))

    def open_chat(self, chat_id: str) -> ChatView:
        return self._engine(lambda chats: chats.open_chat(chat_id))

    def send(self, text: str, settings: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        return self._engine(lambda chats: chats.send(text, settings, cancel, emit))

    def regenerate(self, settings: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        return self._engine(lambda chats: chats.regenerate(settings, cancel, emit))

    def edit_last(self, text: str, settings: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        return self._engine(lambda chats: chats.edit_last(text, settings, cancel, emit))

    def set_system_prompt(self, text: str) -> ChatView:
        return self._engine(lambda chats: chats.set_system_prompt(text))

    def continuation(self, message: str, max_tokens: int) -> Continuation:
        return self._engine(lambda chats: chats.continuation(message, max_tokens))

    def continue_in_new_chat(self, way: CarryWay, message: str, max_tokens: int) -> ChatView:
        return self._engine(lambda chats: chats.continue_in_new_chat(way, message, max_tokens))

    def delete_chat(self, chat_id: str) -> None:
        def run(chats) -> None:
            from kvchat.conversation import listing

            listing.delete_chat(chats, chat_id)

        self._engine(run)

    # --- no lane: non-blocking reads -----------------------------------------------------------
    def status(self) -> Status:
        chats = self._chats
        if chats is None:
            return Status(phase=self._status.phase, message=self._status.message)
        return chats.status()

    def current(self) -> ChatView | None:
        return self._chats.view() if self._chats is not None else None

    def models(self) -> list[str]:
        return [self._chats.rt.info.name] if self._chats is not None else []

    def use_model(self, name: str) -> Status:
        if name not in self.models():
            raise LookupError(f"this run's model is {', '.join(self.models()) or 'still loading'}; another "
                              f"local model needs a new run: kvchat --model {name}")
        return self.status()

    # --- store lane ---------------------------------------------------------------------------
    def _store(self, op: Callable[[Any], Any]) -> Any:
        """``op(kvchat.conversation.listing)`` on the store lane (SQLite imports stay off the UI thread)."""
        def run() -> Any:
            from kvchat.tui.store_open import open_store

            open_store()
            from kvchat.conversation import listing

            return op(listing)

        return self._store_lane.submit(run).result()

    def list_chats(self, query: str = "") -> list[ChatSummary]:
        return self._store(lambda listing: listing.list_chats(self._chats, query))

    def list_documents(self) -> list[DocumentSummary]:
        return self._store(lambda listing: listing.list_documents(self._chats))

    def rename_chat(self, chat_id: str, title: str) -> None:
        self._store(lambda listing: listing.rename_chat(self._chats, chat_id, title))

    def pin_chat(self, chat_id: str, pinned: bool) -> None:
        self._store(lambda listing: listing.pin_chat(self._chats, chat_id, pinned))

    def purge_cache(self, chat_id: str) -> int:
        return self._store(lambda listing: listing.purge_cache(self._chats, chat_id))

    def cache_report(self) -> CacheReport:
        report = self._store(lambda listing: listing.cache_report(self._chats))
        st = self.status()
        report.pool_bytes, report.pool_blocks_used, report.pool_blocks_total = (
            st.pool_bytes, st.pool_blocks_used, st.pool_blocks_total)
        return report

    def shutdown(self) -> None:
        """Finish queued engine work, flush queued snapshot writes, stop the engine loop, then the store
        thread (each thread's SQLite connections closed on it)."""
        if self._loading.is_set():
            with self._load_lock:
                pass
        chats = self._chats
        if chats is not None:
            chats.loop.call(lambda: (chats.close(), _close_thread_dbs()))
            chats.loop.close()
        self._store_lane.submit(_close_thread_dbs).result()
        self._store_lane.shutdown(wait=True)
