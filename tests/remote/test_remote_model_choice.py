"""A model the server does not have, asked for at start (``--model``): the TUI says so, knows the server's list,
and Ctrl+L picks from it; no restart needed."""

from __future__ import annotations

import pytest
from remote_stub import KEY, MODEL, StubServer
from test_remote_bad_servers import SIZE, status, type_and_send, until

from kvchat.tui.app import KvchatApp
from kvchat.tui.remote_backend import RemoteBackend
from kvchat.tui.screens.choice import ChoiceScreen


@pytest.mark.asyncio
@pytest.mark.tui
async def test_a_model_the_server_lacks_is_replaced_by_one_picked_from_its_list(kvchat_home):
    with StubServer() as stub:
        backend = RemoteBackend(stub.url, KEY, model="no-such-model")
        app = KvchatApp(backend)
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen_stack[0]
            await until(pilot, lambda: screen.ready)
            assert "no model 'no-such-model'" in backend.status().message and "Ctrl+L" in backend.status().message
            assert backend.models() == [MODEL]
            await pilot.press("ctrl+l")
            await until(pilot, lambda: isinstance(app.screen, ChoiceScreen))
            await pilot.press("1")  # the first choice
            await until(pilot, lambda: backend.status().model == MODEL)
            await type_and_send(pilot, app, "Hello?")
            await until(pilot, lambda: backend.current() is not None and len(backend.current().messages) == 2
                        and not screen.generating)
            assert [m.text for m in backend.current().messages] == ["Hello?", "Half an answer"]
            assert "no model" not in status(app)
        assert [r["model"] for r in stub.requests] == [MODEL]
