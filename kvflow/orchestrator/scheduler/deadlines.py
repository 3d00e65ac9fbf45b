"""Deadlines: when a request times out, and which requests are past theirs. Pure Python.

A request's deadline is its arrival plus ``timeout_ms`` (its own) or ``request_timeout_s``
(the engine's). The scheduler finishes every request past its deadline at the start of a step,
wherever it is (waiting, prefilling or decoding), so that its blocks are free for that step.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.request import Request, RequestStatus


def timeout_s(request: Request, config: EngineOptions) -> float | None:
    """The request's time limit: its own ``timeout_ms``, else the engine's default."""
    timeout_ms = request.sampling_params.timeout_ms
    return timeout_ms / 1000 if timeout_ms is not None else config.request_timeout_s


def timeout_phase(members: list[Request]) -> str:
    """Where a timed-out request was (``waiting``, ``prefill`` or ``decode``), for the metric
    and the trace: decoding if any running sequence of it was."""
    if all(m.status != RequestStatus.RUNNING for m in members):
        return "waiting"
    if any(m.status == RequestStatus.RUNNING and m.num_computed_tokens + 1 >= m.num_tokens
           for m in members):
        return "decode"
    return "prefill"


class Deadlines:
    """The requests with a deadline, soonest first (a heap of ``(deadline, tie, request)``).

    One entry per request the client sent: a group's entry is its first sequence. Entries of
    finished requests are dropped lazily, as they come up, or all at once by :meth:`compact`.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._tie = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, request: Request, members: list[Request], timeout_s: float) -> None:
        """``request`` (with ``members``, its sequences) must finish ``timeout_s`` after it
        arrived."""
        deadline = request.arrival_time + timeout_s
        for m in members:
            m.deadline = deadline
        heapq.heappush(self._heap, (deadline, next(self._tie), request))

    def expired(self, now: float) -> Iterator[Request]:
        """Pop and yield each unfinished request whose deadline is at or before ``now``."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            request = heapq.heappop(heap)[2]
            if not (request.group or request).is_finished:
                yield request

    def compact(self, num_unfinished: int) -> None:
        """Drop the entries of finished requests once they are the majority."""
        if len(self._heap) > 64 and len(self._heap) > 2 * num_unfinished:
            # NOTE: a group's entry is its first sequence, which may finish before the rest.
            self._heap = [e for e in self._heap if not (e[2].group or e[2]).is_finished]
            heapq.heapify(self._heap)
