"""A server's address as kvchat records it, and whether reaching it sends text unencrypted (stdlib only:
:mod:`kvchat.settings` checks ``KVCHAT_SERVER`` with it before anything else is imported)."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("localhost",)
SERVER_PREFIX = "server:"  # a remote chat's model_fingerprint: this, then the server's base_url


def base_url(url: str) -> str:
    """``url`` as kvchat records a server: scheme, host, port and path, without a trailing ``/`` or ``/v1``
    (``http://gpu-box:8000/v1/`` → ``http://gpu-box:8000``).

    Raises:
        ValueError: not an ``http://`` or ``https://`` URL with a host (and a port in 0..65535, if any); a URL
            with a user or password in it (``http://user:pass@host``: it would be recorded with each chat and
            shown in the status bar, so the line does not repeat the URL).
    """
    credentials = ValueError("the server URL holds a user or password (user:pass@host); give the server without "
                             "them, and its API key with --api-key-env VAR or the data dir's server-keys.toml")
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - read for its check: a port outside 0..65535 or not a number raises
    except ValueError as exc:  # an unclosed IPv6 bracket, a port out of range
        if "@" in url:  # the line must not echo a password
            raise credentials from None
        raise ValueError(f"the server URL {url!r} is not a URL: {exc}") from None
    if "@" in parts.netloc or (parts.scheme not in ("http", "https") and "@" in url):
        raise credentials
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"the server must be an http:// or https:// URL with a host, got {url!r}")
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return f"{parts.scheme}://{parts.netloc}{path}"


def plain_http_warning(url: str) -> str | None:
    """The warning for a server reached over plain ``http://`` on a host that is not loopback (the messages
    and the key cross the network unencrypted), else None."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        return None
    host = parts.hostname or ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host in LOOPBACK_NAMES
    if loopback:
        return None
    return (f"{url} is plain http:// to another host: the messages and the API key cross the network "
            "unencrypted; use https:// or an SSH tunnel")


def server_fingerprint(url: str) -> str:
    """The ``model_fingerprint`` a chat held with the server ``url`` (a :func:`base_url`) is stored under."""
    return SERVER_PREFIX + url


def server_of(model_fingerprint: str | None) -> str | None:
    """The server a stored chat is held with (its ``model_fingerprint`` names it), None for a local chat."""
    if model_fingerprint and model_fingerprint.startswith(SERVER_PREFIX):
        return model_fingerprint[len(SERVER_PREFIX):]
    return None
