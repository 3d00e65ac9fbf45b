"""The served engine loop keeps a request's failure to that request (issue 29): bad text, a
preparation that raises, a client callback that raises; and when a step itself fails, every
waiter hears and the server is told. Preparation runs off the loop thread."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from kvflow import SamplingParams
from kvflow.orchestrator.engine_loop import EngineLoop, EngineLoopClosed
from kvflow.orchestrator.input_processor import InputProcessor
from kvflow.orchestrator.outputs import RequestOutput
from kvflow.text.tokenizer import ChatPrompt

WAIT_S = 120  # generous: a busy machine; no test compares a duration


@pytest.fixture()
def engine(tiny_engines):
    from kvflow.orchestrator.llm import create_engine

    engine = create_engine(str(tiny_engines["llama-gqa4", "torch"]), debug_checks=True)
    yield engine
    engine.close()


class Outputs:
    """A request's callback: its outputs, and an event set by the final one."""

    def __init__(self) -> None:
        self.items: list[RequestOutput] = []
        self.done = threading.Event()

    def __call__(self, out: RequestOutput) -> None:
        self.items.append(out)
        if out.finished:
            self.done.set()

    def final(self) -> RequestOutput:
        assert self.done.wait(WAIT_S), "no final output"
        return self.items[-1]


def run(loop: EngineLoop, request_id: str, prompt, **params) -> RequestOutput:
    outputs = Outputs()
    loop.submit(request_id, prompt, SamplingParams(**params), outputs)
    return outputs.final()


GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def on_preparer(gate: threading.Event, entered: threading.Event | None = None):
    """An ``is_cancelled`` that holds the request's preparation until ``gate`` is set (the
    preparer asks it first) and answers "not cancelled" at once elsewhere (the loop polls it
    before every step)."""
    def is_cancelled() -> bool:
        if "prep" in threading.current_thread().name:
            if entered is not None:
                entered.set()
            return not gate.wait(WAIT_S)
        return False
    return is_cancelled


def test_a_lone_surrogate_fails_its_request_alone(engine):
    loop = EngineLoop(engine)
    try:
        out = run(loop, "bad", "hi \udc00", **GREEDY)
        assert out.error_code == "bad_request"
        assert "prompt holds a lone surrogate (U+DC00) at character 3" in out.error
        assert engine.counters.rejected_by_cause["bad_request"] == 1
        served = run(loop, "next", "hello", **GREEDY)
        assert served.error is None and len(served.token_ids) == 4
    finally:
        loop.shutdown()
    assert loop.error is None


def test_chat_messages_name_the_message_holding_a_surrogate():
    with pytest.raises(ValueError, match=r"messages\[1\]\.content holds a lone surrogate"):
        ChatPrompt([{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "a \udc00"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.name holds a lone surrogate"):
        ChatPrompt([{"role": "user", "content": "hi", "name": "\ud800"}])
    with pytest.raises(ValueError, match=r"stop\[1\] holds a lone surrogate"):
        SamplingParams(stop=["ok", "\udfff"])


def test_an_assistant_turn_may_have_null_content():
    prompt = ChatPrompt([{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None},
                         {"role": "user", "content": "again"}])
    assert prompt.messages[1]["content"] == ""
    with pytest.raises(ValueError, match=r"messages\[0\]\.content must be a string"):
        ChatPrompt([{"role": "user", "content": None}])


def test_a_preparation_that_raises_is_a_500_naming_what_failed(engine):
    loop = EngineLoop(engine)
    try:
        out = run(loop, "odd", [None, 3], **GREEDY)  # int(None): a TypeError, not a ValueError
        assert out.error_code == "engine_error"
        assert "preparing the request failed" in out.error and "TypeError" in out.error
        assert run(loop, "next", "hello", **GREEDY).error is None
    finally:
        loop.shutdown()
    assert loop.error is None


def test_a_callback_that_raises_aborts_its_request_and_the_loop_goes_on(engine):
    loop = EngineLoop(engine)

    def broken(out: RequestOutput) -> None:
        raise RuntimeError("the client's stream is gone")

    try:
        loop.submit("broken", "hello there", SamplingParams(max_tokens=50, ignore_eos=True),
                    broken)
        assert run(loop, "next", "hello", **GREEDY).error is None
        used, running = loop.call(lambda e: (e.kv.pool.num_used_blocks, e.scheduler.num_running))
    finally:
        loop.shutdown()
    assert loop.error is None and (used, running) == (0, 0)


def test_preparation_runs_off_the_loop_thread(engine):
    """While one request's preparation is held, another keeps stepping (were it prepared on
    the loop thread, the held preparation would stop every step)."""
    loop = EngineLoop(engine)
    streaming = Outputs()
    tokens_seen = threading.Event()

    def on_stream(out: RequestOutput) -> None:
        streaming(out)
        if len(out.token_ids) >= 3:
            tokens_seen.set()

    try:
        loop.submit("running", "hello", SamplingParams(max_tokens=30, ignore_eos=True),
                    on_stream)
        held = Outputs()
        loop.submit("held", "abc", SamplingParams(**GREEDY), held,
                    is_cancelled=on_preparer(tokens_seen))
        # Its preparation was released by the other request's tokens: not cancelled.
        assert held.final().error is None and not held.final().aborted
        assert streaming.final().error is None
    finally:
        loop.shutdown()


def test_an_abort_during_preparation_ends_the_request_at_once(engine):
    loop = EngineLoop(engine)
    gate = threading.Event()
    entered = threading.Event()
    try:
        outputs = Outputs()
        loop.submit("held", "abc", SamplingParams(**GREEDY), outputs,
                    is_cancelled=on_preparer(gate, entered))
        assert entered.wait(WAIT_S)
        loop.abort("held")
        final = outputs.final()  # before the preparation is released
        gate.set()
        assert final.aborted and final.error is None
        assert run(loop, "next", "hello", **GREEDY).error is None
        used = loop.call(lambda e: e.kv.pool.num_used_blocks)
    finally:
        gate.set()
        loop.shutdown()
    assert len(outputs.items) == 1 and used == 0


class FailingRunner:
    """The engine's runner, which raises from its third model step on."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.steps = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _step(self, fn, step):
        self.steps += 1
        if self.steps >= 3:
            raise RuntimeError("the device fell off the bus")
        return fn(step)

    def execute(self, step):
        return self._step(self.inner.execute, step)

    def execute_argmax(self, step):
        return self._step(self.inner.execute_argmax, step)


def test_a_failing_step_fails_every_waiter_and_reports_once(engine):
    engine.runner = FailingRunner(engine.runner)
    failures: queue.SimpleQueue[BaseException] = queue.SimpleQueue()
    loop = EngineLoop(engine, on_failure=failures.put)
    gate = threading.Event()
    try:
        running = [Outputs() for _ in range(3)]
        for k, outputs in enumerate(running):
            loop.submit(f"r{k}", f"prompt {k}", SamplingParams(max_tokens=20, ignore_eos=True),
                        outputs)
        pending = Outputs()  # still being prepared when the loop dies
        loop.submit("pending", "abc", SamplingParams(**GREEDY), pending,
                    is_cancelled=on_preparer(gate))
        error = failures.get(timeout=WAIT_S)
        assert "device fell off the bus" in repr(error)
        for outputs in (*running, pending):
            final = outputs.final()
            assert final.error_code == "engine_error" and "device fell off" in final.error
        late = Outputs()
        loop.submit("late", "hello", SamplingParams(**GREEDY), late)  # answered at once
        assert late.done.is_set() and "device fell off" in late.items[-1].error
        with pytest.raises(EngineLoopClosed, match=r"engine loop is closed.*device fell off"):
            loop.call(lambda e: e.counters.steps)
    finally:
        gate.set()
        loop.shutdown()
    assert not loop.is_alive and loop.error is error and failures.empty()


def test_oversized_text_is_refused_by_length_before_tokenizing(engine):
    inputs: InputProcessor = engine.inputs
    limit = inputs.max_prompt_chars
    assert limit == engine.options.max_model_len * inputs.max_token_chars
    with pytest.raises(ValueError, match=rf"prompt is {limit + 1} characters.*the limit is "
                                         rf"{limit}"):
        inputs.prepare("x" * (limit + 1), SamplingParams())
    messages = ChatPrompt([{"role": "user", "content": "y" * (limit // 2 + 1)}] * 2)
    with pytest.raises(ValueError, match=r"messages is \d+ characters"):
        inputs.prepare(messages, SamplingParams())
    # Text at the bound is only refused once tokenized: the bound never refuses what fits.
    assert inputs.max_token_chars >= 2


def test_a_call_on_a_closed_loop_fails_at_once(engine):
    """Not after the call's timeout: a closed loop will never answer, and the caller (Triton's
    thread, a metrics read) must not be held."""
    loop = EngineLoop(engine)
    assert loop.call(lambda e: e.counters.steps) == 0
    loop.shutdown()
    with pytest.raises(EngineLoopClosed, match="engine loop is closed"):
        loop.call(lambda e: e.counters.steps, timeout_s=WAIT_S)


def test_a_call_waiting_when_the_loop_stops_is_failed_not_left_to_time_out(engine):
    loop = EngineLoop(engine)
    held, release = threading.Event(), threading.Event()
    results: queue.SimpleQueue[object] = queue.SimpleQueue()

    def call(fn) -> None:
        try:
            results.put(loop.call(fn, timeout_s=WAIT_S))
        except Exception as e:  # noqa: BLE001  (the test's subject)
            results.put(e)

    def hold(_engine) -> str:
        held.set()
        assert release.wait(WAIT_S)
        return "held"

    threads = [threading.Thread(target=call, args=(hold,))]
    threads[0].start()
    try:
        assert held.wait(WAIT_S)  # the loop thread is inside the first call
        threads.append(threading.Thread(target=call, args=(lambda e: "never",)))
        threads[1].start()
        for _ in range(WAIT_S * 100):  # until the second call waits in the inbox
            if loop._inbox.qsize():
                break
            time.sleep(0.01)
        threads.append(threading.Thread(target=loop.shutdown, args=(WAIT_S,)))
        threads[2].start()
        assert loop._stopped.wait(WAIT_S)
    finally:
        release.set()
        for t in threads:
            t.join(WAIT_S)
    # The two callers' threads put their results in whatever order they are scheduled.
    got = [results.get(timeout=0), results.get(timeout=0)]
    assert got.count("held") == 1
    (late,) = [r for r in got if r != "held"]
    assert isinstance(late, EngineLoopClosed) and "engine loop is closed" in str(late)
    assert not loop.is_alive


def test_a_call_from_the_loop_thread_runs_at_once(engine):
    """From a step hook (or a callback), a call runs in place instead of queueing behind the
    very thread that would run it."""
    seen: list[int] = []
    loop = EngineLoop(engine, step_hook=lambda lp, _outs: seen.append(
        lp.call(lambda e: e.counters.steps)))
    try:
        assert run(loop, "r", "hello", **GREEDY).error is None
    finally:
        loop.shutdown()
    assert seen and seen[-1] >= 1
