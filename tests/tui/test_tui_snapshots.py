"""SVG snapshots (pytest-textual-snapshot) of the main, cache and help screens at 110x32, on the FakeBackend.

Update after an intended UI change with ``pytest tests/tui/test_tui_snapshots.py --snapshot-update``
and review the SVGs in ``tests/tui/__snapshots__/``.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("pytest_textual_snapshot")

from kvchat.tui.app import KvchatApp  # noqa: E402
from kvchat.tui.fake_backend import FakeBackend  # noqa: E402
from kvchat.tui.widgets.chat_input import ChatInput  # noqa: E402

pytestmark = pytest.mark.tui

SIZE = (110, 32)
ANSWER = ("The heron nests **by the old mill**.\n\n```python\nprint('heron')\n```\n\n"
          "| bird | nest |\n|---|---|\n| heron | mill |")


async def until(pilot, condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await pilot.pause(0.02)


async def chat_with_an_answer(pilot) -> None:
    app = pilot.app
    screen = app.screen_stack[0]
    await until(pilot, lambda: screen.ready)
    screen.query_one(ChatInput).text = "Where does the heron nest?"
    screen.query_one(ChatInput).focus()
    await pilot.press("enter")
    await until(pilot, lambda: app.backend.current() and app.backend.current().messages and not screen.generating)
    await until(pilot, lambda: len(screen.query_one("#chats").children) == 1)
    screen.query_one(ChatInput).cursor_blink = False  # a blinking cursor makes the SVG depend on timing


def make_app() -> KvchatApp:
    return KvchatApp(FakeBackend(answers=[ANSWER]))


def test_main_screen(snap_compare):
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=chat_with_an_answer)


def test_cache_screen(snap_compare):
    async def open_cache(pilot):
        await chat_with_an_answer(pilot)
        await pilot.press("f5")
        await until(pilot, lambda: pilot.app.screen.query_one("DataTable").row_count == 1)

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=open_cache)


def test_help_screen(snap_compare):
    async def ready(pilot):
        await until(pilot, lambda: pilot.app.screen_stack[0].ready)
        pilot.app.screen_stack[0].query_one(ChatInput).cursor_blink = False

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=ready, press=["f1"])
