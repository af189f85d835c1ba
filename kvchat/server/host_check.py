"""The ``Host`` rule of a server without an API key (DNS rebinding), answered with an OpenAI-style error object.

A web page on ``evil.example`` whose name the attacker re-points at 127.0.0.1
reaches a loopback server with ``Host: evil.example``; only the loopback names
and the bound address are answered (as Starlette's ``TrustedHostMiddleware``,
whose refusal is a plain-text body; every kvchat error is an error object).
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from kvchat.server.protocol import ApiError


def host_name(header: str) -> str:
    """The host part of a ``Host`` header value, lower case: ``[::1]:8000`` → ``[::1]``, ``a:80`` → ``a``."""
    if header.startswith("["):
        end = header.find("]")
        return header[: end + 1].lower() if end > 0 else ""
    return header.split(":", 1)[0].lower()


class HostCheck:
    """ASGI middleware: HTTP requests whose ``Host`` names none of ``allowed`` get a 400 error object."""

    def __init__(self, app, allowed: list[str]):
        self.app, self.allowed = app, {a.lower() for a in allowed}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            given = Headers(scope=scope).get("host", "")
            if host_name(given) not in self.allowed:
                err = ApiError(400, f"the Host header {given!r} names none of {', '.join(sorted(self.allowed))} "
                                    "(a server without --api-key answers only its own names: DNS rebinding)",
                               param="Host", code="invalid_host")
                await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)
