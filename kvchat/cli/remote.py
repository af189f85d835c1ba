"""``--server URL`` and ``--api-key-env VAR`` (the TUI's and ``kvchat ask``'s): which server, and its key."""

from __future__ import annotations

import argparse


def server_of_args(args: argparse.Namespace) -> str | None:
    """The server to use: ``--server`` (checked as ``KVCHAT_SERVER`` is), else ``KVCHAT_SERVER``; None for
    the local model.

    Raises:
        ValueError: ``--server`` is not an http(s) URL with a host; ``--api-key-env`` without a server.
    """
    from kvchat import settings
    from kvchat.server_address import base_url

    flag = getattr(args, "server", None)
    server = base_url(flag) if flag is not None else settings.server()
    if server is None and getattr(args, "api_key_env", None) is not None:
        raise ValueError("--api-key-env names the key of a server: give --server URL (or set KVCHAT_SERVER)")
    return server


def server_key(server: str, args: argparse.Namespace) -> str | None:
    """The API key for ``server`` (:func:`kvchat.remote.keys.api_key` with ``--api-key-env``)."""
    from kvchat.remote.keys import api_key

    return api_key(server, getattr(args, "api_key_env", None))


def remote_backend(server: str, args: argparse.Namespace):
    """The TUI's :class:`kvchat.tui.remote_backend.RemoteBackend` on ``server`` (``--model``: the server's
    model to use). Raises ValueError as :func:`server_key`."""
    from kvchat.tui.remote_backend import RemoteBackend

    return RemoteBackend(server, server_key(server, args), args.model)
