"""Ctrl+L picks the model of the next turns among the backend's (a server's list; a local run's one model)."""

from __future__ import annotations

import pytest
from test_tui_app import SIZE, Harness, ready, shown, until

from kvchat.tui.fake_backend import FakeBackend
from kvchat.tui.screens.choice import ChoiceScreen
from kvchat.tui.widgets.status_bar import StatusBar

pytestmark = [pytest.mark.asyncio, pytest.mark.tui]


async def test_ctrl_l_lists_the_models_and_the_next_turns_use_the_pick():
    h = Harness(FakeBackend(model_names=("org/small-1.5", "org/large-70b")))
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await pilot.press("ctrl+l")
        await until(pilot, lambda: isinstance(h.app.screen, ChoiceScreen))
        labels = [str(b.label) for b in h.app.screen.query("Button.choice")]
        assert labels == ["1. org/small-1.5 (in use)", "2. org/large-70b"]
        await pilot.press("2")
        await until(pilot, lambda: h.backend.status().model == "org/large-70b" and h.screen.job is None)
        await pilot.pause()
        assert "org/large-70b" in shown(h.screen.query_one(StatusBar))
        assert "the next turns go to org/large-70b" in h.notes
        await h.send(pilot, "hello")
        assert h.backend.status().model == "org/large-70b"


async def test_ctrl_l_with_one_model_says_so():
    h = Harness(FakeBackend())
    async with h.app.run_test(size=SIZE) as pilot:
        await ready(pilot, h)
        await pilot.press("ctrl+l")
        await pilot.pause()
        assert h.notes == ["fake-model is the only model here"] and not isinstance(h.app.screen, ChoiceScreen)
