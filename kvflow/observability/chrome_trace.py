"""The step ring as Chrome Trace Event JSON, the format Perfetto (ui.perfetto.dev) and
chrome://tracing open. Pure Python.

:func:`trace_events` draws:

* one track for the engine: each step a slice named by what it carried (``prefill``,
  ``decode`` or ``mixed``), with its schedule, model, sample and postprocess phases nested in
  it, and counter tracks for KV usage, the queue and the tokens of each step;
* one track per request (per sequence of an ``n > 1`` request): ``waiting``, each
  ``prefill`` (or ``recompute``, after a preemption) chunk, ``decode`` runs, ``preempted``
  spells and a ``finished`` mark carrying the reason.
"""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the ring imports this renderer: its types are for the checker only
    from kvflow.observability.trace import Entry, Finish, StepRecord

# The slices between a StepRecord's five ``times.boundaries``, in order.
PHASES = ("schedule", "model", "sample", "postprocess")
REQUEST_PHASES = ("waiting", "prefill", "recompute", "decode", "preempted")
MAX_LISTED = 64  # requests named in one step's args, at most
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
    times = [t for f in ends for t in (f.time, f.arrival) if t is not None]
    times += [e.arrival for rec in steps for e in rec.entries if e.arrival is not None]
    if steps:
        times.append(steps[0].times.start)
    if not times:
        return events
    # Time 0: the earliest moment shown (the first step kept, an arrival, an end before it).
    origin = min(times)

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    tids: dict[str, int] = {}
    tracks = _RequestTracks(events, us)
    for rec in steps:
        t0, t4 = rec.times.start, rec.times.end
        prefill = sum(e.num_tokens for e in rec.entries if e.kind != "decode")
        decode = sum(1 for e in rec.entries if e.kind == "decode")
        drafts = sum(e.drafts for e in rec.entries)
        spec = ({"draft_tokens": drafts, "accepted_tokens": sum(e.accepted for e in rec.entries)}
                if drafts else {})
        name = "mixed" if prefill and decode else "prefill" if prefill else "decode"
        listed = [f"{e.seq_id} {e.kind} {e.num_tokens}" for e in rec.entries[:MAX_LISTED]]
        events.append({
            "ph": "X", "pid": ENGINE_PID, "tid": 1, "name": name, "cat": "step",
            "ts": us(t0), "dur": us(t4) - us(t0),
            "args": {"step": rec.index, "prefill_tokens": prefill, "decode_tokens": decode,
                     **spec, "seqs": len(rec.entries), "requests": listed,
                     "more_requests": max(len(rec.entries) - MAX_LISTED, 0),
                     "preempted": rec.preempted, **rec.transfers,
                     "kv_usage": round(rec.kv_usage, 4), "kv_blocks_used": rec.kv_blocks_used,
                     "running": rec.running, "waiting": rec.waiting,
                     "finished": [f"{f.seq_id} {f.reason}" for f in rec.finished]}})
        for phase, (a, b) in zip(PHASES, pairwise(rec.times.boundaries), strict=True):
            events.append({"ph": "X", "pid": ENGINE_PID, "tid": 1, "name": phase,
                           "cat": "phase", "ts": us(a), "dur": us(b) - us(a)})
        events += [
            {"ph": "C", "pid": ENGINE_PID, "name": "KV cache", "ts": us(t4),
             "args": {"usage": round(rec.kv_usage, 4)}},
            {"ph": "C", "pid": ENGINE_PID, "name": "requests", "ts": us(t4),
             "args": {"running": rec.running, "waiting": rec.waiting}},
            {"ph": "C", "pid": ENGINE_PID, "name": "tokens", "ts": us(t0),
             "args": {"prefill": prefill, "decode": decode}}]
        if spec:  # speculative decoding: drafts scored and accepted, each step
            events.append({"ph": "C", "pid": ENGINE_PID, "name": "speculation", "ts": us(t0),
                           "args": {"drafts": spec["draft_tokens"],
                                    "accepted": spec["accepted_tokens"]}})
        for rid in rec.preempted:
            tracks.preempt(_tid(tids, events, rid), t0)
        for e in rec.entries:
            tracks.run(_tid(tids, events, e.seq_id), rec, e)
        for f in rec.finished:
            tracks.finish(_tid(tids, events, f.seq_id), f)
    for f in pending:
        tracks.finish(_tid(tids, events, f.seq_id), f)
    tracks.close_all(steps[-1].times.end if steps else origin)
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
        # tid -> [start, end, tokens emitted, drafts scored, drafts accepted]
        self.decoding: dict[int, list[float]] = {}

    def _slice(self, tid: int, name: str, a: float, b: float, **args: Any) -> None:
        event = {"ph": "X", "pid": REQUESTS_PID, "tid": tid, "name": name, "cat": "request",
                 "ts": self.us(a), "dur": max(self.us(b) - self.us(a), 0.0)}
        if args:
            event["args"] = args
        self.events.append(event)

    def _end_decode(self, tid: int) -> None:
        run = self.decoding.pop(tid, None)
        if run is not None:
            spec = {"drafts": int(run[3]), "accepted": int(run[4])} if run[3] else {}
            self._slice(tid, "decode", run[0], run[1], tokens=int(run[2]), **spec)

    def _end_wait(self, tid: int, t: float) -> None:
        state = self.since.pop(tid, None)
        if state is not None:
            self._slice(tid, state[0], state[1], t)

    def preempt(self, tid: int, t: float) -> None:
        self._end_decode(tid)
        self.since[tid] = ("preempted", t)

    def run(self, tid: int, rec: StepRecord, entry: Entry) -> None:
        t0, t4 = rec.times.start, rec.times.end
        if entry.arrival is not None:
            self.since[tid] = ("waiting", entry.arrival)
        self._end_wait(tid, t0)
        if entry.kind == "decode":
            run = self.decoding.setdefault(tid, [t0, t4, 0, 0, 0])
            run[1] = t4
            run[2] += 1 + entry.accepted
            run[3] += entry.drafts
            run[4] += entry.accepted
            return
        self._end_decode(tid)
        self._slice(tid, entry.kind, t0, t4, tokens=entry.num_tokens, step=rec.index,
                    sampled=entry.sampled)

    def finish(self, tid: int, end: Finish) -> None:
        if end.arrival is not None and tid not in self.since:
            self.since[tid] = ("waiting", end.arrival)
        self._end_decode(tid)
        self._end_wait(tid, end.time)
        self.events.append({"ph": "i", "s": "t", "pid": REQUESTS_PID, "tid": tid,
                            "name": "finished", "cat": "request", "ts": self.us(end.time),
                            "args": {"reason": end.reason}})

    def close_all(self, t: float) -> None:
        for tid in list(self.decoding):
            self._end_decode(tid)
        for tid in list(self.since):
            self._end_wait(tid, t)
