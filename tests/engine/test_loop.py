"""The engine loop on the real model: a turn alone on the caller's thread, on the loop's thread, and batched with
others gives the same tokens; a call runs between iterations on the loop's thread."""

from __future__ import annotations

import threading

import pytest

from kvchat.conversation.records import new_settings
from kvchat.engine.dense_kv import DenseKV
from kvchat.engine.loop import EngineLoop, LoopStoppedError
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.sequence import DecodeStep
from kvchat.engine.session import Session
from kvchat.runtime import load_runtime

PROMPTS = ["Name a colour.", "Count to five.", "Say hello in French."]


@pytest.fixture(scope="module")
def rt(smol_info):
    return load_runtime(None, "fp8")


def _session(rt) -> Session:
    return Session.new(rt.engine, rt.chat_format(new_settings([])), "You are brief.", [])


def _answer_ids(loop: EngineLoop, rt, prompt: str) -> list[int]:
    s = _session(rt)
    loop.run(s.turn(prompt, SamplingParams(max_tokens=6)))
    ids = list(s.token_ids)
    s.close()
    return ids


def test_a_turn_gives_the_same_tokens_on_the_callers_thread_on_the_loops_and_in_a_batch(rt):
    alone = EngineLoop(rt.engine, thread=False, snapshots=False)
    with pytest.raises(RuntimeError, match="no thread of its own"):
        alone.submit(iter(()))
    on_caller = [_answer_ids(alone, rt, p) for p in PROMPTS]
    alone.close()

    loop = EngineLoop(rt.engine, snapshots=False)
    try:
        on_loop = [_answer_ids(loop, rt, p) for p in PROMPTS]
        sessions = [_session(rt) for _ in PROMPTS]
        if rt.engine.dense is not None:  # several chats at once read their own dense copies (as the server's)
            for s in sessions:
                s.sequence.dense = DenseKV(rt.engine.pool, rt.engine.blocks)
        steps_before = loop.decode_steps
        with loop._wake:  # the loop takes none of them before all are queued: they start in one iteration
            requests = [loop.submit(s.turn(p, SamplingParams(max_tokens=6))) for s, p in zip(sessions, PROMPTS)]
        for req in requests:
            req.future.result(timeout=300)
        batched = [list(s.token_ids) for s in sessions]
        generated = sum(s.last_turn.stats.new_tokens for s in sessions)
        for s in sessions:
            s.close()
        assert loop.decode_steps - steps_before < generated - len(PROMPTS)  # shared forwards, not one per token
    finally:
        loop.close()
    assert on_loop == on_caller
    assert batched == on_caller  # int8 weights on a CPU: a batched row is bitwise the row alone


def test_a_call_runs_on_the_loops_thread_and_its_error_reaches_the_caller(rt):
    loop = EngineLoop(rt.engine, snapshots=False)
    try:
        assert loop.call(threading.current_thread) is loop._thread
        with pytest.raises(ValueError, match="from the loop"):
            loop.call(lambda: (_ for _ in ()).throw(ValueError("from the loop")))
        assert loop.alive  # an exception in a call does not end the loop
    finally:
        loop.close()
    assert not loop.alive


class _BrokenSampler:
    """A sampler whose pick fails, as a grammar the matcher cannot follow does."""

    def pick(self, logits):
        raise RuntimeError("sampler broke")


def _with_broken_sampler(steps):
    """``steps`` with every ``DecodeStep`` handed to the loop carrying :class:`_BrokenSampler` (an error the
    loop throws back in reaches the turn)."""
    reply = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as done:
            return done.value
        if isinstance(step, DecodeStep):
            step = DecodeStep(step.sequence, step.token_ids, _BrokenSampler())
        try:
            reply = yield step
        except BaseException as exc:  # noqa: BLE001 - the turn's own rollback runs, then its error goes on
            steps.throw(exc)


def test_a_sampler_that_fails_ends_its_own_request_alone(rt):
    """One request's sampler raises in a batched step: that request fails, the other in the same forward
    answers as it does alone, and the loop takes later requests."""
    alone = EngineLoop(rt.engine, thread=False, snapshots=False)
    expected = _answer_ids(alone, rt, PROMPTS[0])
    alone.close()
    loop = EngineLoop(rt.engine, snapshots=False)
    try:
        good, bad = _session(rt), _session(rt)
        if rt.engine.dense is not None:
            for s in (good, bad):
                s.sequence.dense = DenseKV(rt.engine.pool, rt.engine.blocks)
        with loop._wake:  # both start in one iteration and decode in one forward
            ok = loop.submit(good.turn(PROMPTS[0], SamplingParams(max_tokens=6)))
            broken = loop.submit(_with_broken_sampler(bad.turn(PROMPTS[1], SamplingParams(max_tokens=6))))
        ok.future.result(timeout=300)
        with pytest.raises(RuntimeError, match="sampler broke"):
            broken.future.result(timeout=300)
        assert list(good.token_ids) == expected
        good.close()
        bad.close()
        assert _answer_ids(loop, rt, PROMPTS[2])  # a later request runs
        assert loop.running == [] and loop.alive
    finally:
        loop.close()


HANG_GUARD_S = 60  # a wait that would otherwise never end fails the test instead of stalling the suite


class _HeldAtExit(EngineLoop):
    """A loop whose thread, once it has decided to end, waits for the test before leaving: the window in
    which a request handed to it could be queued after the thread's last look at its inbox."""

    def __init__(self, *args, **kwargs):
        self.decided = threading.Event()
        self.release = threading.Event()
        super().__init__(*args, **kwargs)

    def _iteration(self) -> bool:
        ends = super()._iteration()
        if ends:
            self.decided.set()
            self.release.wait(HANG_GUARD_S)
        return ends


def _idle_steps():
    return 0
    yield  # a generator: the loop's steps


def test_work_handed_to_a_loop_that_is_ending_is_refused_not_left_waiting(rt):
    loop = _HeldAtExit(rt.engine, snapshots=False)
    try:
        loop.request_stop()
        assert loop.decided.wait(HANG_GUARD_S)
        assert loop.alive  # the thread still runs, past its last look at the queue
        with pytest.raises(LoopStoppedError, match="stopped"):
            loop.submit(_idle_steps()).future.result(timeout=HANG_GUARD_S)
        with pytest.raises(LoopStoppedError, match="stopped"):
            loop.call(lambda: None)
    finally:
        loop.release.set()
        loop.close()
    with pytest.raises(LoopStoppedError, match="stopped"):
        loop.run(_idle_steps())


class _Killed(BaseException):
    """Ends the loop's thread the way an interpreter exit does (not an ``Exception`` the loop survives)."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death is the case
def test_work_handed_to_a_loop_whose_thread_died_is_refused_and_queued_work_fails(rt):
    entered, go_on = threading.Event(), threading.Event()

    def admit() -> bool:
        if go_on.is_set():
            raise _Killed
        return False

    def blocked_call():
        entered.set()
        go_on.wait(HANG_GUARD_S)

    loop = EngineLoop(rt.engine, snapshots=False, admit=admit)
    done = threading.Event()
    outcome: list[BaseException | None] = []

    def call_in_background():
        try:
            loop.call(blocked_call)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test checks what reached the caller
            outcome.append(exc)
        done.set()

    threading.Thread(target=call_in_background, daemon=True).start()
    assert entered.wait(HANG_GUARD_S)
    with loop._wake:  # queued while the thread is busy in the call: the next iteration's admit kills it
        queued = loop.submit(_idle_steps())
        go_on.set()
    with pytest.raises(LoopStoppedError):
        queued.future.result(timeout=HANG_GUARD_S)
    assert done.wait(HANG_GUARD_S) and outcome == [None]  # the call that ran before ended normally
    loop._thread.join(HANG_GUARD_S)
    assert not loop.alive
    with pytest.raises(LoopStoppedError):
        loop.submit(_idle_steps())
    with pytest.raises(LoopStoppedError):
        loop.call(lambda: None)
