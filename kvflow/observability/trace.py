"""The step timeline's ring: what the scheduler did, step by step. Pure Python.

:class:`StepTracer` keeps a ring of the last ``max_steps`` engine steps (one small record each:
the batch, preemptions, swaps, KV usage, the requests that ended) and writes them on demand as
a Chrome Trace Event file (:mod:`kvflow.observability.chrome_trace` draws it), which Perfetto
(ui.perfetto.dev) and chrome://tracing open.

The engine records a step only when a tracer is set (``trace_steps``): tracing off costs
nothing. The simulator's engine is the same engine, so a simulated run writes the same format,
on its simulated clock. :mod:`kvflow.observability.trace_summary` reads a file back
(``kvflow trace summarize``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvflow.observability.chrome_trace import trace_events


@dataclass(frozen=True, slots=True)
class StepTimes:
    """When each stage of one step began, and when the step ended (the engine's clock)."""

    start: float
    scheduled: float  # scheduling done, the runner starts
    executed: float  # the runner done, sampling starts
    sampled: float  # sampling done, postprocessing starts
    end: float

    @property
    def boundaries(self) -> tuple[float, float, float, float, float]:
        """The five times in order: the phases lie between consecutive ones."""
        return self.start, self.scheduled, self.executed, self.sampled, self.end


@dataclass(frozen=True, slots=True)
class Entry:
    """One scheduled chunk of a step."""

    seq_id: str
    kind: str  # prefill, recompute (a prefill after a preemption) or decode
    num_tokens: int
    arrival: float | None  # the sequence's arrival, when it is scheduled for the first time
    sampled: bool  # the chunk ends its prompt (or is a decode): a token was sampled
    drafts: int = 0  # speculative decoding: draft tokens scored with a decode (in num_tokens)
    accepted: int = 0  # of which verification accepted


@dataclass(frozen=True, slots=True)
class Finish:
    """A sequence's end."""

    seq_id: str
    reason: str  # the finish reason (stop, length, abort, timeout)
    time: float
    arrival: float | None  # its arrival, when it never ran (so that its wait is drawn)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step: its phase boundaries ``times``, its chunks, what the scheduler did to
    get there (``preempted`` sequence ids, ``transfers``: blocks copied or swapped, by kind),
    and the state after it. ``finished`` may grow: the ring puts the ends between steps
    first."""

    index: int
    times: StepTimes
    entries: list[Entry]
    preempted: list[str]
    transfers: dict[str, int]
    kv_usage: float
    kv_blocks_used: int
    running: int
    waiting: int
    finished: list[Finish]


class TraceSnapshot(NamedTuple):
    """The ring's contents at one moment (see :meth:`StepTracer.snapshot`)."""

    steps: list[StepRecord]
    pending: list[Finish]
    dropped_steps: int


def check_trace_path(path: str | Path) -> Path:
    """The trace file's absolute path, once its folder exists and is writable (refused early,
    naming the option, rather than at shutdown)."""
    path = Path(path).resolve()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"trace_steps: cannot create {path.parent}: {e}") from None
    if path.is_dir() or not os.access(path.parent, os.W_OK):
        raise ValueError(f"trace_steps: cannot write {path}")
    return path


class StepTracer:
    """A bounded ring of :class:`StepRecord` and the requests' ends between steps; written to
    ``path`` by :meth:`write` (atomically: a reader never sees half a file).

    Args:
        path: the trace file (JSON).
        max_steps: steps kept; older ones are dropped, and counted (``dropped_steps``).
        source: what produced the steps (``engine`` or ``simulator``), in the file's metadata.
    """

    def __init__(self, path: str | Path, max_steps: int = 10_000,
                 source: str = "engine") -> None:
        if max_steps < 1:
            raise ValueError(f"trace_max_steps must be >= 1, got {max_steps}")
        self.path = check_trace_path(path)
        self.source = source
        self.steps: deque[StepRecord] = deque(maxlen=max_steps)
        self.num_steps = 0
        # Ends outside a step (aborts, timeouts before an empty step): the next record's.
        self.pending: list[Finish] = []

    @property
    def dropped_steps(self) -> int:
        return self.num_steps - len(self.steps)

    def record(self, record: StepRecord) -> None:
        if self.pending:
            record.finished[:0] = self.pending
            self.pending = []
        self.steps.append(record)
        self.num_steps += 1

    def finish(self, request_id: str, reason: str, t: float,
               arrival: float | None = None) -> None:
        """A sequence ended outside a step (an abort, a timeout before an empty step);
        ``arrival`` for one that never ran, so that its wait is drawn."""
        self.pending.append(Finish(request_id, reason, t, arrival))

    def snapshot(self) -> TraceSnapshot:
        """The ring's contents now (cheap: on the engine's thread, so that :meth:`write` may
        build and write the file on another one without stalling the steps)."""
        return TraceSnapshot(steps=list(self.steps), pending=list(self.pending),
                             dropped_steps=self.dropped_steps)

    def write(self, path: str | Path | None = None,
              snapshot: TraceSnapshot | None = None) -> Path:
        """Write the ring (or a :meth:`snapshot` of it) as a Trace Event JSON file, to
        ``path`` (default the tracer's)."""
        path = Path(path) if path is not None else self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        snap = snapshot or self.snapshot()
        doc = {"traceEvents": trace_events(snap.steps, snap.pending),
               "displayTimeUnit": "ms",
               "otherData": {"producer": "kvflow", "source": self.source,
                             "steps": len(snap.steps), "dropped_steps": snap.dropped_steps,
                             "clock": "microseconds from the first step kept (or an "
                                      "earlier arrival)"}}
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, separators=(",", ":"))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path
