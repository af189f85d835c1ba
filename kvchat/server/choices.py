"""A request's answer: its ``n`` choices (1 to 8) as one job each, and the response built from their pushes,
whole (one ``chat.completion``) or streamed (Server-Sent Events). Every request goes this way, ``n = 1``
included: one place builds responses.

Choice ``i`` is the request with seed ``seed + i`` (no seed: each its own random one), so it equals the
same request sent with ``n = 1`` and that seed. Choice 0 runs first; the others are admitted once its
prompt is prefilled (:attr:`kvchat.server.scheduler.Job.after`) and fork its blocks and last logits
(:class:`kvchat.engine.shared_prompt.SharedPrompt`: shared, copied on write), computing nothing of the
prompt, then all decode in the same batched steps. Each choice is stored as its own chat (a branch when
the history continues one).

A client that goes away stops every choice: a stream's generator is closed by Starlette; a client waiting
for a whole answer is asked whether it is still there every :data:`DISCONNECT_POLL_S` (the pushes come
every token, so waiting on them alone would never notice).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Awaitable, Callable

from kvchat.engine.shared_prompt import SharedPrompt
from kvchat.server.protocol import (
    ApiError,
    ChatRequest,
    answer_message,
    chunk_body,
    completion_body,
    held_deltas,
    joined_logprobs,
    kvchat_block,
    sse_line,
    usage_block,
)
from kvchat.server.scheduler import Finished, Job
from kvchat.server.tools import CallPieces

DISCONNECT_POLL_S = 0.25  # a client waiting for a whole answer is checked for a closed connection this often


def choice_requests(req: ChatRequest) -> list[ChatRequest]:
    """One request per choice (``n = 1`` each), choice ``i`` seeded ``seed + i``."""
    out = []
    for i in range(req.n):
        seed = None if req.params.seed is None else (req.params.seed + i) % 2**63
        out.append(dataclasses.replace(req, n=1, params=dataclasses.replace(req.params, seed=seed)))
    return out


class Choices:
    """The ``n`` jobs of one request, submitted at construction (on the event loop), and their answer, whole
    (:meth:`whole`) or streamed (:meth:`started`, then :meth:`stream`). A failed choice fails the request;
    the others are then cancelled, as they are when the answer ends or the client goes away.

    Args:
        req: the validated request.
        submit: the scheduler's :meth:`~kvchat.server.scheduler.Scheduler.submit`.
        cid: the completion's id.
        model: the model name answers carry.
        disconnected: ``await disconnected()`` is True once the client has gone away (Starlette's
            ``Request.is_disconnected``).
    """

    def __init__(self, req: ChatRequest, submit, cid: str, model: str, disconnected: Callable[[], Awaitable[bool]]):
        loop = asyncio.get_running_loop()
        self.req, self.cid, self.model, self._disconnected = req, cid, model, disconnected
        self._events: asyncio.Queue = asyncio.Queue()  # (choice index, the scheduler's push)
        self._early: list[tuple[int, tuple]] = []  # pushes read by started(), not yet handled
        self._checked = time.monotonic()
        shared = SharedPrompt() if req.n > 1 else None
        self.jobs: list[Job] = []
        for i, sub in enumerate(choice_requests(req)):
            self.jobs.append(Job(sub, lambda item, i=i: loop.call_soon_threadsafe(self._events.put_nowait, (i, item)),
                                 after=self.jobs[0] if self.jobs else None, shared=shared))
        for job in self.jobs:
            submit(job)

    def cancel(self) -> None:
        """Stop every choice still running (a no-op for those finished)."""
        for job in self.jobs:
            job.cancel.set()

    async def _next(self, watch: bool) -> tuple[int, tuple] | None:
        """The next ``(choice index, push)``; with ``watch``, None once the client has disconnected (asked at
        most every :data:`DISCONNECT_POLL_S`)."""
        if self._early:
            return self._early.pop(0)
        if not watch:
            return await self._events.get()
        getter = asyncio.ensure_future(self._events.get())
        try:
            while True:
                wait = self._checked + DISCONNECT_POLL_S - time.monotonic()
                if wait > 0 and (await asyncio.wait({getter}, timeout=wait))[0]:
                    return getter.result()
                self._checked = time.monotonic()
                if await self._disconnected():
                    return None
        finally:
            getter.cancel()  # no-op once it has its result; a pending get leaves the queue's items in it

    async def started(self) -> ApiError | None:
        """Wait for choice 0's first push: its error (the request fails before any byte is sent; 499 when the
        client went away meanwhile), or None."""
        while True:
            got = await self._next(watch=True)
            if got is None:
                self.cancel()
                return ApiError(499, "the client closed the request")
            self._early.append(got)
            i, item = got
            if i == 0:
                if item[0] == "error":
                    self.cancel()
                    return item[1]
                return None

    async def whole(self) -> tuple[dict | None, ApiError | None]:
        """``(the chat.completion, None)`` once every choice is answered, or ``(None, the first error)``
        (499 when the client went away: every choice is stopped then)."""
        pieces: list[list] = [[] for _ in self.jobs]
        done: dict[int, Finished] = {}
        try:
            while len(done) < len(self.jobs):
                got = await self._next(watch=True)
                if got is None:
                    return None, ApiError(499, "the client closed the request")
                i, item = got
                if item[0] == "text":
                    pieces[i].append(item[2])
                elif item[0] == "error":
                    return None, item[1]
                else:
                    done[i] = item[1]
        finally:
            self.cancel()
        choices = []
        for i in range(len(self.jobs)):
            message, finish = answer_message(self.req, done[i].text, done[i].finish_reason)
            choices.append({"index": i, "message": message, "logprobs": joined_logprobs([*pieces[i], done[i].logprobs]),
                            "finish_reason": finish})
        usage, kv = self._totals(done)
        return completion_body(self.cid, self.model, choices, usage, kv), None

    async def stream(self):
        """The Server-Sent Events of every choice, interleaved as their tokens come (each chunk names its
        choice's ``index``; :class:`_Deltas` says what a choice's text becomes). The last finish chunk (and
        the usage chunk) carry the totals; an error ends the stream without ``[DONE]``."""
        cid, model = self.cid, self.model
        deltas = [_Deltas(self.req) for _ in self.jobs]
        done: dict[int, Finished] = {}
        try:
            for i in range(len(self.jobs)):
                yield sse_line(chunk_body(cid, model, {"role": "assistant", "content": ""}, index=i))
            while len(done) < len(self.jobs):
                i, item = await self._next(watch=False)  # Starlette closes this generator when the client goes
                if item[0] == "text":
                    for delta, logprobs in deltas[i].text(item[1], item[2]):
                        yield sse_line(chunk_body(cid, model, delta, logprobs=logprobs, index=i))
                    continue
                if item[0] == "error":
                    yield sse_line(item[1].body())
                    return  # no [DONE]: the answer is not complete
                done[i] = item[1]
                last_deltas, finish, logprobs = deltas[i].end(item[1])
                for delta, lp in last_deltas:
                    yield sse_line(chunk_body(cid, model, delta, logprobs=lp, index=i))
                last = len(done) == len(self.jobs)
                yield sse_line(chunk_body(cid, model, {}, finish, logprobs=logprobs, index=i,
                                          kvchat=self._totals(done)[1] if last else None))
            if self.req.include_usage:
                usage, kv = self._totals(done)
                yield sse_line(chunk_body(cid, model, None, usage=usage, kvchat=kv))
            yield "data: [DONE]\n\n"
        finally:
            self.cancel()  # the client went away (or the stream ended): stop generating

    def _totals(self, done: dict[int, Finished]) -> tuple[dict, dict]:
        """``usage`` counting the prompt once (choice 0's ``prompt_tokens`` and ``cached_tokens``) and the
        completion tokens of every choice; ``kvchat``: choice 0's, plus ``choices``: each choice's
        ``prefilled_tokens`` and ``chat_id``."""
        first = done[0]
        usage = usage_block(first.stats)
        usage["completion_tokens"] = sum(d.stats.new_tokens for d in done.values())
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        kv = kvchat_block(first.stats, first.ttft_ms, first.miss_reason, first.chat_id)
        kv["choices"] = [{"prefilled_tokens": done[i].stats.prefilled_tokens, "chat_id": done[i].chat_id}
                         for i in sorted(done)]
        return usage, kv


class _Deltas:
    """One choice's stream deltas from its text pushes: the text as ``content`` as it comes (no tools
    offered, or ``tool_choice: none``); a forced call (``required`` or named) as OpenAI streams a call, its
    arguments piece by piece as generated (:class:`kvchat.server.tools.CallPieces`); with ``tool_choice:
    auto`` the whole answer held to its end, since only the end says whether it is calls
    (:func:`kvchat.server.protocol.held_deltas`). Log-probabilities of text not yet sent ride with the next
    delta sent (or the finish chunk)."""

    def __init__(self, req: ChatRequest):
        self.req = req
        self.calls = CallPieces(req.tool_style) if req.tool_choice in ("required", "function") else None
        self.held = req.tool_choice == "auto"
        self._logprobs: list[dict | None] = []  # pushes' logprobs not yet sent

    def text(self, piece: str, logprobs: dict | None) -> list[tuple[dict, dict | None]]:
        """``(delta, logprobs)`` for each chunk a text push makes."""
        if self.calls is None and not self.held:
            return [({"content": piece}, logprobs)]
        self._logprobs.append(logprobs)
        out = [] if self.held else self.calls.feed(piece)
        return [(delta, self._take([]) if k == 0 else None) for k, delta in enumerate(out)]

    def end(self, done: Finished) -> tuple[list[tuple[dict, dict | None]], str, dict | None]:
        """The chunks the answer's end makes, its ``finish_reason``, and the finish chunk's logprobs."""
        if self.held:
            deltas, finish = held_deltas(self.req, done.text, done.finish_reason)
            return [(d, self._take([done.logprobs]) if k == 0 else None) for k, d in enumerate(deltas)], finish, None
        finish = answer_message(self.req, done.text, done.finish_reason)[1]
        return [], finish, self._take([done.logprobs]) if self.calls is not None else done.logprobs

    def _take(self, more: list[dict | None]) -> dict | None:
        """The logprobs held back plus ``more``, as one object (None when the request asked for none)."""
        blocks, self._logprobs = [*self._logprobs, *more], []
        return joined_logprobs(blocks) if blocks else None
