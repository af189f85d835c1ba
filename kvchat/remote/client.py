"""An OpenAI-compatible server over HTTP: its models, its counters, one streamed chat completion.

Written on httpx2 (docs/scale-out.md says why): every failure becomes one :class:`ServerError` line
naming the server, the status and what to do; nothing is retried behind the caller's back, so a refused
connection or a 401 is said at once. A stream is read line by line as Server-Sent Events (``data: {chunk}``
… ``data: [DONE]``); a stream cut before ``[DONE]`` and before any finish reason, or with an ``error`` event,
is an error, never an answer (a server that sent the finish reason and then closed without ``[DONE]`` did
answer).
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx2

from kvchat.conversation.views import ContextFullError
from kvchat.engine.turn import SamplingParams
from kvchat.server_address import base_url
from kvchat.settings import server_timeout_s

CONNECT_TIMEOUT_S = 10.0
CANCEL_POLL_S = 0.05  # how often a stream's watcher looks at the cancel flag (Esc closes the stream)


class ServerError(OSError):
    """The server could not be used (unreachable, refused the key, failed, cut the answer, went silent).

    ``kind`` (for ``ask --json``): ``connection_error``, ``authentication_error``, ``not_found``,
    ``rate_limited``, ``invalid_request``, ``server_error`` or ``timeout``; ``retry_after_s``: the server's
    ``Retry-After``, when it sent one. The message is one line.
    """

    def __init__(self, message: str, kind: str, retry_after_s: float | None = None,
                 cut_reason: str = "its stream broke off"):
        super().__init__(message)
        self.kind = kind
        self.retry_after_s = retry_after_s
        self.cut_reason = cut_reason  # what happened, in words that name nothing of the server's, for AnswerCut

    def __str__(self) -> str:
        return str(self.args[0])


class AnswerCut(ServerError):
    """The server stopped sending an answer after some of it came (it shut down, was killed, sent an error
    event or went silent): ``reply`` is that part, finish reason ``interrupted``; ``chat_id``: the local chat
    it was kept in, once :class:`kvchat.remote.chats.RemoteChats` stored it. The message is one line that
    names the server and what happened, never the server's own words (they may name its internals, e.g. the
    chat it stored the cut answer in)."""

    def __init__(self, message: str, reply: "Reply", chat_id: str | None = None):
        super().__init__(message, "server_error")
        self.reply = reply
        self.chat_id = chat_id  # the local chat the part was stored in (None while, or when, it was not)


@dataclass(slots=True)
class ServerModel:
    """A model the server lists: its id and, where the server says it (vLLM's ``max_model_len``,
    kvchat serve's ``/health``), its context limit in tokens (0: not said)."""

    id: str
    context_limit: int = 0


@dataclass(slots=True)
class Counters:
    """``kvchat serve``'s ``/health`` figures (absent elsewhere): KV dtype, pool blocks, context limit."""

    kv_dtype: str
    pool_blocks_used: int
    pool_blocks_total: int
    context_limit: int


@dataclass(slots=True)
class Reply:
    """One streamed completion as the client saw it.

    ``ttft_ms``: from sending the request to the first text, measured here; ``decode_span_s``: from the
    first text to the last, seconds, measured here (the decode speed is computed from it by
    :func:`kvchat.remote.figures.decode_rate`). ``usage``: the server's ``usage`` object ({} if none was
    sent); ``kvchat``: kvchat serve's per-completion object (where the prompt's K/V came from), None
    elsewhere. ``finish_reason``: the server's, ``cancelled`` when the caller stopped the stream, or
    ``interrupted`` for the part of an answer the server stopped sending (:class:`AnswerCut`);
    ``pieces``: the streamed text deltas.
    """

    text: str
    finish_reason: str
    ttft_ms: float
    decode_span_s: float
    pieces: int = 0
    usage: dict = field(default_factory=dict)
    kvchat: dict | None = None


def _one_line(text) -> str:
    """``text`` on one line, without Python's ``[Errno N]`` prefix."""
    return " ".join(re.sub(r"\[Errno -?\d+\] ", "", str(text)).split())


class ServerClient:
    """A server at ``url`` (:func:`base_url` form), with ``api_key`` sent as ``Authorization: Bearer``.

    ``read_timeout_s``: the longest silence accepted inside a response (None:
    :func:`kvchat.settings.server_timeout_s`). Thread-safe as httpx2's ``Client`` is; one stream per call.
    """

    def __init__(self, url: str, api_key: str | None = None, read_timeout_s: float | None = None):
        self.url = base_url(url)
        self.read_timeout_s = read_timeout_s or server_timeout_s()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx2.Timeout(self.read_timeout_s, connect=CONNECT_TIMEOUT_S)
        self._http = httpx2.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    # --- plain requests --------------------------------------------------------------------------
    def models(self) -> list[ServerModel]:
        """``GET /v1/models``: the models the server runs, in its order.

        Raises:
            ServerError: unreachable, refused, or not an OpenAI-style model list.
        """
        body = self._get_json("/v1/models")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise ServerError(f"{self.url}/v1/models did not answer an OpenAI model list; is this an "
                              "OpenAI-compatible server?", "invalid_request")
        limit = lambda m: m.get("max_model_len") if isinstance(m.get("max_model_len"), int) else 0  # noqa: E731
        return [ServerModel(m["id"], limit(m)) for m in data]

    def counters(self) -> Counters | None:
        """``kvchat serve``'s ``GET /health`` counters; None where the server is not kvchat serve (no such
        route, other fields) or does not give them to this key.

        Raises:
            ServerError: unreachable.
        """
        try:
            body = self._get_json("/health")
        except ServerError as exc:
            if exc.kind == "connection_error":
                raise
            return None
        fields_ = ("kv_dtype", "pool_blocks_used", "pool_blocks_total", "context_limit")
        if not isinstance(body, dict) or not all(k in body for k in fields_):
            return None
        return Counters(str(body["kv_dtype"]), int(body["pool_blocks_used"]), int(body["pool_blocks_total"]),
                        int(body["context_limit"]))

    def _get_json(self, path: str):
        try:
            response = self._http.get(path)
        except httpx2.HTTPError as exc:
            raise self._transport_error(exc) from None
        if response.status_code != 200:
            raise self._status_error(response.status_code, response.content, response.headers)
        try:
            return response.json()
        except ValueError:
            raise ServerError(f"{self.url}{path} did not answer JSON", "invalid_request") from None

    # --- the streamed completion -----------------------------------------------------------------
    def chat(self, model: str, messages: list[dict], params: SamplingParams, cancel: threading.Event,
             on_text: Callable[[str], None], on_pause: Callable[[], None] = lambda: None) -> Reply:
        """``POST /v1/chat/completions`` streamed: ``on_text`` gets each piece of the answer as it comes;
        ``on_pause`` is called whenever nothing came for :data:`CANCEL_POLL_S` (a batching caller shows what
        it holds back, so a stalled stream does not hide its last pieces).

        ``cancel`` set: the reply so far comes back at once (within :data:`CANCEL_POLL_S`) with finish reason
        ``cancelled``; the stream is closed at its next event, which tells the server to stop.

        Raises:
            ContextFullError: the server says the conversation does not fit its context (400
                ``context_length_exceeded``).
            AnswerCut: an error event, a cut connection or no byte for ``read_timeout_s`` after part of the
                answer came (that part is its ``reply``).
            ServerError: unreachable, refused (401, 404, 429/503 with its ``Retry-After``, other 4xx), failed
                (5xx), an error event or a cut connection before any text, no byte for ``read_timeout_s``.
        """
        t0 = time.perf_counter()
        pieces: list[str] = []
        first = last = None
        finish, usage, extra = "", {}, None
        events: queue.Queue = queue.Queue()
        stop = threading.Event()
        ttft = lambda: ((first or time.perf_counter()) - t0) * 1e3  # noqa: E731
        span = lambda: (last - first) if first is not None else 0.0  # noqa: E731
        # the stream is read on its own thread: a read blocked on a silent server cannot be interrupted, and
        # Esc must not wait for the read timeout
        threading.Thread(target=self._read, args=(request_body(model, messages, params), events, stop),
                         name="kvchat-stream", daemon=True).start()
        try:
            while True:
                try:
                    kind, value = events.get(timeout=CANCEL_POLL_S)
                except queue.Empty:
                    if cancel.is_set():
                        break
                    on_pause()
                    continue
                if kind == "error":
                    raise value
                if kind == "end" and finish:  # the answer was complete; only the closing [DONE] is missing
                    break
                if kind == "end":
                    raise ServerError(f"the connection to {self.url} ended mid-answer (no [DONE])", "server_error",
                                      cut_reason="the connection closed")
                if value == "[DONE]":
                    break
                chunk = _json(value, self.url)
                if "error" in chunk:
                    err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
                    raise ServerError(f"the server at {self.url} cut the answer: "
                                      f"{_one_line(err.get('message', err))}", "server_error",
                                      cut_reason="it sent an error")
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        last = time.perf_counter()
                        first = first or last
                        pieces.append(text)
                        on_text(text)
                    finish = choice.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
                extra = chunk.get("kvchat") or extra
                if cancel.is_set():
                    break
        except ServerError as exc:
            if not pieces:
                raise
            partial = Reply("".join(pieces), "interrupted", ttft(), span(), len(pieces), usage, extra)
            raise AnswerCut(f"the server at {self.url} stopped mid-answer ({exc.cut_reason})", partial) from None
        finally:
            stop.set()  # whatever ended the loop, the reader stops at its next event
        if cancel.is_set() and not finish:
            finish = "cancelled"
        return Reply("".join(pieces), finish or "stop", ttft(), span(), len(pieces), usage, extra)

    def _read(self, body: dict, events: queue.Queue, stop: threading.Event) -> None:
        """Post ``body`` and put ``("data", event data)`` per stream event, then ``("end", None)`` when the
        stream ends, or ``("error", exception)``; returns at the first event after ``stop`` is set."""
        try:
            with self._http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    events.put(("error", self._status_error(response.status_code, response.read(), response.headers)))
                    return
                for data in _sse_data(response.iter_lines()):
                    if stop.is_set():
                        return
                    events.put(("data", data))
                    if data == "[DONE]":
                        return
            events.put(("end", None))
        except httpx2.HTTPError as exc:
            events.put(("error", self._transport_error(exc)))
        except Exception as exc:  # noqa: BLE001 - handed to the caller's thread, which raises it
            events.put(("error", exc))

    # --- errors ----------------------------------------------------------------------------------
    def _transport_error(self, exc: httpx2.HTTPError) -> ServerError:
        if isinstance(exc, httpx2.ConnectTimeout):
            return ServerError(f"cannot reach the server at {self.url}: no answer to connect within "
                               f"{CONNECT_TIMEOUT_S:.0f} s", "connection_error")
        if isinstance(exc, httpx2.ConnectError):
            return ServerError(f"cannot reach the server at {self.url} ({_one_line(exc) or 'refused'}); is it "
                               "running, and is the URL right?", "connection_error")
        if isinstance(exc, httpx2.TimeoutException):
            return ServerError(f"the server at {self.url} sent nothing for {self.read_timeout_s:.0f} s; "
                               "the answer was dropped", "timeout",
                               cut_reason=f"it sent nothing for {self.read_timeout_s:.0f} s")
        return ServerError(f"the connection to {self.url} failed mid-answer ({_one_line(exc) or type(exc).__name__})",
                           "server_error", cut_reason="the connection was cut")

    def _status_error(self, status: int, raw: bytes, headers) -> Exception:
        """The error for a non-200 answer: its OpenAI error object's message where it sent one."""
        try:
            err = json.loads(raw).get("error")
            err = err if isinstance(err, dict) else {"message": err}
        except (ValueError, AttributeError):
            err = {}
        message = _one_line(err.get("message") or raw.decode("utf-8", "replace")[:200] or "no message")
        said = f"({status}: {message})"
        if status == 400 and err.get("code") == "context_length_exceeded":
            return ContextFullError(f"the server says the conversation does not fit its context: {message}",
                                    *_figures(message))
        if status in (401, 403):
            return ServerError(f"the server at {self.url} refused the API key {said}; give the right one with "
                               "--api-key-env VAR or the data dir's server-keys.toml", "authentication_error")
        if status == 404:
            return ServerError(f"not found on the server at {self.url} {said}", "not_found")
        if status in (429, 503):
            retry = _retry_after(headers.get("retry-after"))
            when = f"; retry after {retry:.0f} s" if retry is not None else "; retry later"
            return ServerError(f"the server at {self.url} is busy {said}{when}", "rate_limited", retry)
        if 400 <= status < 500:
            return ServerError(f"the server at {self.url} refused the request {said}", "invalid_request")
        return ServerError(f"the server at {self.url} failed {said}", "server_error")


def pick_model(models: list[str], wanted: str | None, url: str) -> str:
    """``wanted`` if the server lists it, else (None) the first model it lists.

    Raises:
        LookupError: the server lists no model, or not ``wanted`` (the line names those it has).
    """
    if not models:
        raise LookupError(f"the server at {url} lists no model")
    if wanted is None:
        return models[0]
    if wanted not in models:
        raise LookupError(f"the server at {url} has no model {wanted!r} (it has {', '.join(models)})")
    return wanted


def context_limit(models: list[ServerModel], model: str, counters: Counters | None) -> int:
    """``model``'s context limit in tokens: kvchat serve's ``/health`` figure, else the model list's
    ``max_model_len``; 0 when the server says neither."""
    if counters is not None:
        return counters.context_limit
    return next((m.context_limit for m in models if m.id == model), 0)


def request_body(model: str, messages: list[dict], params: SamplingParams) -> dict:
    """The JSON of a streamed chat completion: the OpenAI fields every such server takes, plus ``top_k``,
    ``seed`` and the penalties only when set (OpenAI's own API refuses ``top_k``)."""
    body = {"model": model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p}
    if params.top_k:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(params, name):
            body[name] = getattr(params, name)
    return body


def _sse_data(lines):
    """The ``data`` of each Server-Sent Event (multi-line data joined by newlines; comments skipped)."""
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
            data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield "\n".join(data)


def _json(data: str, url: str) -> dict:
    try:
        chunk = json.loads(data)
    except ValueError:
        raise ServerError(f"the server at {url} sent a stream event that is not JSON", "server_error") from None
    if not isinstance(chunk, dict):
        raise ServerError(f"the server at {url} sent a stream event that is not an object", "server_error")
    return chunk


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (an HTTP date is not used by these servers: None)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _figures(message: str) -> tuple[int, int]:
    """(tokens needed, context limit) as the message states them ("… is 5,000 tokens; … 2,048 tokens");
    0 for a figure it does not state."""
    numbers = [int(n.replace(",", "")) for n in re.findall(r"(\d[\d,]*) tokens", message)]
    return (numbers[0] if numbers else 0), (numbers[-1] if len(numbers) > 1 else 0)
