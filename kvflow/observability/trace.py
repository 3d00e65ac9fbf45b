"""The step timeline: what the scheduler did, step by step, as a Chrome Trace Event file that
Perfetto (ui.perfetto.dev) and chrome://tracing open. Pure Python.

:class:`StepTracer` keeps a ring of the last ``max_steps`` engine steps (one small record each:
the batch, preemptions, swaps, KV usage, the requests that ended) and writes them on demand:

* one track for the engine: each step a slice named by what it carried (``prefill``,
  ``decode`` or ``mixed``), with its schedule, model, sample and postprocess phases nested in
  it, and counter tracks for KV usage, the queue and the tokens of each step;
* one track per request (per sequence of an ``n > 1`` request): ``waiting``, each
  ``prefill`` (or ``recompute``, after a preemption) chunk, ``decode`` runs, ``preempted``
  spells and a ``finished`` mark carrying the reason.

The engine records a step only when a tracer is set (``trace_steps``): tracing off costs
nothing. The simulator's engine is the same engine, so a simulated run writes the same format,
on its simulated clock. :func:`summarize` reads a file back into per-phase totals and the
longest steps (``kvflow trace summarize``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import threading
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

# One scheduled chunk: (sequence id, kind, tokens, its arrival if first scheduled now, sampled)
Entry = tuple[str, str, int, float | None, bool]
# A sequence's end: (sequence id, finish reason, time, its arrival if it never ran)
Finish = tuple[str, str, float, float | None]
PHASES = ("schedule", "model", "sample", "postprocess")
REQUEST_PHASES = ("waiting", "prefill", "recompute", "decode", "preempted")
MAX_LISTED = 64  # requests named in one step's args, at most


class StepRecord:
    """One engine step: its phase boundaries ``times`` (start, scheduled, model done, sampled,
    end), its chunks, what the scheduler did to get there, and the state after it."""

    __slots__ = ("index", "times", "entries", "preempted", "transfers", "kv_usage",
                 "kv_blocks_used", "running", "waiting", "finished")

    def __init__(self, index: int, times: tuple[float, float, float, float, float],
                 entries: list[Entry], preempted: list[str], transfers: dict[str, int],
                 kv_usage: float, kv_blocks_used: int, running: int, waiting: int,
                 finished: list[Finish]) -> None:
        self.index, self.times, self.entries = index, times, entries
        self.preempted, self.transfers = preempted, transfers
        self.kv_usage, self.kv_blocks_used = kv_usage, kv_blocks_used
        self.running, self.waiting, self.finished = running, waiting, finished


class TraceSnapshot(NamedTuple):
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
        self.pending.append((request_id, reason, t, arrival))

    def snapshot(self) -> TraceSnapshot:
        """The ring's contents now (cheap: on the engine's thread, so that :meth:`write` may
        build and write the file on another one without stalling the steps)."""
        return TraceSnapshot(list(self.steps), list(self.pending), self.dropped_steps)

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


class SignalWatch:
    """Calls ``callback`` on a thread of its own each time the process gets ``signum``.

    The C-level handler writes to a socket (``signal.set_wakeup_fd``) from whichever thread
    the signal lands on, so this works while the main thread is blocked outside Python (the
    Triton stub's is). Must be created on the main thread; :meth:`close` restores the
    previous handler and wakeup fd.
    """

    def __init__(self, signum: int, callback: Callable[[], None],
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.signum, self.callback, self.on_error = signum, callback, on_error
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._previous = signal.signal(signum, lambda *_: None)  # raises off the main thread
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="kvflow-signal", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if not data:
                return
            if self.signum in data:
                try:
                    self.callback()
                except Exception as e:  # noqa: BLE001  (a failed write must not end the watch)
                    if self.on_error is not None:
                        self.on_error(e)

    def close(self) -> None:
        """Restore the previous handler (SIG_IGN if there was none Python knew of) and wakeup
        fd. Off the main thread they cannot be restored: the sockets are then left open (the
        C handler still writes to the wakeup fd, which must not be reused), and the thread
        stops."""
        try:
            signal.set_wakeup_fd(self._previous_fd)
            signal.signal(self.signum, self._previous if self._previous is not None
                          else signal.SIG_IGN)
        except ValueError:
            self.callback = lambda: None
            return
        self._write.close()
        self._read.shutdown(socket.SHUT_RDWR)
        self._thread.join(5.0)
        self._read.close()


ENGINE_PID, REQUESTS_PID = 1, 2


def trace_events(steps: list[StepRecord],
                 pending: list[Finish] | None = None) -> list[dict[str, Any]]:
    """The Trace Event list of these steps (timestamps in microseconds from the first)."""
    events: list[dict[str, Any]] = [
        _meta(ENGINE_PID, None, "process_name", "kvflow engine"),
        _meta(ENGINE_PID, 1, "thread_name", "steps"),
        _meta(REQUESTS_PID, None, "process_name", "requests"),
    ]
    pending = pending or []
    ends = [f for rec in steps for f in rec.finished] + pending
    times = [t for f in ends for t in (f[2], f[3]) if t is not None]
    times += [e[3] for rec in steps for e in rec.entries if e[3] is not None]
    if steps:
        times.append(steps[0].times[0])
    if not times:
        return events
    # Time 0: the earliest moment shown (the first step kept, an arrival, an end before it).
    origin = min(times)

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    tids: dict[str, int] = {}
    tracks = _RequestTracks(events, us)
    for rec in steps:
        t0, *_, t4 = rec.times
        prefill = sum(n for _, kind, n, _, _ in rec.entries if kind != "decode")
        decode = sum(1 for _, kind, _, _, _ in rec.entries if kind == "decode")
        name = "mixed" if prefill and decode else "prefill" if prefill else "decode"
        listed = [f"{rid} {kind} {n}" for rid, kind, n, _, _ in rec.entries[:MAX_LISTED]]
        events.append({
            "ph": "X", "pid": ENGINE_PID, "tid": 1, "name": name, "cat": "step",
            "ts": us(t0), "dur": us(t4) - us(t0),
            "args": {"step": rec.index, "prefill_tokens": prefill, "decode_tokens": decode,
                     "seqs": len(rec.entries), "requests": listed,
                     "more_requests": max(len(rec.entries) - MAX_LISTED, 0),
                     "preempted": rec.preempted, **rec.transfers,
                     "kv_usage": round(rec.kv_usage, 4), "kv_blocks_used": rec.kv_blocks_used,
                     "running": rec.running, "waiting": rec.waiting,
                     "finished": [f"{f[0]} {f[1]}" for f in rec.finished]}})
        for phase, (a, b) in zip(PHASES, zip(rec.times, rec.times[1:], strict=False), strict=True):
            events.append({"ph": "X", "pid": ENGINE_PID, "tid": 1, "name": phase,
                           "cat": "phase", "ts": us(a), "dur": us(b) - us(a)})
        events += [
            {"ph": "C", "pid": ENGINE_PID, "name": "KV cache", "ts": us(t4),
             "args": {"usage": round(rec.kv_usage, 4)}},
            {"ph": "C", "pid": ENGINE_PID, "name": "requests", "ts": us(t4),
             "args": {"running": rec.running, "waiting": rec.waiting}},
            {"ph": "C", "pid": ENGINE_PID, "name": "tokens", "ts": us(t0),
             "args": {"prefill": prefill, "decode": decode}}]
        for rid in rec.preempted:
            tracks.preempt(_tid(tids, events, rid), t0)
        for rid, kind, n, arrival, sampled in rec.entries:
            tracks.run(_tid(tids, events, rid), rec, kind, n, arrival, sampled)
        for rid, reason, t, arrival in rec.finished:
            tracks.finish(_tid(tids, events, rid), reason, t, arrival)
    for rid, reason, t, arrival in pending:
        tracks.finish(_tid(tids, events, rid), reason, t, arrival)
    tracks.close_all(steps[-1].times[-1] if steps else origin)
    return events


def _meta(pid: int, tid: int | None, name: str, value: str) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "M", "pid": pid, "name": name, "args": {"name": value}}
    if tid is not None:
        event["tid"] = tid
    return event


def _tid(tids: dict[str, int], events: list[dict[str, Any]], rid: str) -> int:
    tid = tids.get(rid)
    if tid is None:
        tid = tids[rid] = len(tids) + 1
        events.append(_meta(REQUESTS_PID, tid, "thread_name", f"req {rid}"))
    return tid


class _RequestTracks:
    """Each request's state while the steps are walked, emitting its slices."""

    def __init__(self, events: list[dict[str, Any]], us: Any) -> None:
        self.events, self.us = events, us
        self.since: dict[int, tuple[str, float]] = {}  # tid -> (waiting|preempted, since)
        self.decoding: dict[int, list[float]] = {}  # tid -> [start, end, tokens]

    def _slice(self, tid: int, name: str, a: float, b: float, **args: Any) -> None:
        event = {"ph": "X", "pid": REQUESTS_PID, "tid": tid, "name": name, "cat": "request",
                 "ts": self.us(a), "dur": max(self.us(b) - self.us(a), 0.0)}
        if args:
            event["args"] = args
        self.events.append(event)

    def _end_decode(self, tid: int) -> None:
        run = self.decoding.pop(tid, None)
        if run is not None:
            self._slice(tid, "decode", run[0], run[1], tokens=int(run[2]))

    def _end_wait(self, tid: int, t: float) -> None:
        state = self.since.pop(tid, None)
        if state is not None:
            self._slice(tid, state[0], state[1], t)

    def preempt(self, tid: int, t: float) -> None:
        self._end_decode(tid)
        self.since[tid] = ("preempted", t)

    def run(self, tid: int, rec: StepRecord, kind: str, n: int, arrival: float | None,
            sampled: bool) -> None:
        t0, t4 = rec.times[0], rec.times[-1]
        if arrival is not None:
            self.since[tid] = ("waiting", arrival)
        self._end_wait(tid, t0)
        if kind == "decode":
            run = self.decoding.setdefault(tid, [t0, t4, 0])
            run[1] = t4
            run[2] += 1
            return
        self._end_decode(tid)
        self._slice(tid, kind, t0, t4, tokens=n, step=rec.index, sampled=sampled)

    def finish(self, tid: int, reason: str, t: float, arrival: float | None) -> None:
        if arrival is not None and tid not in self.since:
            self.since[tid] = ("waiting", arrival)
        self._end_decode(tid)
        self._end_wait(tid, t)
        self.events.append({"ph": "i", "s": "t", "pid": REQUESTS_PID, "tid": tid,
                            "name": "finished", "cat": "request", "ts": self.us(t),
                            "args": {"reason": reason}})

    def close_all(self, t: float) -> None:
        for tid in list(self.decoding):
            self._end_decode(tid)
        for tid in list(self.since):
            self._end_wait(tid, t)


def load(path: str | Path) -> dict[str, Any]:
    """A trace file, checked to be a Trace Event JSON object."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Trace Event file (no traceEvents list)")
    return doc


def summarize(path: str | Path, top: int = 10) -> str:
    """Per-phase totals (engine phases, request phases) and the ``top`` longest steps."""
    doc = load(path)
    if doc.get("otherData", {}).get("producer") != "kvflow":
        raise ValueError(f"{path}: not a kvflow step timeline (written by --trace-steps)")
    if top < 0:
        raise ValueError(f"--top must be >= 0, got {top}")
    events = doc["traceEvents"]
    steps = [e for e in events if e.get("cat") == "step"]
    phases: dict[str, float] = defaultdict(float)
    request_time: dict[str, float] = defaultdict(float)
    request_count: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for e in events:
        if e.get("cat") == "phase":
            phases[e["name"]] += e["dur"]
        elif e.get("cat") == "request" and e["ph"] == "X":
            request_time[e["name"]] += e["dur"]
            request_count[e["name"]] += 1
        elif e.get("cat") == "request" and e["name"] == "finished":
            reasons[e["args"]["reason"]] += 1
    for e in steps:
        kinds[e["name"]] += 1
    total = sum(e["dur"] for e in steps)
    other = doc.get("otherData", {})
    lines = [f"{path}: {len(steps)} steps from the {other.get('source', '?')}"
             f" ({other.get('dropped_steps', 0)} older steps dropped from the ring), "
             f"{total / 1e3:.1f} ms inside steps"]
    if steps:
        span = steps[-1]["ts"] + steps[-1]["dur"] - steps[0]["ts"]
        lines[0] += f" over {span / 1e3:.1f} ms"
    lines += ["", "Steps by kind: " + ", ".join(
        f"{k} {kinds[k]}" for k in ("prefill", "mixed", "decode") if kinds[k]),
        f"Tokens: {sum(e['args']['prefill_tokens'] for e in steps)} prefill, "
        f"{sum(e['args']['decode_tokens'] for e in steps)} decode; "
        f"{sum(len(e['args']['preempted']) for e in steps)} preemptions", "",
        "| engine phase | total (ms) | share of step time |", "|---|---:|---:|"]
    for phase in PHASES:
        share = phases[phase] / total if total else 0.0
        lines.append(f"| {phase} | {phases[phase] / 1e3:.1f} | {share:.1%} |")
    lines += ["", "| request phase | slices | total (ms) | mean (ms) |", "|---|---:|---:|---:|"]
    for phase in REQUEST_PHASES:
        n = request_count[phase]
        if n:
            lines.append(f"| {phase} | {n} | {request_time[phase] / 1e3:.1f} | "
                         f"{request_time[phase] / n / 1e3:.2f} |")
    if reasons:
        lines += ["", "Finished: " + ", ".join(f"{r} {n}" for r, n in reasons.most_common())]
    lines += ["", f"The {min(top, len(steps))} longest steps:", "",
              "| step | kind | ms | prefill tokens | decode tokens | seqs | preempted | "
              "KV usage |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for e in sorted(steps, key=lambda e: -e["dur"])[:top]:
        a = e["args"]
        lines.append(f"| {a['step']} | {e['name']} | {e['dur'] / 1e3:.2f} | "
                     f"{a['prefill_tokens']} | {a['decode_tokens']} | {a['seqs']} | "
                     f"{len(a['preempted'])} | {a['kv_usage']:.0%} |")
    return "\n".join(lines)
