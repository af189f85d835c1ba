"""``--server URL`` and ``--api-key-env VAR`` (the TUI's and ``kvchat ask``'s): which server, and its key."""

from __future__ import annotations

import argparse

# the options that set up a local model (kvchat.cli.main's _add_model_args but --model, which names the server's
# model with --server): a server runs its own, so with one they would do nothing
LOCAL_ONLY = {"kv_dtype": "--kv-dtype", "dtype": "--dtype", "weights": "--weights", "gpu_memory": "--gpu-memory",
              "threads": "--threads"}


def server_of_args(args: argparse.Namespace) -> str | None:
    """The server to use: ``--server`` (checked as ``KVCHAT_SERVER`` is), else ``KVCHAT_SERVER``; None for
    the local model.

    Raises:
        ValueError: ``--server`` is not an http(s) URL with a host (or holds a user or password);
            ``--api-key-env`` without a server; a local model's option (:data:`LOCAL_ONLY`) with a server.
    """
    from kvchat import settings
    from kvchat.server_address import base_url

    flag = getattr(args, "server", None)
    server = base_url(flag) if flag is not None else settings.server()
    if server is None and getattr(args, "api_key_env", None) is not None:
        raise ValueError("--api-key-env names the key of a server: give --server URL (or set KVCHAT_SERVER)")
    given = [option for name, option in LOCAL_ONLY.items() if getattr(args, name, None) is not None]
    if server is not None and given:
        source = "--server" if flag is not None else "KVCHAT_SERVER"
        raise ValueError(f"{', '.join(given)} set{'s' * (len(given) == 1)} up a local model; with {source} the "
                         f"server's own settings apply: drop {'it' if len(given) == 1 else 'them'}")
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
