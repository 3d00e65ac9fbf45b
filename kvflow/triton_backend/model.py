"""The Triton Python backend: requests in, streamed responses out, batching inside kvflow.

``execute()`` only validates each request and hands it to one :class:`EngineLoop` running in a
background thread (in-flight batching across Triton requests happens there). Responses are sent
from that thread through each request's decoupled response sender as tokens arrive. A client
that cancels or disconnects is noticed before the next step and its request aborted, its KV
blocks freed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.orchestrator.engine_loop import EngineLoop
from kvflow.orchestrator.options import options_from_parameters
from kvflow.orchestrator.outputs import (
    CompletionOutput,
    ErrorCode,
    RequestOutput,
    TokenLogprobs,
)
from kvflow.triton_backend.metrics import TritonMetrics
from kvflow.triton_backend.params import (
    INPUT_NAMES,
    BadRequestError,
    ParsedRequest,
    parse_request,
)
from kvflow.triton_backend.protocol import (
    ENGINE_FAILED_FILE,
    ERROR_OUTPUT_PARAMETER,
    SERVE_FILE,
    SERVED_MODEL_NAME_PARAMETER,
    TRACE_SIGNAL_FILE,
)
from kvflow.triton_backend.signals import SignalWatch

# The backend's own model parameters (a hand-written repository's; `kvflow serve` writes the
# paths into SERVE_FILE instead, out of clients' sight, and the name the OpenAI frontend serves
# as a parameter); every other parameter is an engine option.
# The files beside the model (SERVE_FILE, ENGINE_FAILED_FILE, TRACE_SIGNAL_FILE) are named in
# .protocol, which the launcher reads too.
BACKEND_PARAMETERS = ("engine_dir", "python_paths", SERVED_MODEL_NAME_PARAMETER)


def _parameter(model_config: dict, key: str, default: str = "") -> str:
    value = model_config.get("parameters", {}).get(key, {}).get("string_value", default)
    return value if value and not value.startswith("${") else default


MAX_ERROR_CHARS = 1000  # an error names the field and the limit; it never echoes a whole input


def error_response(pb: Any, message: str, code: ErrorCode | None,
                   as_output: bool = False) -> Any:
    """An error response with Triton's code for ``code``: ``overloaded`` -> UNAVAILABLE (HTTP
    503; clients retry), ``bad_request`` -> INVALID_ARG (HTTP 400), else INTERNAL (500).

    ``as_output`` (the request's ERROR_OUTPUT_PARAMETER): instead, a response whose outputs
    ``error`` and ``error_code`` carry them, the code as data."""
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + f"... ({len(message)} characters)"
    code = code or ErrorCode.ENGINE_ERROR
    if as_output:
        return pb.InferenceResponse(output_tensors=[
            pb.Tensor("error", np.array([message.encode("utf-8")], dtype=np.object_)),
            pb.Tensor("error_code", np.array([code.value.encode()], dtype=np.object_))])
    codes = pb.TritonError
    kind = {ErrorCode.OVERLOADED: codes.UNAVAILABLE,
            ErrorCode.BAD_REQUEST: codes.INVALID_ARG}.get(code, codes.INTERNAL)
    return pb.InferenceResponse(error=pb.TritonError(message, kind))


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


def logprob_entries(out: CompletionOutput, start: int = 0,
                    decode: Callable[[int], str] | None = None) -> list[dict[str, Any]]:
    """``output_logprobs``: per output token from ``start``, its id, its log-probability and
    the top ``logprobs`` alternatives (token id as a string -> log-probability). With
    ``decode``, also each token's own text (``token``; ``top_tokens``: id -> text), which the
    OpenAI frontend returns. The JSON objects of :meth:`TokenLogprobs.to_wire`."""
    entries = []
    for lp in out.token_logprobs(start):
        if decode is not None:
            lp = replace(lp, token=decode(lp.token_id),
                         top_tokens={t: decode(t) for t, _ in lp.top})
        entries.append(lp.to_wire())
    return entries


def prompt_logprob_entries(out: RequestOutput,
                           decode: Callable[[int], str] | None = None) -> list[dict[str, Any]]:
    """``prompt_logprobs``: per prompt token, the :meth:`TokenLogprobs.to_wire` object of
    ``output_logprobs``' entries (with ``decode``, each token's text too). The first token has
    no logprob (nothing precedes it): its entry is ``{"token_id": ..., "logprob": null,
    "top_logprobs": {}}``, so that a client that echoes the prompt has all its tokens."""
    entries = []
    for token, lp in zip(out.prompt_token_ids or (), out.prompt_token_logprobs(), strict=True):
        lp = lp or TokenLogprobs(token, None)
        if decode is not None:
            lp = replace(lp, token=decode(lp.token_id),
                         top_tokens={t: decode(t) for t, _ in lp.top})
        entries.append(lp.to_wire())
    return entries


class _ResponseStream:
    """Turns one request's engine outputs into Triton responses.

    As Triton's vLLM backend does, every response carries all ``n`` sequences of the request:
    ``text_output``, ``finish_reason``, ``num_output_tokens`` and ``output_logprobs`` have one
    entry per sequence, entry ``j`` being sequence ``j``'s (its new text when streaming, ""
    when it added none; its finish reason, "" while it runs). A stream sends a response each
    step that added text to some sequence, and the final one when all have finished.

    ``prompt_logprobs`` (asked for in ``sampling_parameters``) is the request's, not a
    sequence's: one JSON list, sent once, in the first response after the prompt was computed
    (the engine's output that carries them may add no text yet: they wait for the next).
    """

    __slots__ = ("pb", "sender", "parsed", "lock", "logprobs_sent", "decode", "error_output",
                 "prompt_logprobs")

    def __init__(self, pb_utils: Any, sender: Any, parsed: ParsedRequest,
                 decode: Callable[[int], str] | None = None,
                 error_output: bool = False) -> None:
        self.pb = pb_utils
        self.error_output = error_output  # errors as outputs (see error_response)
        self.decode = decode
        self.sender = sender
        self.parsed = parsed
        self.lock = threading.Lock()
        self.logprobs_sent: dict[int, int] = {}  # per sequence: tokens whose logprobs went
        self.prompt_logprobs: bytes | None = None  # JSON not sent yet

    def on_output(self, out: RequestOutput) -> None:
        pb = self.pb
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if out.error is not None and (out.finish_reason == "rejected" or out.aborted):
            self._send(error_response(pb, out.error, out.error_code, self.error_output), final)
            return
        if out.aborted:  # the client cancelled: just close the stream
            self._send(None, final)
            return
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = json.dumps(prompt_logprob_entries(out, self.decode)).encode()
        if self.parsed.stream:
            if out.finished or any(c.delta_text for c in out.outputs):
                self._send(self._response(out, [c.delta_text for c in out.outputs]),
                           final if out.finished else 0)
        elif out.finished:
            echo = "" if self.parsed.exclude_input_in_output else self.parsed.prompt_text
            self._send(self._response(out, [echo + c.text for c in out.outputs]), final)

    def _response(self, out: RequestOutput, texts: list[str]) -> Any:
        pb = self.pb
        seqs = out.outputs
        tensors = [
            pb.Tensor("text_output", np.array([t.encode("utf-8") for t in texts],
                                              dtype=np.object_)),
            pb.Tensor("finish_reason", np.array([(c.finish_reason or "").encode()
                                                 for c in seqs], dtype=np.object_)),
            pb.Tensor("num_input_tokens", np.array([out.num_prompt_tokens], dtype=np.uint32)),
            pb.Tensor("num_output_tokens", np.array([c.num_tokens for c in seqs],
                                                    dtype=np.uint32)),
            pb.Tensor("cached_tokens", np.array([out.cached_tokens], dtype=np.uint32)),
        ]
        if seqs[0].logprobs is not None:
            # Every token since the last response (a stream sends nothing for a token that
            # adds no text yet, so its logprobs ride on the next response).
            entries = []
            for c in seqs:
                entries.append(json.dumps(logprob_entries(c, self.logprobs_sent.get(c.index, 0),
                                                          self.decode)).encode())
                self.logprobs_sent[c.index] = len(c.logprobs or ())
            tensors.append(pb.Tensor("output_logprobs", np.array(entries, dtype=np.object_)))
        if self.prompt_logprobs is not None:
            tensors.append(pb.Tensor("prompt_logprobs", np.array([self.prompt_logprobs],
                                                                 dtype=np.object_)))
            self.prompt_logprobs = None
        return pb.InferenceResponse(output_tensors=tensors)

    def _send(self, response: Any, flags: int) -> None:
        """Send; to a client that went away, still close the stream (Triton waits for every
        request's final flag before it can unload the model)."""
        with self.lock:
            if self.sender is None:
                return
            if flags:
                # NOTE: drop the sender with the final flag. A live sender keeps its response
                # factory, and with it the model, alive: Triton would wait forever to unload.
                sender, self.sender = self.sender, None
            else:
                sender = self.sender
            try:
                if response is None:
                    sender.send(flags=flags)
                else:
                    sender.send(response, flags=flags)
                return
            except Exception:  # noqa: BLE001  a cancelled or disconnected client
                if not flags:
                    return
            with contextlib.suppress(Exception):
                sender.send(flags=flags)


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
        engine_dir = served.get("engine_dir") or _parameter(model_config, "engine_dir")
        if not engine_dir or not (Path(engine_dir) / "engine_config.json").is_file():
            raise pb_utils.TritonModelException(
                f"engine_dir ({SERVE_FILE} or the model parameter) must name an engine folder, "
                f"got {engine_dir!r}")
        parameters = {key: _parameter(model_config, key)
                      for key in model_config.get("parameters", {})}
        try:
            overrides = options_from_parameters(parameters, reserved=BACKEND_PARAMETERS)
            if served.get("trace_steps"):  # a path: in serve.json, out of clients' sight
                overrides["trace_steps"] = served["trace_steps"]
            self.engine = create_engine(engine_dir, **overrides)
        except ValueError as e:
            raise pb_utils.TritonModelException(f"model parameters: {e}") from None
        self.max_model_len = self.engine.options.max_model_len
        self.metrics = TritonMetrics(pb_utils, args.get("model_name", "kvflow"))
        self.loop = EngineLoop(self.engine, step_hook=self.metrics.on_step,
                               on_failure=self._on_engine_failure)
        self.trace_watch = self._watch_trace_signal(pb_utils)
        self._ids = itertools.count()
        self.model_name = args.get("model_name", "kvflow")
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
                parsed = parse_request(inputs, self.max_model_len, parameters=parameters)
            except BadRequestError as e:
                self.metrics.count_rejected("bad_request")
                sender.send(error_response(pb, str(e), ErrorCode.BAD_REQUEST, error_output),
                            flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            stream = _ResponseStream(pb, sender, parsed, self._decode_token, error_output)
            # Triton's ids are the client's and need not be unique; ours must be.
            request_id = f"{request.request_id() or 'triton'}-{next(self._ids)}"
            # The engine tokenizes (on its loop thread), chat template included.
            self.loop.submit(request_id, parsed.prompt, parsed.params, stream.on_output,
                             parsed.priority, is_cancelled=sender.is_cancelled,
                             cache_salt=parsed.cache_salt, tenant=parsed.tenant)
        return None

    def finalize(self) -> None:
        # NOTE: metrics first: while the model unloads, a metrics call from the loop thread
        # may never be answered, and shutdown would wait on that thread.
        self.metrics.close()
        self.loop.shutdown(timeout=10.0)
        if not self.loop.is_alive:  # never pull the KV pool from under a running step
            self.engine.close()  # the step timeline is written here
        if self.trace_watch is not None:  # after: a SIGUSR1 until now is still handled
            self.trace_watch.close()
