"""``n`` > 1: several choices of one request, as one job per choice that share the prompt's K/V.

Choice ``i`` is the request with seed ``seed + i`` (no seed: each its own random one), so it equals the
same request sent with ``n = 1`` and that seed. Choice 0 runs first; the others are admitted once its
prompt is prefilled (:attr:`kvchat.server.scheduler.Job.after`) and fork its blocks and last logits
(:class:`kvchat.engine.shared_prompt.SharedPrompt`: shared, copied on write), computing nothing of the
prompt, then all decode in the same batched steps. Each choice is stored as its own chat (a branch when
the history continues one).
"""

from __future__ import annotations

import asyncio
import dataclasses

from kvchat.engine.shared_prompt import SharedPrompt
from kvchat.server.protocol import (
    ApiError,
    ChatRequest,
    answer_message,
    chunk_body,
    completion_body,
    held_delta,
    joined_logprobs,
    kvchat_block,
    sse_line,
    usage_block,
)
from kvchat.server.scheduler import Finished, Job


def choice_requests(req: ChatRequest) -> list[ChatRequest]:
    """One request per choice (``n = 1`` each), choice ``i`` seeded ``seed + i``."""
    out = []
    for i in range(req.n):
        seed = None if req.params.seed is None else (req.params.seed + i) % 2**63
        out.append(dataclasses.replace(req, n=1, params=dataclasses.replace(req.params, seed=seed)))
    return out


class SeveralChoices:
    """The ``n`` jobs of one request, submitted at construction (on the event loop), and their answer, whole
    (:meth:`whole`) or streamed (:meth:`started`, then :meth:`stream`). A failed choice fails the request;
    the others are then cancelled, as they are when the answer ends or the client goes away."""

    def __init__(self, req: ChatRequest, submit, cid: str, model: str):
        loop = asyncio.get_running_loop()
        self.req, self.cid, self.model = req, cid, model
        self._events: asyncio.Queue = asyncio.Queue()  # (choice index, the scheduler's push)
        self._early: list[tuple[int, tuple]] = []  # pushes read by started(), not yet handled
        shared = SharedPrompt()
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

    async def _next(self) -> tuple[int, tuple]:
        return self._early.pop(0) if self._early else await self._events.get()

    async def started(self) -> ApiError | None:
        """Wait for choice 0's first push: its error (the request fails before any byte is sent), or None."""
        while True:
            i, item = await self._events.get()
            self._early.append((i, item))
            if i == 0:
                if item[0] == "error":
                    self.cancel()
                    return item[1]
                return None

    async def whole(self) -> tuple[dict | None, ApiError | None]:
        """``(the chat.completion, None)`` once every choice is answered, or ``(None, the first error)``."""
        pieces: list[list] = [[] for _ in self.jobs]
        done: dict[int, Finished] = {}
        try:
            while len(done) < len(self.jobs):
                i, item = await self._next()
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
            choices.append({"index": i, "message": message, "finish_reason": finish,
                            "logprobs": joined_logprobs([*pieces[i], done[i].logprobs])})
        usage, kv = self._totals(done)
        body = completion_body(self.cid, self.model, choices[0]["message"], choices[0]["finish_reason"], usage, kv)
        body["choices"] = choices
        return body, None

    async def stream(self):
        """The Server-Sent Events of every choice, interleaved as their tokens come (each chunk names its
        choice's ``index``); an answer that may be calls (tools offered) is sent whole at its end. The last
        finish chunk (and the usage chunk) carry the totals; an error ends the stream without ``[DONE]``."""
        req, cid, model = self.req, self.cid, self.model
        held = bool(req.tools) and req.tool_choice != "none"
        pieces: list[list] = [[] for _ in self.jobs]
        done: dict[int, Finished] = {}
        try:
            for i in range(len(self.jobs)):
                yield sse_line(chunk_body(cid, model, {"role": "assistant", "content": ""}, index=i))
            while len(done) < len(self.jobs):
                i, item = await self._next()
                if item[0] == "text":
                    if held:
                        pieces[i].append(item[2])
                    else:
                        yield sse_line(chunk_body(cid, model, {"content": item[1]}, logprobs=item[2], index=i))
                    continue
                if item[0] == "error":
                    yield sse_line(item[1].body())
                    return  # no [DONE]: the answer is not complete
                done[i] = d = item[1]
                finish, logprobs = d.finish_reason, d.logprobs
                if held:
                    delta, finish = held_delta(req, d.text, finish)
                    yield sse_line(chunk_body(cid, model, delta, logprobs=joined_logprobs([*pieces[i], logprobs]),
                                              index=i))
                    logprobs = None  # all went with the delta
                last = len(done) == len(self.jobs)
                yield sse_line(chunk_body(cid, model, {}, finish, logprobs=logprobs, index=i,
                                          kvchat=self._totals(done)[1] if last else None))
            if req.include_usage:
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
