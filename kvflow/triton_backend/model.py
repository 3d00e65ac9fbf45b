"""The Triton Python backend: requests in, streamed responses out, batching inside kvflow.

``execute()`` only validates each request and hands it to one :class:`EngineLoop` running in a
background thread (in-flight batching across Triton requests happens there). That thread
hands each output to its request's :class:`~.streams.ResponseStream`; the
:class:`~.streams.Responder` thread sends them through the decoupled response senders as tokens
arrive (several steps' tokens in one response when it falls behind). A client that cancels or
disconnects is noticed within :data:`~.streams.CANCEL_POLL_S` and its request aborted, its KV
blocks freed.

A request answered at once (a tokenize or detokenize, the state snapshot, a LoRA adapter loaded,
unloaded or listed: :mod:`.lora_control`) is answered on one
of :data:`ANSWER_WORKERS` threads of its own, through its decoupled response sender: Triton has
one execute thread, and every generate request waits behind what runs on it (a tokenize of
megabytes, or a snapshot that waits for the engine's step to end).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.console.state import engine_state
from kvflow.orchestrator.engine_loop import EngineLoop
from kvflow.orchestrator.options import options_from_parameters
from kvflow.orchestrator.outputs import ENGINE_ERROR_PREFIX, OVERLOADED_PREFIX, ErrorCode
from kvflow.triton_backend.lora_control import parse_lora_command, run_lora_command
from kvflow.triton_backend.metrics import TritonMetrics
from kvflow.triton_backend.params import (
    INPUT_NAMES,
    BadRequestError,
    parse_request,
)
from kvflow.triton_backend.protocol import (
    CHAT_FORMAT_PARAMETERS,
    ENGINE_FAILED_FILE,
    ERROR_OUTPUT_PARAMETER,
    LORA_OUTPUT,
    LORA_PARAMETER,
    SERVE_FILE,
    SERVED_MODEL_NAME_PARAMETER,
    STATE_PARAMETER,
    TOKENIZE_PARAMETER,
    TRACE_SIGNAL_FILE,
)
from kvflow.triton_backend.signals import SignalWatch
from kvflow.triton_backend.streams import (
    Responder,
    ResponseStream,
    error_response,
)
from kvflow.triton_backend.tokenize import tokenize_outputs

# The backend's own model parameters (a hand-written repository's; `kvflow serve` writes the
# paths into SERVE_FILE instead, out of clients' sight, and the name the OpenAI frontend serves
# as a parameter); every other parameter is an engine option.
# The files beside the model (SERVE_FILE, ENGINE_FAILED_FILE, TRACE_SIGNAL_FILE) are named in
# .protocol, which the launcher reads too.
# The engine's state snapshot is taken at most this often (kvflow.console.state).
STATE_MIN_PERIOD_S = 0.1
# Requests answered at once run on these threads (module doc); past MAX_PENDING_ANSWERS of them
# waiting, another is refused as overloaded (503: retry) instead of queued without bound.
ANSWER_WORKERS = 2
MAX_PENDING_ANSWERS = 64
BACKEND_PARAMETERS = ("engine_dir", "python_paths", SERVED_MODEL_NAME_PARAMETER,
                      *CHAT_FORMAT_PARAMETERS)


def _parameter(model_config: dict, key: str, default: str = "") -> str:
    value = model_config.get("parameters", {}).get(key, {}).get("string_value", default)
    return value if value and not value.startswith("${") else default


def _request_parameters(request: Any) -> dict[str, Any]:
    """The request's parameters (JSON in the Python backend); a bad string is refused."""
    text = request.parameters() if hasattr(request, "parameters") else ""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise BadRequestError("the request's parameters are not valid JSON") from None
    return value if isinstance(value, dict) else {}



class KvflowTritonModel:
    """What ``model_repository/kvflow/1/model.py`` delegates to."""

    def __init__(self, args: dict[str, str], pb_utils: Any) -> None:
        from kvflow.orchestrator.llm import create_engine

        self.pb = pb_utils
        model_config = json.loads(args["model_config"])
        self.repository = Path(args.get("model_repository", ""))
        serve_file = self.repository / SERVE_FILE
        served = json.loads(serve_file.read_text()) if serve_file.is_file() else {}
        if served.get("trace_steps"):
            # SIGUSR1 will write the step timeline: until the watch is live (the engine takes
            # seconds to load), it must not end the stub, as its default action would.
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        self.lora_updates = bool(served.get("lora_updates"))
        engine_dir = served.get("engine_dir") or _parameter(model_config, "engine_dir")
        if not engine_dir or not (Path(engine_dir) / "engine_config.json").is_file():
            raise pb_utils.TritonModelException(
                f"engine_dir ({SERVE_FILE} or the model parameter) must name an engine folder, "
                f"got {engine_dir!r}")
        parameters = {key: _parameter(model_config, key)
                      for key in model_config.get("parameters", {})}
        try:
            overrides = options_from_parameters(parameters, reserved=BACKEND_PARAMETERS)
            for path_option in ("trace_steps", "lora_modules"):  # paths: in serve.json, out
                if served.get(path_option):  # of clients' sight
                    overrides[path_option] = served[path_option]
            self.engine = create_engine(engine_dir, **overrides)
        except ValueError as e:
            raise pb_utils.TritonModelException(f"model parameters: {e}") from None
        if self.engine.memory_budget is not None:
            pb_utils.Logger.log_info(f"kvflow: {self.engine.memory_budget.describe()}")
        self.max_model_len = self.engine.options.max_model_len
        self.metrics = TritonMetrics(pb_utils, args.get("model_name", "kvflow"))
        self.loop = EngineLoop(self.engine, step_hook=self.metrics.on_step,
                               on_failure=self._on_engine_failure)
        self.responder = Responder(self.loop.abort)
        self.trace_watch = self._watch_trace_signal(pb_utils)
        self._ids = itertools.count()
        self._snapshot: tuple[float, bytes] | None = None  # (taken at, JSON): see _state
        self._snapshot_lock = threading.Lock()
        self._answers = ThreadPoolExecutor(ANSWER_WORKERS, thread_name_prefix="kvflow-answer")
        self._pending_answers = 0
        self._pending_lock = threading.Lock()
        self.model_name = args.get("model_name", "kvflow")
        self.served_model_name = _parameter(model_config, SERVED_MODEL_NAME_PARAMETER)
        tokenizer = self.engine.tokenizer
        self._decode_token = None if tokenizer is None else (
            lambda t: tokenizer.decode([t], skip_special_tokens=False))

    def _on_engine_failure(self, error: BaseException) -> None:
        """The engine loop died (every waiter has had its error, and new requests get one at
        once): stop tritonserver, so that readiness fails at once and the process exits (and
        `kvflow serve`, or a supervisor, sees it). A Python backend cannot mark its model
        unready by itself; a server shutting down is not ready."""
        self.pb.Logger.log_error(f"kvflow: the engine failed: {error!r}; stopping tritonserver")
        with contextlib.suppress(OSError):
            (self.repository / ENGINE_FAILED_FILE).write_text(f"{error!r}\n")
        # Every waiter's error (it names the failure) goes to Triton before the server stops
        # and refuses requests with its own words.
        self.responder.drain(timeout_s=10.0)
        server = os.getppid()  # the stub's parent
        try:
            is_triton = Path(f"/proc/{server}/comm").read_text().strip() == "tritonserver"
        except OSError:
            is_triton = False
        if is_triton:
            os.kill(server, signal.SIGTERM)
        else:
            self.pb.Logger.log_error(f"kvflow: the stub's parent (pid {server}) is not "
                                     "tritonserver: stop it yourself")

    def _watch_trace_signal(self, pb_utils: Any) -> SignalWatch | None:
        """With a step timeline, SIGUSR1 writes it: the ring is copied on the engine's thread
        between steps, and the file built and written on the watch's. Once the watch is live
        this stub's pid goes into TRACE_SIGNAL_FILE, the one place `kvflow serve` signals."""
        tracer = self.engine.tracer
        if tracer is None:
            return None

        def write() -> None:
            tracer.write(snapshot=self.loop.call(lambda engine: tracer.snapshot()))

        def failed(e: BaseException) -> None:
            pb_utils.Logger.log_error(f"kvflow: writing the step timeline failed: {e!r}")

        try:
            watch = SignalWatch(signal.SIGUSR1, write, failed)
        except ValueError as e:  # not on the main thread: the timeline is written at shutdown
            pb_utils.Logger.log_warn(f"kvflow: SIGUSR1 will not write the step timeline: {e}")
            return None
        with open(self.repository / TRACE_SIGNAL_FILE, "a") as f:
            f.write(f"{os.getpid()}\n")
        return watch

    def execute(self, requests: list[Any]) -> None:
        pb = self.pb
        for request in requests:
            sender = request.get_response_sender()
            error_output = False
            try:
                inputs = {}
                for name in INPUT_NAMES:
                    tensor = pb.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        inputs[name] = tensor.as_numpy()
                parameters = _request_parameters(request)
                error_output = parameters.get(ERROR_OUTPUT_PARAMETER) is True
                # Asked for the state snapshot, tokens or a LoRA operation: one answer, on a
                # worker thread.
                if (parameters.get(STATE_PARAMETER) is True
                        or parameters.get(TOKENIZE_PARAMETER) is True
                        or LORA_PARAMETER in parameters):
                    self._answer_later(sender, inputs, parameters, error_output)
                    continue
                parsed = parse_request(inputs, self.max_model_len, parameters=parameters)
            except BadRequestError as e:
                self.metrics.count_rejected("bad_request")
                sender.send(error_response(pb, str(e), ErrorCode.BAD_REQUEST, error_output),
                            flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            # Triton's ids are the client's and need not be unique; ours must be.
            request_id = f"{request.request_id() or 'triton'}-{next(self._ids)}"
            stream = ResponseStream(pb, sender, parsed, request_id, self.responder,
                                    self._decode_token, error_output)
            self.responder.add(stream)  # NOTE: the responder, not the loop, polls cancels
            # The engine tokenizes (on a preparing thread), chat template included.
            self.loop.submit(request_id, parsed.prompt, parsed.params, stream.on_output,
                             parsed.priority, cache_salt=parsed.cache_salt,
                             tenant=parsed.tenant, lora_name=parsed.lora_name)
        return None

    def _answer_later(self, sender: Any, inputs: dict[str, np.ndarray],
                      parameters: dict[str, Any], error_output: bool) -> None:
        """Hand a request answered at once to the answer workers (module doc)."""
        with self._pending_lock:
            full = self._pending_answers >= MAX_PENDING_ANSWERS
            if not full:
                self._pending_answers += 1
        if full:
            self.metrics.count_rejected("queue_full")
            sender.send(error_response(
                self.pb, f"{OVERLOADED_PREFIX}: {MAX_PENDING_ANSWERS} tokenize, state and "
                "LoRA requests are waiting already; retry", ErrorCode.OVERLOADED, error_output),
                flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        # NOTE: copies: the input tensors belong to the request, which Triton may release
        # once execute() has returned.
        owned = {name: np.array(value, copy=True) for name, value in inputs.items()}
        self._answers.submit(self._answer, sender, owned, parameters, error_output)

    def _answer(self, sender: Any, inputs: dict[str, np.ndarray], parameters: dict[str, Any],
                error_output: bool) -> None:
        """On an answer worker: the state snapshot, the tokenize answer or the LoRA
        operation's (:mod:`.lora_control`), sent as the request's one final response (an
        error response naming the field if it is bad)."""
        pb = self.pb
        try:
            try:
                if parameters.get(STATE_PARAMETER) is True:
                    answer = {"state": np.array([self._state()], dtype=np.object_)}
                elif LORA_PARAMETER in parameters:
                    done = run_lora_command(self.loop,
                                            parse_lora_command(parameters[LORA_PARAMETER]),
                                            self.served_model_name, self.lora_updates)
                    answer = {LORA_OUTPUT: np.array([json.dumps(done).encode()],
                                                    dtype=np.object_)}
                else:
                    answer = tokenize_outputs(self.engine.inputs, inputs, parameters)
                response = pb.InferenceResponse(output_tensors=[
                    pb.Tensor(k, v) for k, v in answer.items()])
            except BadRequestError as e:
                self.metrics.count_rejected("bad_request")
                response = error_response(pb, str(e), ErrorCode.BAD_REQUEST, error_output)
            except Exception as e:  # noqa: BLE001  a tokenizer or engine fault: this request's
                response = error_response(pb, f"{ENGINE_ERROR_PREFIX}: answering the request "
                                          f"failed: {e!r}", ErrorCode.ENGINE_ERROR,
                                          error_output)
            sender.send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as e:  # noqa: BLE001  the client is gone: nothing to answer
            pb.Logger.log_warn(f"kvflow: an answer could not be sent: {e!r}")
        finally:
            with self._pending_lock:
                self._pending_answers -= 1

    def _state(self) -> bytes:
        """The engine's snapshot as JSON, taken between steps on its thread; one a
        STATE_MIN_PERIOD_S at most, whatever the number of consoles asking."""
        with self._snapshot_lock:  # NOTE: a second asker waits for the first's snapshot
            now = time.monotonic()
            if self._snapshot is None or now - self._snapshot[0] >= STATE_MIN_PERIOD_S:
                self._snapshot = (now, json.dumps(self.loop.call(engine_state)).encode())
            return self._snapshot[1]

    def finalize(self) -> None:
        # NOTE: metrics first: while the model unloads, a metrics call from the loop thread
        # may never be answered, and shutdown would wait on that thread.
        self.metrics.close()
        self._answers.shutdown(wait=False, cancel_futures=True)
        self.loop.shutdown(timeout=10.0)
        self.responder.close()  # after the loop: every final output is queued by then
        if not self.loop.is_alive:  # never pull the KV pool from under a running step
            self.engine.close()  # the step timeline is written here
        if self.trace_watch is not None:  # after: a SIGUSR1 until now is still handled
            self.trace_watch.close()
