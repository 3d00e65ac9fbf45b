"""Engine outputs -> Triton responses, sent from a thread of their own.

Each response a Python backend sends is a round trip through the stub's IPC to tritonserver,
and so is each ``is_cancelled()``: with 32 requests running, a loop thread that sent and polled
itself spent 64 round trips around every step, holding the engine up while the other core was
busy. Here the engine loop only drops each request's output into its :class:`ResponseStream`'s
mailbox (:class:`~kvflow.orchestrator.output_mailbox.OutputMailbox`); one :class:`Responder`
thread sends the responses and, every :data:`CANCEL_POLL_S`, asks Triton which clients
cancelled (their requests are aborted through the loop's inbox). A responder that keeps up
sends one response per step, as before; one that falls behind sends the outputs waiting for a
request as one response (their text and logprobs joined), never holding back the final one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from kvflow.orchestrator.output_mailbox import OutputMailbox
from kvflow.orchestrator.outputs import (
    CompletionOutput,
    ErrorCode,
    RequestOutput,
    TokenLogprobs,
)
from kvflow.triton_backend.params import ParsedRequest

# How often the responder asks Triton whether the live requests' clients cancelled: a
# cancelled request is aborted, and its KV blocks freed, within this and one step.
CANCEL_POLL_S = 0.1
log = logging.getLogger("kvflow")
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


class ResponseStream:
    """Turns one request's engine outputs into Triton responses.

    As Triton's vLLM backend does, every response carries all ``n`` sequences of the request:
    ``text_output``, ``finish_reason``, ``num_output_tokens`` and ``output_logprobs`` have one
    entry per sequence, entry ``j`` being sequence ``j``'s (its new text when streaming, ""
    when it added none; its finish reason, "" while it runs). A stream sends a response for
    each output taken from its mailbox that added text to some sequence (one step's, or
    several steps' coalesced while the responder was behind), and the final one when all have
    finished.

    ``prompt_logprobs`` (asked for in ``sampling_parameters``) is the request's, not a
    sequence's: one JSON list, sent once, in the first response after the prompt was computed
    (the engine's output that carries them may add no text yet: they wait for the next).

    :meth:`on_output` runs on the engine loop's thread and only fills the mailbox; everything
    else runs on the responder's.
    """

    __slots__ = ("pb", "sender", "parsed", "lock", "logprobs_sent", "decode", "error_output",
                 "prompt_logprobs", "request_id", "mailbox")

    def __init__(self, pb_utils: Any, sender: Any, parsed: ParsedRequest, request_id: str,
                 responder: Responder, decode: Callable[[int], str] | None = None,
                 error_output: bool = False) -> None:
        self.pb = pb_utils
        self.error_output = error_output  # errors as outputs (see error_response)
        self.decode = decode
        self.sender = sender
        self.parsed = parsed
        self.request_id = request_id
        self.lock = threading.Lock()
        self.logprobs_sent: dict[int, int] = {}  # per sequence: tokens whose logprobs went
        self.prompt_logprobs: bytes | None = None  # JSON not sent yet
        self.mailbox = OutputMailbox(lambda: responder.ready(self))

    def on_output(self, out: RequestOutput) -> None:
        """The engine loop's callback: queue ``out`` for the responder (a non-streamed
        request's outputs before its last matter only if they carry the prompt logprobs)."""
        if (self.parsed.stream or out.finished or out.prompt_logprobs is not None
                or out.error is not None):
            self.mailbox.put(out)

    @property
    def closed(self) -> bool:
        """The final response went (or the client is gone and the stream was closed)."""
        return self.sender is None

    def is_cancelled(self) -> bool:
        """Whether Triton says the client cancelled (a round trip to tritonserver)."""
        sender = self.sender
        if sender is None:
            return False
        try:
            return bool(sender.is_cancelled())
        except Exception:  # noqa: BLE001  a gone client counts as cancelled
            return True

    def flush(self) -> None:
        """On the responder: send what the mailbox holds."""
        for out in self.mailbox.take():
            self._respond(out)

    def _respond(self, out: RequestOutput) -> None:
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
            pb.Tensor("num_draft_tokens", np.array([out.num_draft_tokens], dtype=np.uint32)),
            pb.Tensor("num_accepted_tokens", np.array([out.num_accepted_tokens],
                                                      dtype=np.uint32)),
        ]
        if seqs[0].logprobs is not None:
            # Every token since the last response (a stream sends nothing for a token that
            # adds no text yet, so its logprobs ride on the next response).
            entries = []
            for c in seqs:
                entries.append(json.dumps(logprob_entries(c, self.logprobs_sent.get(c.index, 0),
                                                          self.decode)).encode())
                # NOTE: the engine's list may have grown since this output: count its tokens'.
                self.logprobs_sent[c.index] = min(len(c.logprobs or ()), c.num_tokens)
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


_STOP = None


class Responder:
    """The thread that sends every :class:`ResponseStream`'s responses, in the order their
    mailboxes filled, and aborts (through ``abort(request_id)``, the engine loop's) the
    requests whose clients cancelled, polling Triton every ``cancel_poll_s`` while any
    request is live. The engine loop never waits on the stub's IPC."""

    def __init__(self, abort: Callable[[str], None],
                 cancel_poll_s: float = CANCEL_POLL_S) -> None:
        self.abort = abort
        self.cancel_poll_s = cancel_poll_s
        # Streams with outputs to send; an Event is a drain() waiting; None stops the thread.
        self._ready: queue.SimpleQueue[ResponseStream | threading.Event | None] = (
            queue.SimpleQueue())
        self._live: dict[str, ResponseStream] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvflow-responder",
                                        daemon=True)
        self._thread.start()

    def add(self, stream: ResponseStream) -> None:
        """Watch ``stream``'s client for a cancel until its final response."""
        with self._lock:
            self._live[stream.request_id] = stream

    def ready(self, stream: ResponseStream) -> None:
        """``stream``'s mailbox has outputs (its callback, on the engine loop's thread)."""
        self._ready.put(stream)

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every response queued before this call has been handed to Triton; False
        if that took over ``timeout_s`` or the thread has stopped. For the engine's failure
        hook, before it stops tritonserver: every waiter's error (which names the failure)
        then leaves before the server refuses anything."""
        if threading.current_thread() is self._thread:
            return False  # it would wait on itself
        reached = threading.Event()
        self._ready.put(reached)
        return self._thread.is_alive() and reached.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, then stop the thread."""
        self._ready.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        next_poll = time.monotonic() + self.cancel_poll_s
        while True:
            with self._lock:
                watching = bool(self._live)
            try:
                stream = self._ready.get(timeout=max(0.0, next_poll - time.monotonic())
                                         if watching else None)
            except queue.Empty:
                stream = None
            else:
                if stream is _STOP:
                    return
                if isinstance(stream, threading.Event):  # a drain: all before it went
                    stream.set()
                    continue
            if stream is not None:
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001  this request's failure, not the others'
                    log.exception("kvflow: responding to request %s failed", stream.request_id)
                    with contextlib.suppress(Exception):
                        stream._send(None, stream.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    self.abort(stream.request_id)
                if stream.closed:
                    with self._lock:
                        self._live.pop(stream.request_id, None)
            if time.monotonic() >= next_poll:
                self._poll_cancelled()
                next_poll = time.monotonic() + self.cancel_poll_s

    def _poll_cancelled(self) -> None:
        with self._lock:
            streams = list(self._live.values())
        for stream in streams:
            if stream.is_cancelled():
                with self._lock:
                    self._live.pop(stream.request_id, None)
                self.abort(stream.request_id)
