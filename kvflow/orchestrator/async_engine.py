"""The engine loop in a background thread, and an asyncio API over it.

:class:`EngineLoop` owns an :class:`LLMEngine`: other threads submit and abort requests through
a queue, and get each request's outputs through a callback called on the loop thread. The Triton
backend uses it directly; :class:`AsyncLLMEngine` turns the callbacks into async iterators.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.outputs import ENGINE_ERROR_PREFIX, RequestOutput
from kvflow.orchestrator.sampling_params import SamplingParams
from kvflow.orchestrator.tokenizer import Prompt

OutputCallback = Callable[[RequestOutput], None]
# Called on the loop thread after every step with the step's outputs (and with [] after a
# change of state without a step): the documented way to watch a served engine.
StepHook = Callable[["EngineLoop", list[RequestOutput]], None]


class EngineLoop:
    """Runs ``engine.step()`` on a daemon thread while there is work; idle, it sleeps on its
    inbox. All engine state is touched by that thread alone.

    ``serving_time_s``: the loop thread's seconds spent serving around the steps (cancellation
    checks, the step hook, handing outputs to clients); the time inside steps is the engine's
    own ``counters.step_time_s``.
    """

    def __init__(self, engine: LLMEngine, name: str = "kvflow-engine-loop",
                 step_hook: StepHook | None = None) -> None:
        self.engine = engine
        self.step_hook = step_hook
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._cancel_checks: dict[str, Callable[[], bool]] = {}
        self._stopped = threading.Event()
        self.error: BaseException | None = None
        self.serving_time_s = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt: Prompt, params: SamplingParams,
               callback: OutputCallback, priority: int = 0,
               is_cancelled: Callable[[], bool] | None = None,
               cache_salt: str | None = None, tenant: str | None = None) -> None:
        """Queue a request; ``callback`` gets every output, the last one with ``finished``.

        ``is_cancelled`` is polled before every step; once it returns True the request is
        aborted (its KV blocks freed) before that step runs. Its arrival is now, on the
        engine's clock: the wait in the inbox while a step runs counts in its TTFT.
        """
        self._inbox.put(("add", (request_id, prompt, params, callback, priority, is_cancelled,
                                 cache_salt, tenant, self.engine.clock())))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the loop thread and return its result (for metrics reads)."""
        done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._inbox.put(("call", (fn, done)))
        ok, value = done.get(timeout=60)
        if not ok:
            raise value
        return value

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight, stop the thread and wait for it."""
        self._stopped.set()
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            (request_id, prompt, params, callback, priority, is_cancelled, salt, tenant,
             arrival) = payload
            try:
                _, rejected = self.engine.add_request(prompt, params, request_id, priority,
                                                      arrival_time=arrival, cache_salt=salt,
                                                      tenant=tenant)
            except ValueError as e:
                callback(RequestOutput.failed(request_id, str(e), "bad_request", params.n))
                return
            if rejected is not None:
                callback(rejected)
            else:
                self._callbacks[request_id] = callback
                if is_cancelled is not None:
                    self._cancel_checks[request_id] = is_cancelled
        elif kind == "abort":
            self._abort(payload)
        elif kind == "call":
            fn, done = payload
            try:
                done.put((True, fn(self.engine)))
            except Exception as e:  # handed back to the caller's thread
                done.put((False, e))

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        callback = self._callbacks.pop(request_id, None)
        self._cancel_checks.pop(request_id, None)
        if out is not None and callback is not None:
            callback(out)

    def _poll_cancelled(self) -> bool:
        """Abort every request whose client cancelled; did any?"""
        aborted = False
        for request_id, is_cancelled in list(self._cancel_checks.items()):
            try:
                cancelled = is_cancelled()
            except Exception:  # a gone client counts as cancelled
                cancelled = True
            if cancelled:
                self._abort(request_id)
                aborted = True
        return aborted

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                idle = not self.engine.has_unfinished_requests()
                batch = []
                try:
                    batch.append(self._inbox.get(block=idle, timeout=0.5 if idle else None))
                    while len(batch) < 256:  # bounded, so a flood of adds cannot stall steps
                        batch.append(self._inbox.get_nowait())
                except queue.Empty:
                    pass
                for kind, payload in batch:
                    if kind == "stop":
                        return
                    self._handle(kind, payload)
                # NOTE: hold no reference to a handled request (its callback owns the client's
                # stream) while idle: release what this iteration took from the inbox.
                kind = payload = None
                had_batch = bool(batch)
                batch.clear()
                t0 = time.perf_counter()
                cancelled = self._poll_cancelled() if self._cancel_checks else False
                if self.engine.has_unfinished_requests():
                    t1 = time.perf_counter()
                    outputs = self.engine.step()
                    t2 = time.perf_counter()
                    if self.step_hook is not None:  # first, so metrics lead the responses
                        self.step_hook(self, outputs)
                    for out in outputs:
                        if out.finished:
                            callback = self._callbacks.pop(out.request_id, None)
                            self._cancel_checks.pop(out.request_id, None)
                        else:
                            callback = self._callbacks.get(out.request_id)
                        if callback is not None:
                            callback(out)
                    self.serving_time_s += (t1 - t0) + (time.perf_counter() - t2)
                elif self.step_hook is not None and (had_batch or cancelled):
                    # State changed without a step (an abort, a rejection): refresh the hook's
                    # view. NOTE: never on a timer: the Triton stub's metrics calls block while
                    # the model unloads, and an idle loop must leave it free to finalize.
                    self.step_hook(self, [])
        except BaseException as e:  # noqa: BLE001  (reported to every waiter below)
            self.error = e
            raise
        finally:
            message = f"{ENGINE_ERROR_PREFIX}: {self.error!r}"
            for request_id, callback in list(self._callbacks.items()):
                try:
                    out = self.engine.abort_request(request_id)
                except Exception:  # noqa: BLE001  (a broken engine: the waiter still hears)
                    out = RequestOutput.failed(request_id, message, "engine_error")
                if out is not None:
                    if self.error is not None:
                        out.error, out.error_code = message, "engine_error"
                    callback(out)
            self._callbacks.clear()
            # Requests still in the inbox were never admitted: tell their waiters too.
            while True:
                try:
                    kind, payload = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    payload[3](RequestOutput.failed(payload[0], message if self.error else
                                                    "the engine loop has stopped",
                                                    "engine_error", payload[2].n))
                elif kind == "call":
                    payload[1].put((False, RuntimeError("the engine loop has stopped")))


class AsyncLLMEngine:
    """asyncio front end: ``async for out in engine.add_request(...)`` streams deltas."""

    def __init__(self, engine: LLMEngine, step_hook: StepHook | None = None) -> None:
        self.loop = EngineLoop(engine, step_hook=step_hook)

    @classmethod
    def from_engine_dir(cls, engine_dir: str, **overrides: Any) -> AsyncLLMEngine:
        from kvflow.orchestrator.llm import create_engine

        return cls(create_engine(engine_dir, **overrides))

    async def add_request(self, request_id: str, prompt: Prompt,
                          params: SamplingParams | None = None,
                          priority: int = 0,
                          is_cancelled: Callable[[], bool] | None = None,
                          tenant: str | None = None,
                          cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; leaving the iterator early aborts the request, and so
        does ``is_cancelled()`` turning true (polled by the loop before every step).

        Raises:
            RuntimeError: the engine loop has stopped (it failed, or was shut down): nothing
                would ever answer.
        """
        if not self.loop.is_alive:
            raise RuntimeError(f"the engine loop has stopped: {self.loop.error!r}")
        aio_loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def on_output(out: RequestOutput) -> None:
            aio_loop.call_soon_threadsafe(outputs.put_nowait, out)

        self.loop.submit(request_id, prompt, params or SamplingParams(), on_output, priority,
                         is_cancelled=is_cancelled, tenant=tenant, cache_salt=cache_salt)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.loop.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def shutdown(self) -> None:
        self.loop.shutdown()
        if not self.loop.is_alive:  # never pull the pool (or the ring) from a running step
            self.loop.engine.close()
