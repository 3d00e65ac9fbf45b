"""The engine loop in a background thread.

:class:`EngineLoop` owns an :class:`LLMEngine`: other threads submit and abort requests through
a queue, and get each request's outputs through a callback called on the loop thread. The Triton
backend uses it directly; :class:`~kvflow.orchestrator.async_engine.AsyncLLMEngine` turns the
callbacks into async iterators.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvflow import envs
from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.input_processor import PreparedPrompt
from kvflow.orchestrator.outputs import (
    ENGINE_ERROR_PREFIX,
    ErrorCode,
    RequestOutput,
    error_code_of,
)
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.text.tokenizer import Prompt

OutputCallback = Callable[[RequestOutput], None]
# Called on the loop thread after every step with the step's outputs (and with [] after a
# change of state without a step): the documented way to watch a served engine.
StepHook = Callable[["EngineLoop", list[RequestOutput]], None]
log = logging.getLogger("kvflow")
# How long EngineLoop.call waits on a live loop: a step, however long, ends well before.
CALL_TIMEOUT_S = 60.0


@dataclass(eq=False)
class _Submission:
    """A request between ``submit`` and its admission: prepared on a worker thread."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    callback: OutputCallback
    priority: int
    is_cancelled: Callable[[], bool] | None
    cache_salt: str | None
    tenant: str | None
    arrival: float
    lora_name: str | None = None
    done: bool = False  # answered already (aborted, or failed at shutdown): drop its result


class EngineLoop:
    """Runs ``engine.step()`` on a daemon thread while there is work; idle, it sleeps on its
    inbox. All engine state is touched by that thread alone.

    A submitted request is first prepared (tokenized, its chat template rendered, its grammar
    compiled) by :attr:`engine.inputs <kvflow.orchestrator.engine.LLMEngine.inputs>` on one of
    ``prepare_workers`` threads, then handed to the loop: however slow a request's
    preparation, the running requests keep stepping.

    Failures stay with the request that caused them: a request that cannot be prepared or
    admitted gets a final output with its error (``bad_request``: a 400; otherwise
    ``engine_error``, a 500 that says what failed), and a callback or step hook that raises is
    logged. Only a failing step (the runner, or a bug) ends the loop; then every waiter gets
    an error, :attr:`error` holds the exception and ``on_failure`` is called with it, so that
    the server around the loop can stop being ready and exit.

    ``serving_time_s``: the loop thread's seconds spent serving around the steps (cancellation
    checks, the step hook, handing outputs to clients); the time inside steps is the engine's
    own ``counters.step_time_s``.
    """

    def __init__(self, engine: LLMEngine, name: str = "kvflow-engine-loop",
                 step_hook: StepHook | None = None,
                 on_failure: Callable[[BaseException], None] | None = None,
                 prepare_workers: int = 1) -> None:
        self.engine = engine
        self.step_hook = step_hook
        self.on_failure = on_failure
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._cancel_checks: dict[str, Callable[[], bool]] = {}
        # Submitted, not yet admitted (written under _lock: submit runs on callers' threads).
        self._pending: dict[str, _Submission] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._preparers = ThreadPoolExecutor(prepare_workers, thread_name_prefix=f"{name}-prep")
        self._stopped = threading.Event()
        self.error: BaseException | None = None
        self.serving_time_s = 0.0
        self._fail_after_steps = envs.fail_after_steps()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt: Prompt, params: SamplingParams,
               callback: OutputCallback, priority: int = 0,
               is_cancelled: Callable[[], bool] | None = None, cache_salt: str | None = None,
               tenant: str | None = None, lora_name: str | None = None) -> None:
        """Queue a request (under LoRA adapter ``lora_name``, None: the base); ``callback``
        gets every output, the last one with ``finished``.

        ``is_cancelled`` is polled before every step; once it returns True the request is
        aborted (its KV blocks freed) before that step runs. Its arrival is now, on the
        engine's clock (preparation and inbox wait count in its TTFT). After the loop has
        stopped, ``callback`` gets a final error output at once.
        """
        sub = _Submission(request_id, prompt, params, callback, priority, is_cancelled,
                          cache_salt, tenant, self.engine.clock(), lora_name)
        with self._lock:
            if not self._closed:
                self._pending[request_id] = sub
                self._preparers.submit(self._prepare, sub)
                return
        callback(RequestOutput.failed(request_id, self._stopped_message(),
                                      ErrorCode.ENGINE_ERROR, params.n))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def call(self, fn: Callable[[LLMEngine], Any], timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """Run ``fn(engine)`` on the loop thread and return its result (for metrics reads).

        Raises :class:`EngineLoopClosed` at once on a loop that is stopping or has stopped,
        and when the loop stops before it ran ``fn``; ``TimeoutError`` if a live loop does not
        answer within ``timeout_s``. On the loop thread itself (a callback, the step hook)
        ``fn`` runs at once: queueing it there would wait on itself.
        """
        if threading.current_thread() is self._thread:
            return fn(self.engine)
        done: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        with self._lock:  # NOTE: _close sets _closed under this lock, then drains the inbox
            if self._closed or self._stopped.is_set():
                raise EngineLoopClosed(f"the engine loop is closed ({self._stopped_message()})")
            self._inbox.put(("call", (fn, done)))
        try:
            ok, value = done.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the engine loop did not run a call within {timeout_s} s "
                               "(a step longer than that?)") from None
        if not ok:
            raise value
        return value

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight, stop the threads and wait for the loop's."""
        self._stopped.set()
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _stopped_message(self) -> str:
        if self.error is not None:
            return f"{ENGINE_ERROR_PREFIX}: {self.error!r}"
        return "the engine loop has stopped"

    def _prepare(self, sub: _Submission) -> None:
        """On a worker thread: the prompt's ids and grammars, or the error, to the loop."""
        result: PreparedPrompt | Exception
        try:
            cancelled = sub.is_cancelled is not None and sub.is_cancelled()
        except Exception:  # noqa: BLE001  a gone client counts as cancelled
            cancelled = True
        try:
            result = (_Cancelled() if cancelled
                      else self.engine.inputs.prepare(sub.prompt, sub.params))
        except Exception as e:  # noqa: BLE001  the request's failure, answered on the loop
            result = e
        self._inbox.put(("add", (sub, result)))

    def _admit(self, sub: _Submission, prepared: PreparedPrompt | Exception) -> None:
        """Admit a prepared request, or answer it with the error its preparation raised."""
        with self._lock:
            if sub.done or self._pending.get(sub.request_id) is not sub:
                return  # aborted while it was prepared: answered then
            del self._pending[sub.request_id]
        request_id, params, callback = sub.request_id, sub.params, sub.callback
        if isinstance(prepared, _Cancelled):
            self._deliver(callback, _aborted_output(request_id, params.n))
            return
        if isinstance(prepared, ValueError):
            self.engine.count_refused(prepared)
            self._deliver(callback, RequestOutput.failed(
                request_id, str(prepared), error_code_of(prepared), params.n))
            return
        if isinstance(prepared, Exception):  # a tokenizer or template bug: this request's
            log.exception("kvflow: preparing request %s failed", request_id,
                          exc_info=prepared)
            self._deliver(callback, RequestOutput.failed(
                request_id, f"{ENGINE_ERROR_PREFIX}: preparing the request failed: "
                f"{prepared!r}", ErrorCode.ENGINE_ERROR, params.n))
            return
        try:
            _, rejected = self.engine.add_request(prepared, params, request_id, sub.priority,
                                                  arrival_time=sub.arrival,
                                                  cache_salt=sub.cache_salt, tenant=sub.tenant,
                                                  lora_name=sub.lora_name)
        except ValueError as e:
            self._deliver(callback, RequestOutput.failed(request_id, str(e),
                                                         error_code_of(e), params.n))
            return
        except Exception as e:  # noqa: BLE001  this request's failure, not the loop's
            log.exception("kvflow: admitting request %s failed", request_id)
            self._deliver(callback, RequestOutput.failed(
                request_id, f"{ENGINE_ERROR_PREFIX}: admitting the request failed: {e!r}",
                ErrorCode.ENGINE_ERROR, params.n))
            return
        if rejected is not None:
            self._deliver(callback, rejected)
        else:
            self._callbacks[request_id] = callback
            if sub.is_cancelled is not None:
                self._cancel_checks[request_id] = sub.is_cancelled

    def _deliver(self, callback: OutputCallback, out: RequestOutput) -> None:
        """Hand ``out`` to its client; a callback that raises is that client's failure: its
        request is aborted (it would run for nobody), and the loop goes on."""
        try:
            callback(out)
        except Exception:  # noqa: BLE001
            log.exception("kvflow: delivering an output of request %s failed", out.request_id)
            if not out.finished:
                self._callbacks.pop(out.request_id, None)
                self._cancel_checks.pop(out.request_id, None)
                self.engine.abort_request(out.request_id)

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            self._admit(*payload)
        elif kind == "abort":
            self._abort(payload)
        elif kind == "call":
            fn, done = payload
            try:
                done.put((True, fn(self.engine)))
            except Exception as e:  # handed back to the caller's thread
                done.put((False, e))

    def _handle_all(self, batch: list[tuple[str, Any]]) -> bool:
        """Handle what the loop took from its inbox, in order; True at a stop (what follows it
        goes back to the inbox, for :meth:`_close` to answer)."""
        for i, (kind, payload) in enumerate(batch):
            if kind == "stop":
                for item in batch[i + 1:]:
                    self._inbox.put(item)
                return True
            self._handle(kind, payload)
        return False

    def _abort(self, request_id: str) -> None:
        with self._lock:
            sub = self._pending.pop(request_id, None)
        if sub is not None:  # still being prepared: its result will be dropped
            sub.done = True
            self._deliver(sub.callback, _aborted_output(request_id, sub.params.n))
            return
        out = self.engine.abort_request(request_id)
        callback = self._callbacks.pop(request_id, None)
        self._cancel_checks.pop(request_id, None)
        if out is not None and callback is not None:
            self._deliver(callback, out)

    def _poll_cancelled(self) -> bool:
        """Abort every request whose client cancelled; did any?"""
        aborted = False
        with self._lock:
            checks = [*self._cancel_checks.items(),
                      *((s.request_id, s.is_cancelled) for s in self._pending.values()
                        if s.is_cancelled is not None)]
        for request_id, is_cancelled in checks:
            try:
                cancelled = is_cancelled()
            except Exception:  # a gone client counts as cancelled
                cancelled = True
            if cancelled:
                self._abort(request_id)
                aborted = True
        return aborted

    def _call_hook(self, outputs: list[RequestOutput]) -> None:
        assert self.step_hook is not None
        try:
            self.step_hook(self, outputs)
        except Exception:  # noqa: BLE001  observing must never stop the serving
            log.exception("kvflow: the step hook failed")

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
                if self._handle_all(batch):
                    return
                # NOTE: hold no reference to a handled request (its callback owns the client's
                # stream) while idle: release what this iteration took from the inbox.
                had_batch = bool(batch)
                batch.clear()
                t0 = time.perf_counter()
                cancelled = self._poll_cancelled() if (self._cancel_checks
                                                       or self._pending) else False
                if self.engine.has_unfinished_requests():
                    if (self._fail_after_steps is not None
                            and self.engine.counters.steps >= self._fail_after_steps):
                        raise RuntimeError(f"injected failure ({envs.FAIL_AFTER_STEPS}="
                                           f"{self._fail_after_steps})")
                    t1 = time.perf_counter()
                    outputs = self.engine.step()
                    t2 = time.perf_counter()
                    if self.step_hook is not None:  # first, so metrics lead the responses
                        self._call_hook(outputs)
                    for out in outputs:
                        if out.finished:
                            callback = self._callbacks.pop(out.request_id, None)
                            self._cancel_checks.pop(out.request_id, None)
                        else:
                            callback = self._callbacks.get(out.request_id)
                        if callback is not None:
                            self._deliver(callback, out)
                    self.serving_time_s += (t1 - t0) + (time.perf_counter() - t2)
                elif self.step_hook is not None and (had_batch or cancelled):
                    # State changed without a step (an abort, a rejection): refresh the hook's
                    # view. NOTE: never on a timer: the Triton stub's metrics calls block while
                    # the model unloads, and an idle loop must leave it free to finalize.
                    self._call_hook([])
        except BaseException as e:  # noqa: BLE001  (reported to every waiter below)
            self.error = e
            log.error("kvflow: the engine loop failed: %r", e, exc_info=e)
        finally:
            self._close()

    def _close(self) -> None:
        """On the loop thread as it ends: answer every waiter (admitted, being prepared, or
        still in the inbox), stop the preparers, and report a failure."""
        message = self._stopped_message()
        with self._lock:
            self._closed = True
            pending = list(self._pending.values())
            self._pending.clear()
        self._preparers.shutdown(wait=False, cancel_futures=True)
        for request_id, callback in list(self._callbacks.items()):
            try:
                out = self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001  (a broken engine: the waiter still hears)
                out = RequestOutput.failed(request_id, message, ErrorCode.ENGINE_ERROR)
            if out is not None:
                if self.error is not None:
                    out.error, out.error_code = message, ErrorCode.ENGINE_ERROR
                self._deliver(callback, out)
        self._callbacks.clear()
        self._cancel_checks.clear()
        for sub in pending:
            sub.done = True
            self._deliver(sub.callback, RequestOutput.failed(sub.request_id, message,
                                                             ErrorCode.ENGINE_ERROR,
                                                             sub.params.n))
        # Calls still in the inbox will never run (their adds were answered above); no call
        # enters it after _closed was set.
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "call":
                payload[1].put((False, EngineLoopClosed(
                    f"the engine loop is closed ({self._stopped_message()})")))
        if self.error is not None and self.on_failure is not None:
            try:
                self.on_failure(self.error)
            except Exception:  # noqa: BLE001
                log.exception("kvflow: the engine loop's on_failure hook failed")


class EngineLoopClosed(RuntimeError):
    """A call reached an engine loop that has stopped (shut down, or failed: the message then
    holds the failure)."""


class _Cancelled(Exception):
    """The client cancelled before its request was prepared."""


def _aborted_output(request_id: str, n: int) -> RequestOutput:
    """The final output of a request aborted before it was admitted."""
    return RequestOutput.failed(request_id, None, None, n, finish_reason="abort")
