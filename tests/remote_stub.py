"""Test helper: a small OpenAI-compatible server that misbehaves on cue (Starlette on uvicorn in a thread).

Only for the bad-server cases (a wrong key, a 503 with Retry-After, a 500 or a cut connection
mid-answer, a stream that never ends, a complete answer closed without ``[DONE]``); conversations that must
work run on a real ``kvchat serve``.
Each ``POST /v1/chat/completions`` takes the next behaviour of ``script`` (``ok`` once it is empty).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import uvicorn
from server_helpers import free_port
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

MODEL = "stub-model"
KEY = "stub-key"
PIECES = ["Half ", "an ", "answer"]


def _chunk(delta: dict, finish: str | None = None, **extra) -> str:
    body = {"id": "stub", "object": "chat.completion.chunk", "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
    return f"data: {json.dumps(body)}\n\n"


class StubServer:
    """The stub on a free loopback port; ``script``: behaviours of the next completions (see the module doc);
    ``requests``: the bodies it received."""

    def __init__(self, script: list[str] | None = None):
        self.script = list(script or [])
        self.requests: list[dict] = []
        self.port = free_port()
        self._release = threading.Event()  # ends a silent stream at stop
        app = Starlette(routes=[Route("/v1/models", self._models),
                                Route("/v1/chat/completions", self._complete, methods=["POST"])])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                     timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "StubServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "the stub server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._release.set()
        self._server.should_exit = True
        self._thread.join(10)

    @staticmethod
    def _authorized(request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {KEY}"

    async def _models(self, request: Request):
        if not self._authorized(request):
            return JSONResponse({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                                           "code": "invalid_api_key"}}, status_code=401)
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 4096}]})

    async def _complete(self, request: Request):
        body = await request.json()
        self.requests.append(body)
        behaviour = self.script.pop(0) if self.script else "ok"
        if behaviour == "busy":
            return JSONResponse({"error": {"message": "the pool is full", "type": "server_error"}}, status_code=503,
                                headers={"Retry-After": "7"})
        return StreamingResponse(self._stream(behaviour, body), media_type="text/event-stream")

    async def _stream(self, behaviour: str, body: dict):
        yield _chunk({"role": "assistant", "content": ""})
        for piece in PIECES if behaviour in ("ok", "no_done") else PIECES[:2]:
            yield _chunk({"content": piece})
        if behaviour == "error_event":  # as OpenAI's and kvchat serve's streams report a failure mid-answer
            yield f"data: {json.dumps({'error': {'message': 'internal error', 'type': 'server_error', 'code': 500}})}\n\n"
            return
        if behaviour == "cut":
            raise RuntimeError("the stub drops the connection mid-answer")
        if behaviour == "silent":
            while not self._release.is_set():
                await asyncio.sleep(0.05)
            return
        usage = {"prompt_tokens": 11 * len(body["messages"]), "completion_tokens": len(PIECES),
                 "total_tokens": 11 * len(body["messages"]) + len(PIECES), "prompt_tokens_details": {"cached_tokens": 8}}
        yield _chunk({}, "stop")
        yield f"data: {json.dumps({'id': 'stub', 'object': 'chat.completion.chunk', 'choices': [], 'usage': usage})}\n\n"
        if behaviour != "no_done":
            yield "data: [DONE]\n\n"
