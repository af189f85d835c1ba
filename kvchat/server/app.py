"""The Starlette app: routes, Bearer auth, body limit, SSE streaming; all engine work goes to the scheduler.

Routes: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/chat/completions`` (streaming as Server-Sent Events, ``data: {chunk}``
lines ending with ``data: [DONE]``, as the OpenAI API). Every error is an
OpenAI-style error object (:class:`kvchat.server.protocol.ApiError`); a stream
that fails or is cut (shutdown) ends with ``data: {"error": ...}`` and no
``[DONE]``, as OpenAI's streaming errors do, so no client takes it as complete.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvchat.server.choices import Choices
from kvchat.server.host_check import HostCheck
from kvchat.server.protocol import ApiError, parse_chat_request

JSON = "application/json"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")  # Host header values a server without --api-key accepts
MAX_BODY_BYTES = 8 * 2**20  # a request body beyond this gets 413 (a 100K-token history is ~0.5 MB of JSON)


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def create_app(scheduler_factory, model_name: str, api_key: str | None = None, host: str = "127.0.0.1") -> Starlette:
    """The ASGI app. ``scheduler_factory()`` builds the :class:`Scheduler` at startup (stopped at shutdown);
    ``api_key``: every ``/v1`` route needs ``Authorization: Bearer <api_key>``, and ``/health`` answers a
    request without it only its ``status`` (the counters and the model name are for key holders).

    Without ``api_key`` (loopback only, see :mod:`kvchat.cli.serve`) a web page the user opens must not be
    able to drive the server: a POST needs ``Content-Type: application/json`` (415 otherwise; a browser
    sends that cross-origin only after a CORS preflight, which this server never grants), and the
    ``Host`` header must name a loopback address or ``host``, the bound one (400 otherwise: DNS rebinding).
    """
    state: dict = {}
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        state["scheduler"] = scheduler_factory()
        try:
            yield
        finally:
            await asyncio.to_thread(state["scheduler"].stop)

    def authorized(request: Request) -> bool:
        if api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())

    def check_auth(request: Request) -> None:
        if not authorized(request):
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)", "authentication_error",
                           code="invalid_api_key")

    def model_object() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "kvchat"}

    async def health(request: Request) -> Response:
        scheduler = state["scheduler"]
        body = scheduler.health()
        if not authorized(request):
            body = {"status": body["status"]}
        return JSONResponse(body, status_code=200 if scheduler.alive else 503)

    async def list_models(request: Request) -> Response:
        check_auth(request)
        return JSONResponse({"object": "list", "data": [model_object()]})

    async def get_model(request: Request) -> Response:
        check_auth(request)
        if request.path_params["model"] != model_name:
            raise ApiError(404, f"the model {request.path_params['model']!r} does not exist (this server runs "
                                f"{model_name!r})", param="model", code="model_not_found")
        return JSONResponse(model_object())

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is {int(length):,} bytes; the limit is {MAX_BODY_BYTES:,}",
                           code="request_too_large")
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body exceeds the limit of {MAX_BODY_BYTES:,} bytes",
                               code="request_too_large")
        return bytes(body)

    async def chat_completions(request: Request) -> Response:
        check_auth(request)
        if api_key is None and request.headers.get("content-type", "").partition(";")[0].strip().lower() != JSON:
            raise ApiError(415, f"POST needs 'Content-Type: {JSON}' (a server without --api-key accepts no other, "
                                "so that web pages cannot post to it)", code="unsupported_media_type")
        req = parse_chat_request(await read_body(request), state["scheduler"].tool_style)
        if req.model != model_name:
            raise ApiError(404, f"the model {req.model!r} does not exist (this server runs {model_name!r})",
                           param="model", code="model_not_found")
        scheduler = state["scheduler"]
        if scheduler.needs_grammar_tokenizer(req):
            await asyncio.to_thread(scheduler.grammars.wait)
        choices = Choices(req, scheduler.submit, "chatcmpl-" + secrets.token_hex(12), model_name,
                          request.is_disconnected)
        if not req.stream:
            body, err = await choices.whole()
            return _error(err) if err is not None else JSONResponse(body)
        err = await choices.started()
        if err is not None:
            return _error(err)
        return StreamingResponse(choices.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error(exc)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = {404: "the route does not exist", 405: "the method is not allowed on this route"}
        return _error(ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                                                f"{kind.get(exc.status_code, exc.detail)}", code=str(exc.status_code)))

    routes = [Route("/health", health), Route("/v1/models", list_models), Route("/v1/models/{model:path}", get_model),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    middleware = []
    if api_key is None:
        names = {*LOOPBACK_NAMES, f"[{host}]" if ":" in host else host}
        middleware.append(Middleware(HostCheck, allowed=sorted(names)))
    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                     exception_handlers={ApiError: api_error, HTTPException: http_error})

