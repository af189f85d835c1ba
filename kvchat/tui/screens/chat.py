"""The main screen: sidebar, chat pane, prefill bar, input, status bar; runs backend work in thread workers.

Engine work goes through ``@work(thread=True)`` workers; their backend
events come back as :class:`BackendEventPosted` messages, one per token *batch*
(``post_message`` is thread-safe), never a blocking call per token. The
user actions (dialogs) are in :class:`kvchat.tui.screens.chat_actions.ChatActions`.
One job runs at a time (:attr:`ChatScreen.job`); what each action does meanwhile is decided in one
place, :func:`kvchat.tui.screens.busy.decide`, asked through :meth:`ChatScreen.allow`.
"""

from __future__ import annotations

import asyncio
import inspect
import sqlite3
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from textual import on, work
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer

from kvchat.conversation.events import AttachStep, BackendEvent, LoadProgress, PrefillProgress, TokenBatch, TurnDone
from kvchat.conversation.views import AttachCancelled, ChatView, ContextFullError
from kvchat.engine.turn import SamplingParams
from kvchat.store.errors import StoreError
from kvchat.tui.actions import ACTIONS
from kvchat.tui.backend import Backend, StoreUnavailableError
from kvchat.tui.screens.busy import Act, Decision, Job, Verdict, decide
from kvchat.tui.screens.chat_actions import ChatActions
from kvchat.tui.screens.messages import BackendEventPosted, CannotRun, TurnFailed
from kvchat.tui.text import one_line
from kvchat.tui.widgets.chat_input import ChatInput
from kvchat.tui.widgets.message import MessageBlock, stats_line
from kvchat.tui.widgets.message_view import MessageView
from kvchat.tui.widgets.prefill_bar import PrefillBar
from kvchat.tui.widgets.sidebar import Sidebar
from kvchat.tui.widgets.status_bar import StatusBar


class ChatScreen(ChatActions, Screen):
    """See the module docstring. ``job``: the engine work in flight (None: none); ``queued``: a message sent
    during an attach, for the document's chat."""

    BINDINGS = [Binding(a.key, a.action, a.title, show=a.show) for a in ACTIONS]

    def __init__(self, backend: Backend):
        super().__init__()
        self.backend = backend
        self.settings = SamplingParams()
        self.ready = False
        self.load_error = ""
        self.editing = False
        self.show_resume = False  # the status bar's resume line describes an open until the next turn finishes
        self.cancel_event = threading.Event()  # the running job's: Esc and quit set it
        self.job: Job | None = None
        self.job_note = ""  # the status bar's second line while the job runs
        self.queued: str | None = None
        self.quitting = False  # the app is saving and exiting: no more list refreshes (their widgets go away)
        self._attaching = ("", "")  # the running attach's file names and its current step, for the status line
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
    def emit(self, event: BackendEvent) -> None:
        """Backend ``emit`` callback: thread-safe, one message per event."""
        self.post_message(BackendEventPosted(event))

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
        if self.quitting:
            return
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
        if query != sidebar.query_text or self.quitting:
            return
        async with self._lists_lock:
            await sidebar.set_chats(chats, current_id)
            await sidebar.set_documents(docs)
        if open_first:
            sidebar.open_chat()

    @property
    def generating(self) -> bool:
        """True while an answer streams."""
        return self.job is Job.TURN

    def not_ready(self) -> str:
        """Why the engine cannot work at all ("" once the model is loaded)."""
        return "" if self.ready else self.load_error or "the model is still loading"

    def allow(self, act: Act) -> Decision:
        """:func:`kvchat.tui.screens.busy.decide` for ``act`` now; a refusal is shown as one notice."""
        decision = decide(act, self.job, self.queued is not None, self.not_ready())
        if decision.verdict is Verdict.REFUSE:
            self.app.notify(decision.reason, severity="warning", markup=False)
        return decision

    def run_engine(self, fn: Callable[..., Any], *args: Any, then: Callable[[Any], Any] | None = None) -> None:
        """Run ``fn(*args)`` on a worker thread as a short job that changes the open chat (when
        :meth:`allow` says so); ``then(result)`` on the UI thread before the job ends."""
        if self.allow(Act.CHANGE_CHAT).verdict is Verdict.ALLOW:
            self.start_job(Job.CALL)
            self._engine_call(fn, args, then, Job.CALL)

    def attach(self, paths: Sequence[str]) -> None:
        """Start a chat on the documents at ``paths`` (read, tokenize, prefill): shown from its first moment,
        Esc cancels it, a message sent meanwhile waits for its chat."""
        if self.allow(Act.CHANGE_CHAT).verdict is not Verdict.ALLOW:
            return
        self._attaching = (", ".join(Path(p).name for p in paths), "reading")
        cancel = self.start_job(Job.ATTACH)
        self.show_attach_step()
        self._engine_call(self.backend.new_chat, (None, list(paths), self.emit, cancel), self.opened, Job.ATTACH)

    def start_job(self, job: Job, note: str = "") -> threading.Event:
        """Mark ``job`` as running (with its own cancel event, returned) and show ``note``."""
        self.job, self.job_note, self.cancel_event = job, note, threading.Event()
        self.update_status()
        return self.cancel_event

    def end_job(self, job: Job) -> None:
        """``job`` is over: the next action may run (the status bar is the caller's to update)."""
        if self.job is job:
            self.job, self.job_note = None, ""

    def show_attach_step(self, step: str | None = None) -> None:
        """The status line of the running attach: its files, ``step`` (None: the last one), a queued
        message, how to cancel."""
        names, step = self._attaching[0], step or self._attaching[1]
        self._attaching = (names, step)
        waiting = " · 1 message waits for it" if self.queued is not None else ""
        self.job_note = f"attaching {names}: {step}{waiting} (Esc cancels)"
        self.update_status()

    def stop_for_quit(self) -> None:
        """Quit: cancel the running job (an attach keeps nothing, an answer stops and is kept)."""
        if self.allow(Act.QUIT).verdict is Verdict.CANCEL:
            self.cancel_event.set()
        self.quitting = True
        self.job_note = ""
        self.update_status(note="saving cache…")

    @work(thread=True, group="engine")
    def _engine_call(self, fn, args, then, job: Job | None) -> None:
        try:
            result = fn(*args)
        except Exception as exc:  # noqa: BLE001 - shown as a notification
            self.app.call_from_thread(self._job_failed, job, exc)
            return
        self.app.call_from_thread(self._job_done, job, then, result)

    async def _job_done(self, job: Job | None, then, result) -> None:
        """``then(result)`` while the job still holds (no other action interleaves its awaits), then the
        message queued during an attach is sent to the chat that opened. ``job`` None: a store call that
        ran beside the job (a rename), which leaves the job's state alone."""
        if job is not None:
            self.job_note = ""
        try:
            if then is not None and inspect.isawaitable(out := then(result)):
                await out
        finally:
            if job is not None:
                self.end_job(job)
        if job is Job.ATTACH and self.queued is not None and self.job is None:
            text, self.queued = self.queued, None
            await self.start_turn("send", text)

    def _job_failed(self, job: Job | None, exc: Exception) -> None:
        queued = None
        if job is not None:
            self.end_job(job)
            self.hide_prefill()
            queued, self.queued = self.queued, None
        if queued is not None:
            self.give_back(queued)
        if isinstance(exc, AttachCancelled):
            back = "; your message is back in the input" if queued is not None else ""
            self.app.notify(f"{exc}{back}", markup=False)
        else:
            self.notify_error(exc)
        self.update_status()

    def give_back(self, text: str) -> None:
        """Put an unsent message back into the input (before what is typed there now)."""
        chat_input = self.query_one(ChatInput)
        chat_input.load(text if not chat_input.text.strip() else f"{text}\n{chat_input.text}")

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
        op = "edit" if self.editing else "send"
        decision = self.allow(Act.EDIT if self.editing else Act.SEND)
        if decision.verdict is Verdict.REFUSE:
            return  # the text stays in the input
        self.query_one(ChatInput).clear()
        if op == "edit":  # the edit is sent: what was typed before F4 comes back
            self.query_one(ChatInput).load(self.take_draft())
        if decision.verdict is Verdict.QUEUE:
            self.queued = text
            self.app.notify("your message is sent to the document's chat once the document is ready")
            self.show_attach_step()
            return
        await self.start_turn(op, text)

    async def start_turn(self, op: str, text: str) -> None:
        """Show the user message and an empty answer, then generate in a worker (op: send, regenerate, edit).

        The caller asked :meth:`allow`; the turn's job starts before any await, so nothing interleaves."""
        cancel = self.start_job(Job.TURN, "generating… (Esc stops)")
        view = self.query_one(MessageView)
        if op in ("regenerate", "edit"):
            last = view.blocks()
            for block in last[-2 if op == "edit" else -1:]:
                await block.remove()
        if op != "regenerate":
            await view.add("user", text)
        self._answer = await view.add("assistant")
        self.editing = False
        self._turn(op, text, cancel)

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
        except Exception as exc:  # noqa: BLE001 - shown, the typed text goes back into the input unless stored
            self.post_message(TurnFailed("" if op == "regenerate" or _question_stored(exc) else text, exc, op))

    @on(BackendEventPosted)
    async def _backend_event(self, message: BackendEventPosted) -> None:
        event = message.event
        if isinstance(event, LoadProgress):
            self.update_status(event.message)
            if event.total and not self.ready:
                self.query_one(PrefillBar).steps("import", event.done, event.total)
        elif isinstance(event, AttachStep) and self.job is Job.ATTACH:
            self.show_attach_step(event.message)
        elif isinstance(event, PrefillProgress):
            self.query_one(PrefillBar).progress(event.done, event.total, event.eta_s)
            if self.job is Job.ATTACH:
                self.show_attach_step(f"prefilling {event.done:,} / {event.total:,} tokens")
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
        self._answer, self.show_resume = None, False
        self.end_job(Job.TURN)
        self.update_status()
        self.refresh_lists()
        if done.stats.finish_reason == "context":
            used = f"{done.context_used:,}/{done.context_limit:,} tokens"
            self.offer_continue(f"The answer stopped at the context limit ({used}).")

    @on(TurnFailed)
    async def _turn_failed(self, message: TurnFailed) -> None:
        self.hide_prefill()
        self._answer = None
        self.end_job(Job.TURN)
        current = self.backend.current()
        if current is not None:
            await self.show_chat(current)
        if message.text:
            self.give_back(message.text)
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
        """Show the backend's counters; the second line is ``note``, else the running job's line."""
        self.query_one(StatusBar).show(self.backend.status(), note or self.job_note, resume=self.show_resume)

    async def opened(self, view: ChatView) -> None:
        """After new/open/continue: show the chat (and how its KV got into the pool), refresh the sidebar, focus
        the input."""
        self.show_resume = True
        await self.show_chat(view)
        if self.editing:  # the edit was of the chat left behind: what was typed before F4 comes back
            self.editing = False
            self.query_one(ChatInput).load(self.take_draft())
        self.refresh_lists()
        self.query_one(ChatInput).focus()


def _question_stored(exc: Exception) -> bool:
    """Whether the failed turn's question is in the chat already (a server cut the answer after the question
    and the part that came were stored): giving it back would send it twice."""
    from kvchat.remote.client import AnswerCut  # only a server's turn is stored when it fails

    return isinstance(exc, AnswerCut) and exc.chat_id is not None
