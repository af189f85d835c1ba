"""The main screen: sidebar, chat pane, prefill bar, input, status bar; runs backend work in thread workers.

Engine work goes through ``@work(thread=True)`` workers; their backend
events come back as :class:`BackendEvent` messages, one per token *batch*
(``post_message`` is thread-safe), never a blocking call per token. The
user actions (dialogs) are in :class:`kvchat.tui.screens.chat_actions.ChatActions`.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from typing import Any, Callable

from textual import on, work
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer

from kvchat.store.errors import StoreError
from kvchat.tui.actions import ACTIONS
from kvchat.tui.backend import Backend, StoreUnavailableError
from kvchat.conversation.views import ChatView, ContextFullError
from kvchat.conversation.events import BackendEvent as Event
from kvchat.conversation.events import LoadProgress, PrefillProgress, TokenBatch, TurnDone
from kvchat.tui.screens.chat_actions import ChatActions
from kvchat.tui.screens.messages import BackendEvent, CannotRun, TurnFailed
from kvchat.tui.text import one_line
from kvchat.tui.widgets.chat_input import ChatInput
from kvchat.tui.widgets.message import MessageBlock, stats_line
from kvchat.tui.widgets.message_view import MessageView
from kvchat.tui.widgets.prefill_bar import PrefillBar
from kvchat.tui.widgets.sidebar import Sidebar
from kvchat.tui.widgets.status_bar import StatusBar
from kvchat.engine.turn import SamplingParams


class ChatScreen(ChatActions, Screen):
    """See the module docstring. ``generating`` is True while an answer streams."""

    BINDINGS = [Binding(a.key, a.action, a.title, show=a.show) for a in ACTIONS]
    generating = reactive(False)

    def __init__(self, backend: Backend):
        super().__init__()
        self.backend = backend
        self.settings = SamplingParams()
        self.ready = False
        self.load_error = ""
        self.editing = False
        self.show_resume = False  # the status bar's resume line describes an open until the next turn finishes
        self.cancel_event = threading.Event()
        self._answer: MessageBlock | None = None
        self._lists_lock = asyncio.Lock()  # two refreshes' clear/extend awaits must not interleave

    def compose(self):
        with Horizontal():
            yield Sidebar(id="sidebar")
            with Vertical(id="main"):
                yield MessageView(id="messages")
                yield PrefillBar(id="prefill")
                yield ChatInput(id="input")
        yield StatusBar(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.hide_prefill()
        self.query_one(ChatInput).focus()
        self.update_status("loading the model…")
        self.call_after_refresh(self._after_first_frame)

    def _after_first_frame(self) -> None:
        """Start the model load and the sidebar query once the first frame is drawn (they compete for the GIL)."""
        self.refresh_lists()
        self._load()

    # --- workers ---------------------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        """Backend ``emit`` callback: thread-safe, one message per event."""
        self.post_message(BackendEvent(event))

    @work(thread=True, group="engine")
    def _load(self) -> None:
        try:
            self.backend.load(self.emit)
        except StoreUnavailableError as exc:
            self.load_error = f"kvchat cannot run: {one_line(str(exc))}"
            self.notify_error(exc)  # the app exits with this line
            return
        except Exception as exc:  # noqa: BLE001 - a failed load is shown, the app keeps running
            self.load_error = f"the model failed to load: {one_line(str(exc))}"
            self.app.call_from_thread(self._load_failed)
            self.notify_error(exc)
            return
        self.app.call_from_thread(self._loaded)

    def _load_failed(self) -> None:
        self.hide_prefill()
        self.update_status(self.load_error)

    def _loaded(self) -> None:
        self.ready = True
        self.hide_prefill()
        self.update_status()
        self.refresh_lists()

    def refresh_lists(self, open_first: bool = False) -> None:
        """Reload the sidebar's chats (with the search query) and documents, in a worker.

        ``open_first``: then open the highlighted (else the first) chat listed (Enter in the search box).
        """
        self._fetch_lists(self.query_one(Sidebar).query_text, open_first)

    @work(thread=True, exclusive=True, group="lists")
    def _fetch_lists(self, query: str, open_first: bool) -> None:
        try:
            chats, docs = self.backend.list_chats(query), self.backend.list_documents()
        except Exception as exc:  # noqa: BLE001
            self.notify_error(exc)
            return
        current = self.backend.current()
        self.app.call_from_thread(self._set_lists, chats, docs, current.id if current else None, query, open_first)

    async def _set_lists(self, chats, docs, current_id, query: str = "", open_first: bool = False) -> None:
        """Show a listing; one for a search the box no longer holds is dropped (the newer one is on its way)."""
        sidebar = self.query_one(Sidebar)
        if query != sidebar.query_text:
            return
        async with self._lists_lock:
            await sidebar.set_chats(chats, current_id)
            await sidebar.set_documents(docs)
        if open_first:
            sidebar.open_chat()

    def run_engine(self, fn: Callable[..., Any], *args: Any, then: Callable[[Any], Any] | None = None) -> None:
        """Run ``fn(*args)`` on a worker thread (not while an answer streams); ``then(result)`` on the UI thread."""
        reason = self.busy_reason()
        if reason:
            self.app.notify(reason, severity="warning")
            return
        self._engine_call(fn, args, then)

    def busy_reason(self) -> str:
        """Why engine work cannot start now ("" when it can)."""
        if not self.ready:
            return self.load_error or "the model is still loading"
        return "an answer is being generated (Esc stops it)" if self.generating else ""

    @work(thread=True, group="engine")
    def _engine_call(self, fn, args, then) -> None:
        try:
            result = fn(*args)
        except Exception as exc:  # noqa: BLE001 - shown as a notification
            self.app.call_from_thread(self.hide_prefill)
            self.notify_error(exc)
            return
        if then is not None:
            self.app.call_from_thread(then, result)

    def hide_prefill(self) -> None:
        self.query_one(PrefillBar).done()

    def notify_error(self, exc: Exception) -> None:
        """A one-line error notification (thread-safe); unexpected errors name their type.

        An unusable data dir or database ends the app instead (:class:`CannotRun`).
        """
        if isinstance(exc, StoreUnavailableError):
            self.post_message(CannotRun(str(exc)))
            return
        expected = isinstance(exc, (ValueError, LookupError, OSError, StoreError))
        text = one_line(str(exc)) if expected else f"{type(exc).__name__}: {one_line(str(exc))}"
        if isinstance(exc, sqlite3.Error):  # a full disk, a read-only or damaged database: name the cause
            from kvchat.paths import db_path
            from kvchat.store.db import database_error_line

            text = database_error_line(exc, db_path())
        self.app.notify(text, severity="error", markup=False, timeout=8)

    @on(CannotRun)
    def _cannot_run(self, message: CannotRun) -> None:
        self.app.cannot_run(message.reason)

    # --- turns -----------------------------------------------------------------------------------
    @on(ChatInput.Submitted)
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        text = event.text
        if not text.strip():
            return
        reason = self.busy_reason()
        if reason:
            self.app.notify(reason, severity="warning")  # the text stays in the input
            return
        op = "edit" if self.editing else "send"
        self.query_one(ChatInput).clear()
        await self.start_turn(op, text)

    async def start_turn(self, op: str, text: str) -> None:
        """Show the user message and an empty answer, then generate in a worker (op: send, regenerate, edit)."""
        view = self.query_one(MessageView)
        if op in ("regenerate", "edit"):
            last = view.blocks()
            for block in last[-2 if op == "edit" else -1:]:
                await block.remove()
        if op != "regenerate":
            await view.add("user", text)
        self._answer = await view.add("assistant")
        self.editing = False
        self.cancel_event = threading.Event()
        self.generating = True
        self.update_status(note="generating… (Esc stops)")
        self._turn(op, text, self.cancel_event)

    @work(thread=True, group="engine")
    def _turn(self, op: str, text: str, cancel: threading.Event) -> None:
        try:
            if self.backend.current() is None:
                self.backend.new_chat(None, [], self.emit)
            if op == "send":
                self.backend.send(text, self.settings, cancel, self.emit)
            elif op == "edit":
                self.backend.edit_last(text, self.settings, cancel, self.emit)
            else:
                self.backend.regenerate(self.settings, cancel, self.emit)
        except Exception as exc:  # noqa: BLE001 - shown, the typed text goes back into the input
            self.post_message(TurnFailed(text if op != "regenerate" else "", exc, op))

    @on(BackendEvent)
    async def _backend_event(self, message: BackendEvent) -> None:
        event = message.event
        if isinstance(event, LoadProgress):
            self.update_status(event.message)
            if event.total and not self.ready:
                self.query_one(PrefillBar).steps("import", event.done, event.total)
        elif isinstance(event, PrefillProgress):
            self.query_one(PrefillBar).progress(event.done, event.total, event.eta_s)
        elif isinstance(event, TokenBatch) and self._answer is not None:
            self.hide_prefill()
            await self._answer.append(event.text)
        elif isinstance(event, TurnDone):
            await self._turn_done(event)

    async def _turn_done(self, done: TurnDone) -> None:
        self.hide_prefill()
        if self._answer is not None:
            await self._answer.finish(done.text, stats_line(done.stats.ttft_ms, done.stats.decode_tokens_per_s,
                                                            done.stats.finish_reason))
        self._answer, self.generating, self.show_resume = None, False, False
        self.update_status()
        self.refresh_lists()
        if done.stats.finish_reason == "context":
            used = f"{done.context_used:,}/{done.context_limit:,} tokens"
            self.offer_continue(f"The answer stopped at the context limit ({used}).")

    @on(TurnFailed)
    async def _turn_failed(self, message: TurnFailed) -> None:
        self.hide_prefill()
        self._answer, self.generating = None, False
        current = self.backend.current()
        if current is not None:
            await self.show_chat(current)
        chat_input = self.query_one(ChatInput)
        if message.text and not chat_input.text.strip():
            chat_input.text = message.text
        self.update_status()
        if (isinstance(message.error, ContextFullError) and message.op == "send" and current is not None
                and current.id is not None and current.messages):
            self.offer_continue(f"This chat is full: {message.error}.", message.text)
        else:
            self.notify_error(message.error)

    # --- views -----------------------------------------------------------------------------------
    async def show_chat(self, view: ChatView) -> None:
        """Render a chat (documents as a notice, then its messages) and update the status bar."""
        notices = ["Documents (cached prefix): " + ", ".join(view.documents)] if view.documents else []
        await self.query_one(MessageView).show(view.messages, notices)
        self.hide_prefill()
        self.update_status()

    def update_status(self, note: str = "") -> None:
        self.query_one(StatusBar).show(self.backend.status(), note, resume=self.show_resume)

    async def opened(self, view: ChatView) -> None:
        """After new/open/continue: show the chat (and how its KV got into the pool), refresh the sidebar, focus
        the input."""
        self.show_resume = True
        await self.show_chat(view)
        self.editing = False
        self.refresh_lists()
        self.query_one(ChatInput).focus()
