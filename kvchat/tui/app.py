"""The kvchat Textual app: ``kvchat`` with no sub-command runs :func:`run_app`.

The first frame is drawn before torch or the model is imported: this module
imports only Textual and the backend boundary; the real backend loads the
model in a worker thread after mount (``ChatScreen._load``).
"""

from __future__ import annotations

import sys
from functools import partial
from importlib.resources import files
from typing import Iterable

from textual import work
from textual.app import App, SystemCommand
from textual.screen import Screen

from kvchat.tui.actions import ACTIONS
from kvchat.tui.backend import Backend
from kvchat.tui.screens.chat import ChatScreen

CSS_FILE = files("kvchat.assets") / "kvchat.tcss"
EXIT_CANNOT_RUN = 2  # as the CLI's usage errors: the data dir or database cannot be used
EXIT_NOT_SAVED = 1  # quit, but flushing the cache (or closing the store) failed


class KvchatApp(App[int]):
    """Chat screen + dialogs over a :class:`kvchat.tui.backend.Backend` (real or fake)."""

    TITLE = "kvchat"
    CSS_PATH = str(CSS_FILE)

    def __init__(self, backend: Backend):
        super().__init__()
        self.backend = backend
        self._shut_down = False
        self.error_line = ""  # printed by run_app after the terminal is restored

    def get_default_screen(self) -> Screen:
        return ChatScreen(self.backend)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Textual's own commands (themes, keys, quit) plus every kvchat action, named as in F1 help."""
        yield from super().get_system_commands(screen)
        if isinstance(screen, ChatScreen):
            for a in ACTIONS:
                if not a.action.startswith("app."):
                    yield SystemCommand(a.title, f"{a.help} ({a.key})", partial(screen.run_action, a.action))

    async def action_quit(self) -> None:
        """Stop generation or an attach, flush the backend's queued work ("saving cache…"), then exit."""
        screen = self.screen if isinstance(self.screen, ChatScreen) else None
        if screen is not None:
            screen.stop_for_quit()
        self._flush_and_exit()

    def cannot_run(self, reason: str) -> None:
        """Exit with :data:`EXIT_CANNOT_RUN`; ``reason`` (one line) is printed once the terminal is restored."""
        if not self.error_line:
            self.error_line = reason
            self.exit(return_code=EXIT_CANNOT_RUN)

    @work(thread=True, exclusive=True, group="quit")
    def _flush_and_exit(self) -> None:
        ok = self.shutdown_backend()
        self.call_from_thread(self.exit, return_code=self.return_code or (0 if ok else EXIT_NOT_SAVED))

    def shutdown_backend(self) -> bool:
        """Call ``backend.shutdown()`` once (quit action, or :func:`run_app` after another kind of exit).

        Returns False when it failed (e.g. the disk is full or read-only): the
        failure becomes :attr:`error_line`, never a traceback; the chats' text
        is stored at every turn, so only cache snapshots can be lost.
        """
        if self._shut_down:
            return True
        self._shut_down = True
        try:
            self.backend.shutdown()
        except Exception as exc:  # noqa: BLE001 - quitting must not end in a traceback
            detail = " ".join(str(exc).split()) or type(exc).__name__
            self.error_line = self.error_line or f"saving the KV cache at quit failed ({detail}); chats are kept"
            return False
        return True


def run_app(model: str | None = None, kv_dtype: str = "fp8", threads: int | None = None,
            backend: Backend | None = None) -> int:
    """Run the TUI until quit; returns the exit code. ``backend`` defaults to the real engine for ``model``.

    Where the app cannot run (the data dir or its database cannot be used) or
    the cache could not be saved at quit, one ``kvchat: error: …`` line goes
    to stderr after the terminal is restored and the exit code is non-zero.
    """
    if backend is None:
        from kvchat.tui.real_backend import RealBackend

        backend = RealBackend(model, kv_dtype, threads=threads)
    app = KvchatApp(backend)
    try:
        app.run()
    finally:
        ok = app.shutdown_backend()
    if app.error_line:
        print(f"kvchat: error: {app.error_line}", file=sys.stderr)
    return app.return_code or (0 if ok else EXIT_NOT_SAVED)
