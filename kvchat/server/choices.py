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
from kvchat.server.protocol import ChatRequest, answer_message, completion_body, kvchat_block, usage_block
from kvchat.server.scheduler import Finished, Job


def choice_requests(req: ChatRequest) -> list[ChatRequest]:
    """One request per choice (``n = 1`` each), choice ``i`` seeded ``seed + i``."""
    out = []
    for i in range(req.n):
        seed = None if req.params.seed is None else (req.params.seed + i) % 2**63
        out.append(dataclasses.replace(req, n=1, params=dataclasses.replace(req.params, seed=seed)))
    return out


async def several_choices(req: ChatRequest, submit, cid: str, model: str) -> tuple[dict | None, object]:
    """Run the ``n`` choices of ``req`` through ``submit`` (the scheduler's) and build the completion.

    Returns ``(body, None)``, or ``(None, ApiError)`` when a choice failed (the others are cancelled).
    ``usage`` counts the prompt once (``prompt_tokens`` and ``cached_tokens`` are choice 0's) and the
    completion tokens of every choice; ``kvchat`` is choice 0's plus ``choices``: each choice's
    ``prefilled_tokens`` and ``chat_id``.
    """
    loop = asyncio.get_running_loop()
    queues = [asyncio.Queue() for _ in range(req.n)]
    jobs: list[Job] = []
    shared = SharedPrompt()
    for q, sub in zip(queues, choice_requests(req)):
        jobs.append(Job(sub, lambda item, q=q: loop.call_soon_threadsafe(q.put_nowait, item),
                        after=jobs[0] if jobs else None, shared=shared))
    for job in jobs:
        submit(job)
    done: list[Finished] = []
    logprobs: list[list] = []
    try:
        for q in queues:
            pieces = []
            item = await q.get()
            while item[0] == "text":
                pieces.append(item[2])
                item = await q.get()
            if item[0] == "error":
                return None, item[1]
            done.append(item[1])
            logprobs.append([*pieces, item[1].logprobs])
    finally:
        for job in jobs:
            job.cancel.set()  # no-op once finished; an error or a gone client stops the rest
    choices = []
    for i, (d, blocks) in enumerate(zip(done, logprobs)):
        message, finish = answer_message(req, d.text, d.finish_reason)
        lp = None if blocks[-1] is None else {"content": [e for b in blocks for e in b["content"]], "refusal": None}
        choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
    usage = usage_block(done[0].stats)
    usage["completion_tokens"] = sum(d.stats.new_tokens for d in done)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    kv = kvchat_block(done[0].stats, done[0].ttft_ms, done[0].miss_reason, done[0].chat_id)
    kv["choices"] = [{"prefilled_tokens": d.stats.prefilled_tokens, "chat_id": d.chat_id} for d in done]
    body = completion_body(cid, model, choices[0]["message"], choices[0]["finish_reason"], usage, kv)
    body["choices"] = choices
    return body, None
