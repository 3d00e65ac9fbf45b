"""One request's outputs between the engine loop and a slower consumer, coalesced.

The engine loop hands every step's :class:`RequestOutput` to a callback on its own thread. A
front door that sends each one to a client through a slow path (an IPC round trip, a
network write) would hold the engine up if it sent them there. :class:`OutputMailbox` lets
the engine thread only drop the output in; a consumer thread takes them out. When the consumer
keeps up, it takes each output alone, as soon as it is put: every token reaches the client
at once. When it falls behind, the outputs waiting are taken as one
(:func:`coalesce_outputs`), as vLLM's ``stream_interval`` does, except that no interval is
fixed: outputs are merged only while the consumer has not yet taken the previous one, and the
final output is never held back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvflow.orchestrator.outputs import CompletionOutput, RequestOutput


def coalesce_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as the one output a single step adding all their
    tokens would have given: each sequence's ``delta_text`` and ``delta_token_ids`` joined,
    the prompt logprobs of whichever carried them, everything else (cumulative text and
    tokens, finish reasons, logprobs, counts, metrics, error) the last output's."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    merged = []
    for j, seq in enumerate(last.outputs):
        parts = [out.outputs[j] for out in outputs]
        # NOTE: token_ids is read once here: the last output's prefix of the sequence's list.
        merged.append(CompletionOutput(
            seq.index, seq.text, seq.token_ids, "".join(p.delta_text for p in parts),
            [t for p in parts for t in p.delta_token_ids], seq.finish_reason,
            seq.stop_reason, seq.logprobs))
    prompt_logprobs = next((out.prompt_logprobs for out in outputs
                            if out.prompt_logprobs is not None), None)
    return RequestOutput(
        request_id=last.request_id, outputs=merged, finished=last.finished,
        num_prompt_tokens=last.num_prompt_tokens, metrics=last.metrics, error=last.error,
        error_code=last.error_code, cached_tokens=last.cached_tokens,
        prompt_token_ids=last.prompt_token_ids, prompt_logprobs=prompt_logprobs,
        num_draft_tokens=last.num_draft_tokens, num_accepted_tokens=last.num_accepted_tokens)


class OutputMailbox:
    """Outputs of one request on their way from the engine loop to one consumer thread.

    :meth:`put` (the engine loop's callback) never blocks on the consumer. ``on_ready`` is
    called (on the putting thread) when the mailbox turns from empty to holding an output: a
    consumer serving many mailboxes queues it then, and takes it later. :meth:`take` returns
    what waits, coalesced: one output per run of outputs without an error; an output with an
    error or an abort (a rejection, a cancel, the engine's failure) stays apart, so that the
    text before it is delivered as it was.
    """

    __slots__ = ("_lock", "_pending", "_on_ready", "_ready")

    def __init__(self, on_ready: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._pending: list[RequestOutput] = []
        self._on_ready = on_ready
        self._ready = threading.Condition(self._lock)

    def put(self, out: RequestOutput) -> None:
        with self._lock:
            self._pending.append(out)
            first = len(self._pending) == 1
            self._ready.notify()
        if first and self._on_ready is not None:
            self._on_ready()

    def take(self) -> list[RequestOutput]:
        """Everything put since the last take, coalesced (empty if nothing was)."""
        with self._lock:
            pending, self._pending = self._pending, []
        return _coalesce_runs(pending)

    def wait_take(self, timeout_s: float | None = None) -> list[RequestOutput]:
        """:meth:`take`, first waiting up to ``timeout_s`` for an output to be put (for a
        consumer that serves this mailbox alone)."""
        with self._lock:
            self._ready.wait_for(lambda: bool(self._pending), timeout_s)
            pending, self._pending = self._pending, []
        return _coalesce_runs(pending)


def _coalesce_runs(pending: list[RequestOutput]) -> list[RequestOutput]:
    out: list[RequestOutput] = []
    run: list[RequestOutput] = []
    for item in pending:
        if item.error is not None or item.aborted:
            if run:
                out.append(coalesce_outputs(run))
                run = []
            out.append(item)
        else:
            run.append(item)
    if run:
        out.append(coalesce_outputs(run))
    return out
