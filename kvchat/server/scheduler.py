"""The server's queue and admission policy on the engine loop (continuous batching).

Requests are queued by the HTTP handlers (:meth:`Scheduler.submit`). At the
start of each iteration of the engine loop (:class:`kvchat.engine.loop.EngineLoop`,
which then runs one batched decode step for every running chat and prefill
chunks up to its token budget) the scheduler admits queued requests while
the pool can hold every admitted request at its full length (prompt +
``max_tokens``), answering 503 with Retry-After to one that waited longer
than the queue timeout. A request is answered once its turn is stored
(:class:`TurnDone`); its answer's recompute and snapshot follow in the same
iteration's budget, before new prompts, so a running stream waits at most
one budget's worth of chunks between two tokens. While a stored turn settles
no new request is prepared (queued ones wait an iteration): a next turn of
that chat, sent at its [DONE], continues it instead of branching off.

A request is a turn of the conversation service
(:meth:`kvchat.conversation.service.ChatService.send_steps`): the same
checks, storing and rollback as the TUI's and the CLI's turns. A cancelled request (client gone, stop string seen, shutdown)
ends after its next token, is stored like an interrupted TUI turn, and its
blocks go back to the pool (still in the prefix cache); one cut by a shutdown
is answered with an error, not a finish reason. An answer cut at a
stop string is stored as the client got it (the cut text) with the ids
generated, so the client's next request, resending that text, reuses them.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from kvchat.conversation.events import TokenBatch, TurnDone
from kvchat.conversation.history_match import chat_with_ids, generated_answer
from kvchat.conversation.records import new_settings
from kvchat.conversation.service import ChatService, ConversationConflictError
from kvchat.conversation.views import ContextFullError
from kvchat.engine.block_manager import PoolFullError
from kvchat.engine.dense_kv import DenseKV
from kvchat.engine.grammar import GrammarCompiler, GrammarError
from kvchat.engine.loop import EngineLoop, Request
from kvchat.engine.sequence import DecodeStep
from kvchat.engine.shared_prompt import SharedPrompt
from kvchat.engine.token_rules import TokenLogprob, TokenRules
from kvchat.engine.turn import TurnStats
from kvchat.model.chat_format import ChatTemplateError, UserTurn
from kvchat.runtime import Runtime
from kvchat.server.prefix import render
from kvchat.server.protocol import ApiError, ChatRequest, logprobs_block, stored_answer_text
from kvchat.server.template_tools import template_tool_style
from kvchat.server.tools import GENERIC, first_call_end

DEFAULT_MAX_TOKENS = 512  # when a request names none (as `kvchat ask`)
RETRY_AFTER_S = 5


# the OpenAI finish_reason of a turn that ended by itself: "stop" for the end-of-sequence token or a stop
# string, "length" for max_tokens or the context (TurnStats.finish_reason); any other end is an error
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length"}


@dataclass(slots=True)
class Finished:
    """A request's answer: its text (cut at a stop string), why it ended (an OpenAI ``finish_reason``:
    ``stop`` or ``length``), the turn's counters; ``logprobs``: the OpenAI ``logprobs`` object of the tokens
    not yet pushed with text, when the request asked for them."""

    text: str
    finish_reason: str
    stats: TurnStats
    ttft_ms: float
    miss_reason: str | None
    chat_id: str | None
    logprobs: dict | None = None


@dataclass(eq=False)
class Job:
    """One request in the scheduler.

    ``push`` is called from the engine loop's thread with ``("text", str, logprobs)`` (``logprobs``: the OpenAI
    ``logprobs`` object of the tokens generated since the last push, or None when not asked for), then one
    ``("done", Finished)`` or ``("error", ApiError)`` (also after text: an answer cut by a shutdown or a
    failure); it must be thread-safe.
    ``cancel``: set by the handler when the client goes away.
    ``after``: another choice of the same request (``n`` > 1, :mod:`kvchat.server.choices`): this job is
    admitted only once that one's prompt is prefilled, and forks its blocks through ``shared``.
    """

    request: ChatRequest
    push: Callable[[tuple[str, object]], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    received: float = field(default_factory=time.perf_counter)
    service: ChatService | None = None
    req: Request | None = None  # its turn on the engine loop, once admitted
    need_blocks: int = 0
    drift: str | None = None
    first_at: float | None = None
    text: str = ""
    sent: int = 0
    stop_at: int | None = None
    # the last user message as _prepare rendered it, tokenized once per request (a stored chat it continues
    # was found by the same rendering's ids, so its own format renders the message the same)
    user: UserTurn | None = None
    answered: bool = False  # the "done" was pushed (the turn is stored); its recompute may still run
    rules: TokenRules | None = None  # the sampler's API hook: logit bias, grammar, log-probabilities
    logprobs_sent: int = 0  # entries of rules.logprobs already pushed
    after: "Job | None" = None
    shared: SharedPrompt | None = None  # the prompt the request's choices share (None: n = 1)


class Scheduler:
    """Queues requests and admits them onto an engine loop; see the module docstring.

    Args:
        rt: the loaded runtime (its engine is used by the loop's thread only from now on).
        store: store every request as a chat, with its KV snapshots (``--no-store``: False).
        queue_timeout_s: a request waiting longer than this for pool space gets 503.
        verbose: print each request's last user message on stderr.
    """

    def __init__(self, rt: Runtime, store: bool = True, queue_timeout_s: float = 30.0, verbose: bool = False):
        self.rt, self.store, self.queue_timeout_s, self.verbose = rt, store, queue_timeout_s, verbose
        self.queued: deque[Job] = deque()
        self.running: list[Job] = []
        self._inbox: deque[Job] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        fmt = rt.chat_format(new_settings([]))
        self.grammars = GrammarCompiler(rt.tokenizer, fmt.stop_token_ids, rt.engine.cfg.vocab_size)
        self.grammars.start()  # off the loop's thread: see needs_grammar_tokenizer
        # the model's own way with tools where its template has one kvchat can follow, else the generic one
        self.tool_style = template_tool_style(rt.tokenizer, fmt.template_kwargs) or GENERIC
        # --no-store: not even LRU stamps are written
        self.loop = EngineLoop(rt.engine, touch_lru=store, admit=self._on_iteration)
        self.persist = self.loop.persist

    # ---- called from the HTTP side -------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue ``job`` (any thread); once stopping, answer it 503 instead."""
        with self._wake:
            if self._stopping:
                job.push(("error", ApiError(503, "the server is shutting down", "server_error")))
                return
            self._inbox.append(job)
        self.loop.wake()

    def needs_grammar_tokenizer(self, req: ChatRequest) -> bool:
        """``req`` needs the grammar tokenizer (a grammar, or log-probabilities' token bytes) and it is still
        being built: the HTTP side then waits for it (:meth:`GrammarCompiler.wait`) on a thread of its own
        before :meth:`submit`, so the loop never builds or waits for it while other requests decode."""
        return (req.grammar is not None or req.top_logprobs is not None) and not self.grammars.ready

    def health(self) -> dict:
        """Pool and queue counters (read without locking; approximate while the loop runs)."""
        e = self.rt.engine
        return {"status": "ok" if self.alive else "the scheduler thread has stopped", "model": self.rt.info.name,
                "kv_dtype": e.spec.kv_dtype,
                "pool_blocks_total": e.pool.num_blocks, "pool_blocks_used": e.pool.num_blocks - e.blocks.num_free_blocks,
                "running": len(self.running), "queued": len(self.queued) + len(self._inbox),
                "decode_steps": self.loop.decode_steps, "context_limit": e.max_context}

    @property
    def alive(self) -> bool:
        """The engine loop's thread runs (False once it has stopped or died): /health answers 503 otherwise."""
        return self.loop.alive

    def request_stop(self) -> None:
        """Start stopping without waiting (a signal handler may call it): every request is cancelled, running
        turns end after their next token (stored as a cancelled turn, answered with a 503 error: the answer
        is cut), queued ones get 503."""
        with self._wake:
            self._stopping = True
        self.loop.wake()

    def stop(self) -> None:
        """:meth:`request_stop`, wait for the loop's thread to end, flush snapshot writes."""
        self.request_stop()
        self.loop.close()

    # ---- on the engine loop's thread ----------------------------------------------------------
    def _on_iteration(self) -> bool:
        """The loop's ``admit`` hook: take new requests, admit what fits; True while some wait for space."""
        with self._wake:
            self.queued.extend(self._inbox)
            self._inbox.clear()
            stopping = self._stopping
        if stopping:
            for job in [*self.queued, *self.running]:
                job.cancel.set()
            if self.running:
                return True
            for job in self.queued:
                job.push(("error", ApiError(503, "the server is shutting down", "server_error")))
            self.queued.clear()
            return False
        self._admit()
        if self.queued and not self.running:
            time.sleep(0.01)  # waiting for pool space that only a timeout can change
        return bool(self.queued)

    def _admit(self) -> None:
        """Prepare queued jobs in order; admit those whose full length fits beside the running ones."""
        total = self.rt.engine.pool.num_blocks
        # an answered turn holds its chat until its recompute and snapshot (the budget after the decode step
        # that ended it runs them first): a next turn of it, sent at its [DONE], must continue that chat, so
        # nothing new is prepared meanwhile
        hold = self.store and any(_settling(j) for j in self.running)
        for job in list(self.queued):
            if job.cancel.is_set() and job.req is None:
                self.queued.remove(job)
                job.push(("error", ApiError(499, "the client closed the request")))
                continue
            if job.service is None and hold:
                continue
            if job.after is not None and not self._prefilled(job.after):
                continue
            if job.service is None:
                try:
                    self._prepare(job)
                except Exception as exc:  # noqa: BLE001 - bad request: answer it, keep serving
                    self.queued.remove(job)
                    job.push(("error", _api_error(exc)))
                    continue
            promised = sum(j.need_blocks for j in self.running)
            if promised + job.need_blocks <= total:
                self.queued.remove(job)
                self.running.append(job)
                steps = job.service.send_steps(job.request.user, job.request.params, job.cancel,
                                               lambda ev, job=job: self._on_event(job, ev),
                                               lambda text, job=job: self._stored_text(job, text), job.user,
                                               job.rules, job.shared)
                job.req = self.loop.submit(steps)
                job.req.future.add_done_callback(lambda fut, job=job: self._ended(job, fut))
            elif time.perf_counter() - job.received > self.queue_timeout_s:
                self.queued.remove(job)
                self._release(job)
                job.push(("error", ApiError(503, f"the KV pool is full ({total} blocks promised to running requests); "
                                                 "retry later", "server_error", code="pool_full",
                                            headers={"Retry-After": str(RETRY_AFTER_S)})))

    def _prefilled(self, job: Job) -> bool:
        """``job``'s prompt is in the pool (it decodes or has answered), or it will never be (it ended)."""
        running = job in self.running
        return job.answered or (running and job.req is not None and isinstance(job.req.waiting, DecodeStep)) or \
            not (running or job in self.queued or job in self._inbox)

    def _prepare(self, job: Job) -> None:
        """Render the messages (mapping answers back to generated ids), open or start the chat, size the job.

        Raises:
            kvchat.context_fit.ContextFullError: the prompt does not fit the context (a 400, :func:`_api_error`).
        """
        req, rt = job.request, self.rt
        if self.verbose:
            print(f"kvchat serve: request: {req.user!r} ({len(req.turns)} earlier turns)", file=sys.stderr)
        settings = {**new_settings([]), "template_kwargs": req.template_kwargs}
        try:
            fmt = rt.chat_format(settings)
        except ChatTemplateError as exc:  # only the request's tools make a template fail: its own was checked
            raise ApiError(400, f"tools: the model's chat template cannot render them: {exc}", param="tools") from None
        _refuse_too_many_turns(fmt, len(req.turns), rt.engine)  # before tokenizing them all on this thread
        fp = rt.info.fingerprint
        rendered = render(fmt, req.system, req.turns, lambda ids, text: generated_answer(ids, text, fp), req.user_roles)
        job.drift = rendered.drift
        job.user = fmt.user_turn(req.user, req.user_roles[-1])
        prompt = len(rendered.token_ids) + len(job.user.ids)
        close = len(fmt.assistant_close_ids(None))
        rt.engine.check_fits(prompt + close + 1, f"the conversation is {prompt} tokens")  # one answer token at least
        room = rt.engine.max_context - prompt - close
        req.params.max_tokens = min(req.max_tokens or DEFAULT_MAX_TOKENS, room)
        job.rules = self._rules(req)
        service = ChatService(rt, batch_interval_s=0, loop=self.loop, store=self.store,
                              branch_on_conflict=True)  # another process changed the chat: branch, as below
        if req.turns and self.store:  # the chat's last turn may still be on its way to disk: its snapshot
            self.persist.flush()  # gives the resume what the pool alone cuts back to a chunk edge
        found = chat_with_ids(rendered.token_ids, fp) if req.turns else None
        busy = {j.service.chat.chat_id for j in [*self.running, *self.queued] if j.service and j.service.chat}
        if found and self.store and found not in busy:  # a chat answered by another request now: branch off
            service.open_chat(found, restore=False)
        else:
            service.start_given_chat(req.system, settings, rendered.history, rendered.user_turns)
        if rt.engine.dense is not None:  # several chats run at once: each reads its own contiguous K/V copy
            service.chat.session.sequence.dense = DenseKV(rt.engine.pool, rt.engine.blocks)
        job.service = service
        need = rt.engine.blocks.blocks_needed(prompt + req.params.max_tokens + 2) + 1  # + a block copied on write
        job.need_blocks = min(need, rt.engine.pool.num_blocks)

    def _rules(self, req: ChatRequest) -> TokenRules | None:
        """The sampler's hook for the request's ``logit_bias``, ``response_format`` and ``logprobs`` (None when
        it uses none of them).

        Raises:
            ApiError: 400 for a ``logit_bias`` id outside the vocabulary or a grammar this tokenizer refuses.
        """
        if not (req.logit_bias or req.grammar or req.top_logprobs is not None):
            return None
        vocab = self.grammars.vocab_size
        bad = [i for i in req.logit_bias if i >= vocab]
        if bad:
            raise ApiError(400, f"logit_bias: token id {bad[0]} is outside the vocabulary (0 to {vocab - 1})",
                           param="logit_bias")
        try:
            constraint = self.grammars.constraint(req.grammar) if req.grammar else None
        except GrammarError as exc:
            raise ApiError(400, str(exc), param="response_format", code="invalid_json_schema") from None
        return TokenRules(req.logit_bias, constraint, req.top_logprobs)

    def _new_logprobs(self, job: Job) -> dict | None:
        """The OpenAI ``logprobs`` object of the tokens picked since the last push (None: not asked for); the
        end-of-answer id is no text, so it has no entry (as OpenAI's)."""
        if job.rules is None or job.rules.top_logprobs is None:
            return None
        entries: list[TokenLogprob] = job.rules.logprobs[job.logprobs_sent:]
        job.logprobs_sent += len(entries)
        stops = self.grammars.stop_ids
        return logprobs_block([e for e in entries if e.token_id not in stops], self.grammars.token_bytes)

    def _ended(self, job: Job, fut: Future) -> None:
        """The turn's steps ended on the loop: answer the request (the result or the error that ended it)."""
        exc = fut.exception()
        if exc is not None:  # the service rolled the turn back (or kept a stored one); answer with the error
            self._fail(job, exc)
        else:
            self._finish(job, fut.result())

    def _on_event(self, job: Job, event) -> None:
        """The service's events on this thread: stream answer text, holding back a possible stop string;
        answer the request once its turn is stored (:class:`TurnDone`, before the answer's recompute)."""
        if isinstance(event, TurnDone):
            self._answer(job, event)
            return
        if not isinstance(event, TokenBatch) or job.stop_at is not None:
            return
        if job.first_at is None:
            job.first_at = time.perf_counter()
        job.text += event.text
        req, stops = job.request, job.request.stop
        hits = [i for i in (job.text.find(s, max(0, job.sent - len(s))) for s in stops) if i >= 0]
        if req.tool_choice == "auto" and not req.parallel_tool_calls:  # one call at most: the answer ends with it
            hits += [i for i in [first_call_end(job.text, req.tool_style)] if i is not None]
        if hits:
            job.stop_at = min(hits)
            job.cancel.set()  # the turn ends after this token
            self._push_text(job, job.stop_at)
            return
        hold = max((k for s in stops for k in range(1, len(s)) if job.text.endswith(s[:k])), default=0)
        self._push_text(job, len(job.text) - hold)

    def _stored_text(self, job: Job, text: str) -> str:
        """The answer's text as stored (the turn's ``answer_text``, on the loop thread): cut where the client's
        answer was (a stop string, the end of the one call allowed), calls rendered as a client resends them
        (:func:`kvchat.server.protocol.stored_answer_text`); the ids stay those generated, so the resent
        history maps back to them token-exactly."""
        stats = job.service.chat.session.last_turn.stats
        if job.stop_at is not None:  # a stop string or the one call allowed ended it: the cancel that followed
            stats.finish_reason = "stop"  # only stopped the decoding (the end of a call may be the last text)
        text = text[: job.stop_at]
        return stored_answer_text(job.request, text, stats.finish_reason)

    def _push_text(self, job: Job, upto: int) -> None:
        if upto > job.sent:
            job.push(("text", job.text[job.sent:upto], self._new_logprobs(job)))
            job.sent = upto

    def _finish(self, job: Job, done) -> None:
        """The turn's generator ended: answer it if :meth:`_answer` has not, give its blocks back."""
        self.running.remove(job)
        if not job.answered:
            self._answer(job, done)
        self._release(job)

    def _answer(self, job: Job, done) -> None:
        """Push the final text and the :class:`Finished` (the turn is stored; its recompute may follow), or,
        for a turn that did not end by itself (cancelled by a shutdown or a gone client), an error: the
        client must not take a cut answer for a complete one."""
        job.answered = True
        stats = done.stats
        if job.stop_at is None and done.text.startswith(job.text):
            job.text = done.text
            self._push_text(job, len(job.text))
        text = job.text[: job.stop_at] if job.stop_at is not None else job.text
        finish = FINISH_REASONS.get(stats.finish_reason)
        if finish is None:
            why = "the server is shutting down" if self._stopping else "the request was cancelled"
            where = f" (stored in chat {done.chat_id})" if done.chat_id else ""
            job.push(("error", ApiError(503, f"{why}: the answer was cut after {stats.new_tokens} tokens{where}",
                                        "server_error", code="answer_cut")))
            return
        ttft = ((job.first_at or time.perf_counter()) - job.received) * 1e3
        miss = stats.miss_reason
        if job.drift and stats.reused_tokens < stats.prompt_tokens - self.rt.engine.spec.block_size:
            miss = job.drift if miss is None else f"{job.drift}; {miss}"
        job.push(("done", Finished(text, finish, stats, ttft, miss, done.chat_id, self._new_logprobs(job))))

    def _fail(self, job: Job, exc: BaseException) -> None:
        if job in self.running:
            self.running.remove(job)
        self._release(job)
        if job.answered:  # the turn is stored and answered; only what followed failed: say it on stderr
            print(f"kvchat serve: after an answer: {type(exc).__name__}: {exc}", file=sys.stderr)
        else:
            job.push(("error", _api_error(exc)))

    def _release(self, job: Job) -> None:
        """Give the request's blocks back to the pool (they stay in the prefix cache)."""
        if job.service is not None and job.service.chat is not None:
            job.service.chat.session.close()
            job.service.chat = None


def _settling(job: Job) -> bool:
    """The job's answer has streamed and is being recomputed as prefill chunks (``PrefillChunk.settle``)."""
    return job.req is not None and job.req.settling


def _refuse_too_many_turns(fmt, turns: int, engine) -> None:
    """Refuse a request whose ``turns`` earlier (user, assistant) pairs plus its last user message cannot fit
    the context, from a lower bound on their tokens (:meth:`ChatFormat.min_user_turn_tokens`; an assistant
    message holds at least the closing ids), so a huge history is not tokenized first.

    Raises:
        kvchat.context_fit.ContextFullError: it cannot fit (a 400 ``context_length_exceeded``, :func:`_api_error`).
    """
    close = len(fmt.assistant_close_ids(None))
    least = (turns + 1) * fmt.min_user_turn_tokens() + turns * close
    engine.check_fits(least + close + 1, f"the conversation has {2 * turns + 1:,} user and assistant messages, "
                                         f"at least {least:,} tokens")  # one answer token at least


def _api_error(exc: BaseException) -> ApiError:
    """The HTTP answer to an exception raised while preparing or running a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ContextFullError):
        return ApiError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, ConversationConflictError):  # the turn branches instead (ChatService.branch_on_conflict)
        return ApiError(409, str(exc), code="conversation_conflict")
    if isinstance(exc, PoolFullError):
        return ApiError(503, str(exc), "server_error", code="pool_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, (ValueError, ChatTemplateError)):
        return ApiError(400, str(exc))
    if isinstance(exc, OSError):
        return ApiError(503, f"the answer could not be stored: {exc.strerror or exc}", "server_error")
    traceback.print_exception(exc, file=sys.stderr)
    return ApiError(500, f"internal error: {type(exc).__name__}", "server_error")

