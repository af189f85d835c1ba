"""The kvchat Textual app: ``kvchat`` with no sub-command runs :func:`run_app`.

The first frame is drawn before torch or the model is imported: this module
imports only Textual and the backend boundary; the real backend loads the
model in a worker thread after mount (``ChatScreen._load``).
"""

from __future__ import annotations

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


class KvchatApp(App[int]):
    """Chat screen + dialogs over a :class:`kvchat.tui.backend.Backend` (real or fake)."""

    TITLE = "kvchat"
    CSS_PATH = str(CSS_FILE)

    def __init__(self, backend: Backend):
        super().__init__()
        self.backend = backend
        self._shut_down = False

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
        """Stop generation, flush the backend's queued work ("saving cache…"), then exit."""
        screen = self.screen if isinstance(self.screen, ChatScreen) else None
        if screen is not None:
            screen.cancel_event.set()
            screen.update_status(note="saving cache…")
        self._flush_and_exit()

    @work(thread=True, exclusive=True, group="quit")
    def _flush_and_exit(self) -> None:
        self.shutdown_backend()
        self.call_from_thread(self.exit, 0)

    def shutdown_backend(self) -> None:
        """Call ``backend.shutdown()`` once (quit action, or :func:`run_app` after another kind of exit)."""
        if not self._shut_down:
            self._shut_down = True
            self.backend.shutdown()


def run_app(model: str | None = None, kv_dtype: str = "fp8", threads: int | None = None,
            backend: Backend | None = None) -> int:
    """Run the TUI until quit; returns the exit code. ``backend`` defaults to the real engine for ``model``."""
    if backend is None:
        from kvchat.tui.real_backend import RealBackend

        backend = RealBackend(model, kv_dtype, threads=threads)
    app = KvchatApp(backend)
    try:
        app.run()
    finally:
        app.shutdown_backend()
    return app.return_code or 0
