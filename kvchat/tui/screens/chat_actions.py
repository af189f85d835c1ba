"""The chat screen's user actions (keys in :data:`kvchat.tui.actions.ACTIONS`): dialogs, then backend calls."""

from __future__ import annotations

import os

from textual.timer import Timer

from kvchat.conversation.continuation import Continuation
from kvchat.conversation.views import SYSTEM_PROMPT_FIXED
from kvchat.paths import data_dir
from kvchat.tui.export import export_chat, export_dir
from kvchat.tui.screens.busy import Act, Verdict
from kvchat.tui.screens.cache import CacheScreen
from kvchat.tui.screens.choice import ChoiceScreen
from kvchat.tui.screens.confirm import ConfirmScreen
from kvchat.tui.screens.help import HelpScreen
from kvchat.tui.screens.prompt import PromptScreen, split_paths
from kvchat.tui.screens.settings import SettingsScreen
from kvchat.tui.screens.system_prompt import SystemPromptScreen
from kvchat.tui.text import one_line

APPLE_TERMINAL = "Apple_Terminal"
SEARCH_PAUSE_S = 0.15  # a search runs once typing pauses this long: one query per burst of keys


class ChatActions:
    """Mixed into :class:`kvchat.tui.screens.chat.ChatScreen` (uses its ``backend``, ``run_engine``, widgets).

    Every action that needs the engine asks the screen's ``allow`` (:mod:`kvchat.tui.screens.busy`) first; an
    action behind a dialog asks before the dialog opens (no question asked in vain) and again when it runs.
    """

    _search_timer: Timer | None = None  # the search waiting for a pause in typing
    draft = ""  # what the input held when F4 put the last message there: back in the input after the edit

    # --- sidebar (messages up from kvchat.tui.widgets.sidebar.Sidebar) ------------------------------
    def on_sidebar_search_changed(self, event) -> None:
        """Search once typing pauses (:data:`SEARCH_PAUSE_S`); Enter searches now and opens the first match."""
        if self._search_timer is not None:
            self._search_timer.stop()
        if event.submitted:
            self.refresh_lists(open_first=True)
        else:
            self._search_timer = self.set_timer(SEARCH_PAUSE_S, self.refresh_lists)

    def on_sidebar_chat_chosen(self, event) -> None:
        current = self.backend.current()
        if current is None or current.id != event.chat_id:
            self.run_engine(self.backend.open_chat, event.chat_id, then=self.opened)

    def on_sidebar_document_chosen(self, event) -> None:
        self.attach([event.path])

    # --- key actions ---------------------------------------------------------------------------------
    def action_help(self) -> None:
        self.app.push_screen(HelpScreen())

    def action_cache(self) -> None:
        self.app.push_screen(CacheScreen(self.backend), lambda _: self.refresh_lists())

    def action_search(self) -> None:
        self.query_one("#search").focus()

    def action_new_chat(self) -> None:
        self.run_engine(self.backend.new_chat, None, [], self.emit, then=self.opened)

    def _may_change_chat(self) -> bool:
        return self.allow(Act.CHANGE_CHAT).verdict is Verdict.ALLOW

    def action_attach(self) -> None:
        if not self._may_change_chat():
            return

        def attach(answer: str | None) -> None:
            paths = split_paths(answer or "")
            if paths:
                self.attach(paths)

        question = ("Attach text files: separate several with ; (a file whose name contains ; is taken whole) "
                    "— → completes a path")
        self.app.push_screen(PromptScreen(question, paths=True), attach)

    def action_cancel(self) -> None:
        if self.allow(Act.CANCEL).verdict is Verdict.CANCEL:
            self.cancel_event.set()
            self.job_note = "stopping…" if self.generating else "cancelling the attach…"
            self.update_status()
        elif self.editing:
            self.editing = False
            self.query_one("#input").load(self.take_draft())
            self.app.notify("edit cancelled; the input holds what you had typed before it")

    def _chat_with_answer(self):
        view = self.backend.current()
        if view is None or view.id is None or not view.messages:
            self.app.notify("this chat has no answer yet", severity="warning")
            return None
        return view

    async def action_regenerate(self) -> None:
        if self.allow(Act.REGENERATE).verdict is Verdict.ALLOW and self._chat_with_answer():
            await self.start_turn("regenerate", "")

    def action_edit_last(self) -> None:
        if self.allow(Act.EDIT).verdict is not Verdict.ALLOW:
            return  # the input keeps what is typed there
        view = self._chat_with_answer()
        if view is None:
            return
        chat_input = self.query_one("#input")
        if not self.editing:  # F4 again while editing: the draft is the one from before the first
            self.draft = chat_input.text
        chat_input.load(view.messages[-2].text)
        chat_input.focus()
        self.editing = True
        self.app.notify("editing the last message: Enter replaces it and its answer, Esc cancels")

    def take_draft(self) -> str:
        """The text typed before F4 (once: it is cleared here)."""
        draft, self.draft = self.draft, ""
        return draft

    def action_rename(self) -> None:
        view = self.backend.current()
        if view is None or view.id is None:
            self.app.notify("send a message first: a new chat gets its title from it", severity="warning")
            return

        def rename(title: str | None) -> None:
            if title and title.strip():
                # a store write that changes neither the open chat nor the engine: allowed while a job runs
                self._engine_call(self.backend.rename_chat, (view.id, title.strip()), lambda _: self.refresh_lists(),
                                  None)

        self.app.push_screen(PromptScreen("Rename chat", value=view.title), rename)

    def action_delete(self) -> None:
        if not self._may_change_chat():
            return
        view = self.backend.current()
        if view is None or view.id is None:
            self.app.notify("no stored chat is open", severity="warning")
            return

        def delete(yes: bool | None) -> None:
            if yes:
                self.run_engine(self.backend.delete_chat, view.id, then=self._deleted)

        question = f"Delete chat “{one_line(view.title)}” and its cache?"
        self.app.push_screen(ConfirmScreen(question, yes="Delete"), delete)

    async def _deleted(self, _) -> None:
        await self.query_one("#messages").show([], [])
        self.update_status("chat deleted")
        self.refresh_lists()

    def action_system_prompt(self) -> None:
        if not self._may_change_chat():
            return
        view = self.backend.current()
        if view is not None and view.messages:
            self.app.notify(f"{SYSTEM_PROMPT_FIXED} (Ctrl+N starts a new chat)", severity="warning")
            return

        def save(text: str | None) -> None:
            if text is not None:
                self.run_engine(self._set_system_prompt, text, then=self.opened)

        self.app.push_screen(SystemPromptScreen(view.system_prompt if view else ""), save)

    def _set_system_prompt(self, text: str):
        if self.backend.current() is None:
            self.backend.new_chat(None, [], self.emit)
        return self.backend.set_system_prompt(text)

    def action_settings(self) -> None:
        def save(settings) -> None:
            if settings is not None:
                self.settings = settings
                self.app.notify("generation settings saved")

        self.app.push_screen(SettingsScreen(self.settings), save)

    def action_model(self) -> None:
        """Pick among the backend's models (a server's list; a local run has its one model)."""
        models, current = self.backend.models(), self.backend.status().model
        if not models:
            self.app.notify(self.not_ready() or "no model to pick yet", severity="warning", markup=False)
            return
        if len(models) == 1 and models[0] == current:
            self.app.notify(f"{models[0]} is the only model here", markup=False)
            return
        if not self._may_change_chat():
            return

        def use(key: str | None) -> None:
            if key is not None:
                self.run_engine(self.backend.use_model, models[int(key)], then=lambda _: self.model_chosen())

        labels = [(str(i), f"{m} (in use)" if m == current else m) for i, m in enumerate(models)]
        self.app.push_screen(ChoiceScreen("Answer the next turns with:", labels, no="Keep"), use)

    def model_chosen(self) -> None:
        """After :meth:`action_model`: say which model answers now."""
        self.update_status()
        self.app.notify(f"the next turns go to {self.backend.status().model}", markup=False)

    def action_copy_last(self) -> None:
        view = self.backend.current()
        answers = [m.text for m in view.messages if m.role == "assistant"] if view else []
        if not answers:
            self.app.notify("no answer to copy yet", severity="warning")
            return
        self.app.copy_to_clipboard(answers[-1])
        if os.environ.get("TERM_PROGRAM") == APPLE_TERMINAL:
            self.app.notify("this terminal ignores clipboard requests (OSC 52); use Ctrl+S to export instead",
                            severity="warning")
        else:
            self.app.notify(f"copied the last answer ({len(answers[-1]):,} characters)")

    def action_export(self) -> None:
        view = self.backend.current()
        if view is None or not view.messages:
            self.app.notify("nothing to export yet", severity="warning")
            return
        try:
            path = export_chat(view, export_dir(data_dir() / "exports"))
        except OSError as exc:
            self.notify_error(exc)
            return
        self.app.notify(f"exported to {path}", markup=False)

    def offer_continue(self, reason: str, message: str = "") -> None:
        """Say the chat is full and offer the ways on that exist (never a silent truncation): a new chat with the
        documents and the last turns that fit, else one with the last turns without the documents or one on the
        documents alone (:mod:`kvchat.conversation.continuation`). ``message``: the message that did not fit,
        sent in the new chat."""
        max_tokens = self.settings.max_tokens
        self.run_engine(self.backend.continuation, message, max_tokens,
                        then=lambda plan: self._ask_continue(reason, message, max_tokens, plan))

    def _ask_continue(self, reason: str, message: str, max_tokens: int, plan: Continuation) -> None:
        def answer(way: str | None) -> None:
            if way:
                self.run_engine(self.backend.continue_in_new_chat, way, message, max_tokens,
                                then=lambda view: self._continued(view, message))

        ways = plan.offered()
        if ways == ["all"]:
            question = f"{reason}\nContinue in a new chat with {plan.choice_text('all')}, leaving {plan.room_text()}?"
            self.app.push_screen(ConfirmScreen(question, yes="Continue in a new chat", no="Stay"),
                                 lambda yes: answer("all" if yes else None))
        elif ways:
            question = f"{reason}\n{plan.no_room_line().capitalize()}.\nContinue in a new chat with:"
            self.app.push_screen(ChoiceScreen(question, [(w, plan.choice_text(w)) for w in ways], no="Stay"), answer)
        else:
            self.app.notify(f"{reason} {plan.no_room_line().capitalize()}.", severity="error", markup=False, timeout=8)

    async def _continued(self, view, message: str) -> None:
        """The new chat is open: say what it carries, then send the message that did not fit."""
        await self.opened(view)
        turns = len(view.messages) // 2
        carried = ([", ".join(view.documents)] if view.documents else []) + ([f"{turns} turn{'s' * (turns != 1)}"]
                                                                             if turns else [])
        self.app.notify(f"continued in a new chat with {' and '.join(carried) or 'the system prompt alone'}",
                        markup=False)
        if message:  # this runs inside the continuation's own job, so nothing else can have started
            chat_input = self.query_one("#input")
            if chat_input.text.startswith(message):  # given back before what was typed since: keep the rest
                chat_input.load(chat_input.text[len(message):].removeprefix("\n"))
            await self.start_turn("send", message)
