"""The engine loop: the one thread that runs the engine, under every front end.

A turn reaches the engine as a **request**: a generator of steps (a chat
turn, :meth:`kvchat.conversation.service.ChatService.turn_steps`, or a
prefix prefill) that yields :class:`~kvchat.engine.sequence.DecodeStep` when
it needs its next token and :class:`~kvchat.engine.sequence.PrefillChunk`
after each prefill chunk, and returns its result. :meth:`EngineLoop.submit`
queues one from any thread and returns a :class:`~concurrent.futures.Future`;
:meth:`EngineLoop.run` waits for it. Each iteration of the loop thread

1. calls the ``admit`` hook (the server's queue and admission policy submits
   requests there; ``kvchat ask`` and the TUI submit directly);
2. runs one decode step for every request waiting on a ``DecodeStep`` in
   **one forward** (:meth:`kvchat.engine.runner.Engine.decode_batch`) and
   picks every row's next id (:func:`sample_step`): a lone chat is a batch of
   one;
3. runs the other requests' steps, answers' recomputes
   (``PrefillChunk.settle``) first, then prefills in arrival order, until
   :data:`PREFILL_BUDGET_TOKENS` tokens were computed, so running streams keep
   flowing while a long prompt is prefilled.

:meth:`EngineLoop.call` runs a plain function on the loop thread between two
iterations, to its end (opening a chat restores its K/V into the pool, a
regenerate cuts its blocks): a request it runs (:meth:`run` from inside it)
is driven there, alone. The loop holds the engine's ``torch.inference_mode``
and owns the :class:`~kvchat.engine.persistence.KVPersist`.

A loop without a thread of its own (``thread=False``: ``kvchat ask``, a
benchmark, a test) is driven by its caller: :meth:`run` runs a request there,
a batch of one, with the same steps, decode and sampling as the threaded
loop. On a CPU this keeps the forwards on the thread that loaded the model
(or that one's successor): PyTorch's OpenMP runtime keeps a worker pool per
thread that ran a parallel region, and two live pools on the same cores slow
every step (:func:`kvchat.cpu_threads.on_own_thread`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from kvchat.engine.block_manager import PoolFullError
from kvchat.engine.runner import PREFILL_CHUNK_TOKENS, Engine
from kvchat.engine.sampling import sample_rows
from kvchat.engine.sequence import DecodeStep, PrefillChunk

IDLE_WAIT_S = 0.5  # the thread sleeps at most this long with nothing to do
PREFILL_BUDGET_TOKENS = PREFILL_CHUNK_TOKENS  # prefill tokens per iteration (between two decode steps)

Steps = Generator[Any, Any, Any]


class LoopStoppedError(RuntimeError):
    """Work was handed to an engine loop whose thread has ended or is ending (stopped, or died)."""


@dataclass(eq=False)
class Request:
    """One request in the loop: its steps, the step it waits on, its result.

    ``progress(done, total)`` (tokens) is called on the loop thread after each prefill chunk that is not an
    answer's recompute; it may raise to stop the request (the exception goes into the steps, which roll back).
    ``on_text(piece)`` gets each text piece the steps yield (a bare :meth:`kvchat.engine.session.Session.turn`
    yields its answer's text; the conversation service's turn emits it itself). ``future`` gets the steps'
    return value or the exception that ended them.
    """

    steps: Steps
    progress: Callable[[int, int], None] | None = None
    on_text: Callable[[str], None] | None = None
    future: Future = field(default_factory=Future)
    waiting: object = None  # the last step yielded: DecodeStep, PrefillChunk, or None before the first

    @property
    def settling(self) -> bool:
        """The request's answer was delivered and is being recomputed as prefill chunks."""
        return isinstance(self.waiting, PrefillChunk) and self.waiting.settle


def sample_step(requests: Sequence[Request], logits: torch.Tensor) -> list[int | Exception]:
    """The next id of each request waiting on a ``DecodeStep``, from one batched forward's float32 logits
    ``[len(requests), vocab_size]`` (row ``i`` is ``requests[i]``'s), each row by its step's sampler; all
    ids come back in one host read. The one place the loop samples: per-request logit processing goes here.

    A row whose sampler raises gets its exception in place of an id (:func:`sample_rows`): it ends that
    request alone.
    """
    return sample_rows([r.waiting.sampler for r in requests], logits)


class EngineLoop:
    """The engine's thread; see the module docstring.

    Args:
        engine: the loaded engine (used by this thread only from now on).
        touch_lru: a snapshot restore stamps its chunks' LRU time (``kvchat serve --no-store``: False).
        admit: called on the loop thread at the start of each iteration (the server's queue); it submits
            requests with :meth:`submit` and returns True while it holds work it may admit later, so the loop
            does not sleep.
        thread: run on a thread of its own (several requests at once); False: :meth:`run` drives one request
            on its caller's thread (see the module docstring).
        snapshots: own a snapshot store (:attr:`persist`); False: none (a benchmark or a test of the engine
            alone, which then needs neither SQLite nor a data dir).
    """

    def __init__(self, engine: Engine, touch_lru: bool = True, admit: Callable[[], bool] | None = None,
                 thread: bool = True, snapshots: bool = True):
        self.engine = engine
        self.persist = None
        if snapshots:  # imported here: the store's modules (SQLite) stay out of an engine-only process
            from kvchat.engine.persistence import KVPersist

            self.persist = KVPersist(engine, touch_lru=touch_lru)
        self.running: list[Request] = []
        self.decode_steps = 0  # batched forwards run (health and bench)
        self._admit = admit
        self._inbox: list[Request] = []
        self._calls: list[tuple[Callable[[], Any], Future]] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._stopped = False  # the thread has left (or is leaving) its loop: nothing queued now would run
        self._woken = False  # a wake() since the last iteration began: no sleep this time
        self._thread = threading.Thread(target=self._loop, name="kvchat-engine", daemon=True) if thread else None
        if self._thread is not None:
            self._thread.start()

    # ---- any thread ------------------------------------------------------------------------
    def submit(self, steps: Steps, progress: Callable[[int, int], None] | None = None,
               on_text: Callable[[str], None] | None = None) -> Request:
        """Queue ``steps`` (any thread, the loop's own included); returns the :class:`Request`, whose
        ``future`` ends with the steps' result.

        A request submitted while the loop stops (:meth:`request_stop`) still runs if the thread has not yet
        decided to end; once it has, this raises, so no caller waits on a future nothing will end.

        Raises:
            LoopStoppedError: the loop's thread has ended or is ending (stopped, or died).
            RuntimeError: the loop has no thread of its own (:meth:`run` drives that one).
        """
        if self._thread is None:
            raise RuntimeError("this engine loop has no thread of its own: run() drives its requests")
        req = Request(steps, progress, on_text)
        with self._wake:
            self._check_running()
            self._inbox.append(req)
            self._wake.notify()
        return req

    def run(self, steps: Steps, progress: Callable[[int, int], None] | None = None,
            on_text: Callable[[str], None] | None = None) -> Any:
        """Run ``steps`` to their end and return their result (re-raising what ended them); ``progress`` and
        ``on_text`` as :class:`Request`'s. On the loop thread (inside :meth:`call`), or on a loop without a
        thread, they run there and then, alone; from any other thread, the caller waits."""
        if not self._on_loop_thread():
            return self.submit(steps, progress, on_text).future.result()
        req = Request(steps, progress, on_text)
        with torch.inference_mode():  # held already on the loop thread; the caller's, without one
            self._advance(req, None)
            while not req.future.done():
                if isinstance(req.waiting, DecodeStep):
                    self._decode([req])
                else:
                    self._advance(req, None)
        return req.future.result()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the loop thread between two iterations and return its result (re-raising its
        exception). On the loop thread itself, or on a loop without a thread, it runs at once.

        Raises:
            LoopStoppedError: the loop's thread has ended or is ending (as :meth:`submit`).
        """
        if self._on_loop_thread():
            with torch.inference_mode():
                return fn(*args)
        fut: Future = Future()
        with self._wake:
            self._check_running()
            self._calls.append((lambda: fn(*args), fut))
            self._wake.notify()
        return fut.result()

    def wake(self) -> None:
        """Wake the loop thread (the ``admit`` hook has new work)."""
        with self._wake:
            self._woken = True
            self._wake.notify()

    def _check_running(self) -> None:
        """Raise :class:`LoopStoppedError` unless the loop's thread will still take queued work (hold ``_wake``)."""
        if self._stopped or not self._thread.is_alive():
            raise LoopStoppedError("the engine loop has stopped")

    def _on_loop_thread(self) -> bool:
        return self._thread is None or threading.current_thread() is self._thread

    @property
    def alive(self) -> bool:
        """The loop thread runs (False once it has stopped or died, and for a loop without a thread)."""
        return self._thread is not None and self._thread.is_alive()

    def request_stop(self) -> None:
        """Let the loop thread end once nothing runs and no call or request is queued (any thread)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()

    def close(self) -> None:
        """:meth:`request_stop`, wait for the thread to end, then flush and stop the snapshot writes (if any)."""
        self.request_stop()
        if not self._on_loop_thread():
            self._thread.join()
        if self.persist is not None:
            self.persist.close()

    # ---- the loop thread -------------------------------------------------------------------
    def _loop(self) -> None:
        # every forward of a loop with a thread runs on this thread, the rollbacks of work left at its end too
        # (they write the pool's and the session's inference tensors)
        with torch.inference_mode():
            try:
                while True:
                    try:
                        if self._iteration():
                            return
                    except Exception as exc:  # noqa: BLE001 - a bug in one step: fail the running requests, keep going
                        for req in [r for r in self.running if not r.settling]:  # answered ones finish next
                            self._abort(req, exc)
                        self.running = [r for r in self.running if not r.future.done()]  # never decoded again
            finally:
                self._fail_left_over()

    def _fail_left_over(self) -> None:
        """The thread ends: refuse new work, and end what is queued or running with :class:`LoopStoppedError`
        (after a normal stop nothing is; a thread killed by a ``BaseException`` may leave some)."""
        with self._wake:
            self._stopped = True
            calls, self._calls = self._calls, []
            left = self.running + self._inbox
            self.running, self._inbox = [], []
        stopped = LoopStoppedError("the engine loop has stopped")
        for _, fut in calls:
            fut.set_exception(stopped)
        for req in left:
            try:
                self._abort(req, stopped)
            except BaseException:  # noqa: BLE001 - its rollback failed too: its caller still gets the error
                self._end(req, error=stopped)

    def _iteration(self) -> bool:
        """One iteration (calls, admit, one batched decode, prefill chunks up to the budget); True to stop."""
        with self._wake:
            self._woken = False
        pending = self._admit() if self._admit is not None else False
        with self._wake:
            if not (self._inbox or self._calls or self.running or pending or self._stopping or self._woken):
                self._wake.wait(IDLE_WAIT_S)
            calls, self._calls = self._calls, []
            self.running.extend(self._inbox)
            self._inbox.clear()
            if self._stopping and not (calls or self.running or pending):
                self._stopped = True  # decided under the lock: a submit from now on raises instead of queueing
                return True
        for fn, fut in calls:
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller re-raises it
                fut.set_exception(exc)
        decoding = [r for r in self.running if isinstance(r.waiting, DecodeStep)]
        if decoding:
            self._decode(decoding)
        starting = [r for r in self.running if not isinstance(r.waiting, DecodeStep)]
        starting.sort(key=lambda r: not r.settling)  # answers' recomputes first (they hold back new requests)
        budget = PREFILL_BUDGET_TOKENS
        for req in starting:
            while budget > 0 and not req.future.done() and not isinstance(req.waiting, DecodeStep):
                self._advance(req, None)
                step = None if req.future.done() else req.waiting
                budget -= max(step.tokens, 1) if isinstance(step, PrefillChunk) else 1
        self.running = [r for r in self.running if not r.future.done()]
        return False

    def _decode(self, reqs: list[Request]) -> None:
        """One forward for every request in ``reqs`` (each waits on a ``DecodeStep``), then each one's id."""
        try:
            logits = self.engine.decode_batch([r.waiting for r in reqs])
        except PoolFullError as exc:  # admission should prevent it; fail that request, keep the others
            self._abort(reqs[getattr(exc, "index", 0)], exc)
            return
        except Exception as exc:  # noqa: BLE001 - which row failed is unknown: fail the batch, keep going
            for req in reqs:
                self._abort(req, exc)
            return
        self.decode_steps += 1
        for req, token in zip(reqs, sample_step(reqs, logits)):
            if isinstance(token, Exception):
                self._abort(req, token)
            else:
                self._advance(req, token)

    def _advance(self, req: Request, reply) -> None:
        """Run ``req``'s steps to the next one (one prefill chunk, or up to its next decode step)."""
        try:
            step = req.steps.send(reply)
            while isinstance(step, str):
                if req.on_text is not None:
                    req.on_text(step)
                step = req.steps.send(None)
            req.waiting = step
            if req.progress is not None and isinstance(step, PrefillChunk) and not step.settle:
                req.progress(step.done, step.total)
        except StopIteration as done:
            self._end(req, result=done.value)
        except BaseException as exc:  # noqa: BLE001 - the steps rolled back (or the progress callback raised)
            if req.steps.gi_frame is not None and not req.future.done():  # raised outside the steps: end them
                self._abort(req, exc)
            else:
                self._end(req, error=exc)

    def _abort(self, req: Request, exc: BaseException) -> None:
        """End ``req``'s steps with ``exc`` (they roll back and re-raise it, or raise their own)."""
        try:
            req.steps.throw(exc)
        except StopIteration as done:
            self._end(req, result=done.value)
        except BaseException as err:  # noqa: BLE001 - the re-raised error (or the steps' own)
            self._end(req, error=err)
        else:  # the steps did not end: close them
            req.steps.close()
            self._end(req, error=exc)

    @staticmethod
    def _end(req: Request, result: Any = None, error: BaseException | None = None) -> None:
        if req.future.done():
            return
        if error is not None:
            req.future.set_exception(error)
        else:
            req.future.set_result(result)


def run_alone(engine: Engine, steps: Steps, progress: Callable[[int, int], None] | None = None,
              on_text: Callable[[str], None] | None = None) -> Any:
    """Run ``steps`` on a new engine loop over ``engine`` without a thread (on the caller's), then close it:
    for a benchmark or a test that drives one engine by itself. ``progress``, ``on_text``: as
    :class:`Request`'s. Returns the steps' result; raises what ended them."""
    loop = EngineLoop(engine, thread=False, snapshots=False)
    try:
        return loop.run(steps, progress, on_text)
    finally:
        loop.close()
