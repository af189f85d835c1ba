"""The real server most server tests share: one ``kvchat serve`` process per test module, on its own data dir."""

from __future__ import annotations

import pytest
from server_helpers import Server


@pytest.fixture(scope="module")
def server(tmp_path_factory, smol_info):
    """A started ``kvchat serve`` (the default model, the helpers' API key), stopped after the module."""
    srv = Server(tmp_path_factory.mktemp("serve") / "home").start()
    yield srv
    srv.stop()
