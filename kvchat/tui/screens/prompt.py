"""A one-line text dialog (rename, attach paths with completion); dismisses with the text or None."""

from __future__ import annotations

from pathlib import Path

from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.suggester import Suggester
from textual.widgets import Input, Static

from kvchat.tui.text import literal

PATH_SEPARATOR = ";"


class PathSuggester(Suggester):
    """Completes the last ``;``-separated path in the input against the file system (first match, sorted)."""

    def __init__(self):
        super().__init__(use_cache=False, case_sensitive=True)

    async def get_suggestion(self, value: str) -> str | None:
        head, sep, last = value.rpartition(PATH_SEPARATOR)
        typed = last.lstrip()
        if not typed:
            return None
        path = Path(typed).expanduser()
        parent, stem = (path, "") if typed.endswith("/") else (path.parent, path.name)
        try:
            names = sorted(p.name + ("/" if p.is_dir() else "") for p in parent.iterdir() if p.name.startswith(stem))
        except OSError:
            return None
        if not names or names[0] == stem:
            return None
        return value + names[0][len(stem):]


class PromptScreen(ModalScreen[str | None]):
    """Asks for one line of text; Enter submits, Esc cancels. ``paths=True`` adds path completion (→ accepts)."""

    BINDINGS = [("escape", "cancel", "Cancel")]

    def __init__(self, question: str, value: str = "", paths: bool = False):
        super().__init__(classes="dialog-screen")
        self.question, self.value, self.paths = question, value, paths

    def compose(self):
        with Vertical(classes="dialog"):
            yield Static(Content(literal(self.question)), classes="question")
            yield Input(self.value, suggester=PathSuggester() if self.paths else None, id="answer")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)


def split_paths(text: str) -> list[str]:
    """The paths of an attach answer: ``;`` separates them, except inside the name of an existing file.

    Read left to right, the longest run of ``;``-joined parts that names an
    existing file is one path (so ``notes;v2.txt`` attaches that file), else a
    part alone is (a missing file is then reported by name). Paths are
    stripped; empty parts are dropped.
    """
    parts, paths, i = text.split(PATH_SEPARATOR), [], 0
    while i < len(parts):
        end = next((j for j in range(len(parts), i + 1, -1) if _is_file(PATH_SEPARATOR.join(parts[i:j]))), i + 1)
        path = PATH_SEPARATOR.join(parts[i:end]).strip()
        if path:
            paths.append(path)
        i = end
    return paths


def _is_file(path: str) -> bool:
    return Path(path.strip()).expanduser().is_file()
