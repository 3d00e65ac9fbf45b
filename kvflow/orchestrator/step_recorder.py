"""The engine's bookkeeping of each step: its :class:`StepStats`, the running
:class:`EngineCounters` and, when tracing, its record in the step timeline. Pure Python.

The step loop (:class:`~kvflow.orchestrator.engine.LLMEngine`) decides; :class:`StepRecorder`
only writes down what was decided, so that metrics, the simulator, reports and tests read one
account of it (``engine.step_stats``, ``engine.counters``, ``engine.tracer``).
"""

from __future__ import annotations

from collections import deque

from kvflow.kv_manager import KVCacheManager
from kvflow.observability.trace import Entry, Finish, StepRecord, StepTimes, StepTracer
from kvflow.orchestrator.output_processor import SampledTokens
from kvflow.orchestrator.outputs import EngineCounters, RequestOutput, StepStats
from kvflow.orchestrator.request import Request, RequestStatus
from kvflow.orchestrator.scheduler.core import Scheduler
from kvflow.orchestrator.scheduler.output import TRANSFER_KINDS, Clock, SchedulerOutput


class StepRecorder:
    """Records each step of one engine.

    Args:
        scheduler: the engine's scheduler (the queues' lengths, the prefix cache's counts; it
            is told each step's tokens, prefill tokens and duration).
        kv: the engine's KV manager (the pool's usage after each step).
        counters: the engine's running totals, shared with its output processor.
        clock: the engine's clock (read only to time the ends traced between steps).
        stats_window: how many recent :class:`StepStats` to keep.
        tracer: the step timeline (None: no step is recorded there, tracing costs nothing).
    """

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, counters: EngineCounters,
                 clock: Clock, stats_window: int = 4096,
                 tracer: StepTracer | None = None) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.counters = counters
        self.clock = clock
        self.step_stats: deque[StepStats] = deque(maxlen=stats_window)
        self.tracer = tracer

    def record(self, sched: SchedulerOutput, outputs: list[RequestOutput],
               sampled: SampledTokens, times: StepTimes) -> None:
        """A step that ran: its counts, its :class:`StepStats` and its timeline record."""
        num_decode = sched.num_decode_tokens
        num_spec = sched.num_spec_tokens
        num_prefill = sched.num_batched_tokens - num_decode - num_spec
        step_time_s = times.end - times.start
        c = self.counters
        c.prompt_tokens += num_prefill
        c.generation_tokens += sum(map(len, sampled.token_ids))
        lengths: list[int] = []
        if sampled.num_drafts is not None:
            lengths = [len(tokens) for tokens, k in zip(sampled.token_ids, sampled.num_drafts,
                                                        strict=True) if k]
            c.spec_draft_tokens += sum(sampled.num_drafts)
            c.spec_accepted_tokens += sum(lengths) - len(lengths)
        c.steps += 1
        c.step_time_s += step_time_s
        c.prefix_cache_queries = self.scheduler.prefix_cache_queries
        c.prefix_cache_hits = self.scheduler.prefix_cache_hits
        c.prompt_logprobs_recomputed_tokens = self.scheduler.prompt_logprobs_recomputed_tokens
        self.scheduler.observe_step(num_prefill, step_time_s, sched.num_batched_tokens)
        stats = StepStats(
            time=times.end, num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_prefill_tokens=num_prefill, num_decode_tokens=num_decode,
            num_scheduled_seqs=len(sched.scheduled),
            kv_blocks_used=self.kv.pool.num_used_blocks, kv_usage=self.kv.usage,
            num_preempted=len(sched.preempted),
            schedule_time_s=times.scheduled - times.start,
            model_time_s=times.executed - times.scheduled,
            sample_time_s=times.sampled - times.executed,
            postprocess_time_s=times.end - times.sampled,
            num_timed_out=len(sched.timed_out),
            finished=[o.request_id for o in outputs if o.finished],
            scheduled=[(s.request.request_id, s.num_new_tokens) for s in sched.scheduled],
            num_spec_tokens=num_spec, acceptance_lengths=lengths)
        self.step_stats.append(stats)
        if self.tracer is not None:
            self._trace(sched, sampled, times, stats, self.tracer)

    def timed_out(self, request: Request, phase: str, now: float) -> None:
        """A request the scheduler timed out in ``phase``: counted, and its sequences' ends
        traced."""
        self.counters.timeouts_by_phase[phase] += 1
        self.ended(request, RequestStatus.FINISHED_TIMEOUT, now)

    def ended(self, request: Request, status: RequestStatus, now: float | None = None) -> None:
        """The sequences of ``request`` that an abort or a timeout just ended (those now in
        ``status``, not those done before), traced with their arrival if they never ran (so
        that their wait is drawn). ``now``: the end's time (default the clock's)."""
        if self.tracer is None:
            return
        t = self.clock() if now is None else now
        for seq in request.group.seqs if request.group is not None else [request]:
            if seq.status == status:
                m = seq.metrics
                self.tracer.finish(seq.request_id, status.finish_reason or "", t,
                                   m.arrival_time if m.first_scheduled_time is None else None)

    def _trace(self, sched: SchedulerOutput, sampled: SampledTokens, times: StepTimes,
               stats: StepStats, tracer: StepTracer) -> None:
        """The step's record in the timeline: each chunk (with the arrival of a request
        scheduled for the first time), the preemptions and transfers, the sequences that
        ended (a forked member may end on the token it took from its leader's row), and the
        state after it (from the step's ``stats``)."""
        entries: list[Entry] = []
        emitted = ({r.request_id: len(t) for r, t in zip(sampled.requests, sampled.token_ids,
                                                         strict=True)}
                   if sched.num_spec_tokens else {})
        for s in sched.scheduled:
            r = s.request
            m = r.metrics
            if s.is_decode:
                k = s.num_spec_tokens
                entries.append(Entry(seq_id=r.request_id, kind="decode", num_tokens=1 + k,
                                     arrival=None, sampled=True, drafts=k,
                                     accepted=emitted.get(r.request_id, 1) - 1 if k else 0))
                continue
            first = m.first_scheduled_time is not None and m.first_scheduled_time >= times.start
            entries.append(Entry(seq_id=r.request_id,
                                 kind="recompute" if m.num_preemptions else "prefill",
                                 num_tokens=s.num_new_tokens,
                                 arrival=m.arrival_time if first else None, sampled=s.sample))
        # A sequence ends only on a token it sampled (aborts and timeouts are traced apart).
        finished = [Finish(seq_id=r.request_id, reason=r.status.finish_reason or "",
                           time=times.end, arrival=None)
                    for r in sampled.requests if r.is_finished]
        transfers = {f"{kind}_blocks": sum(len(p) for k, p in sched.transfers if k == kind)
                     for kind in TRANSFER_KINDS}
        tracer.record(StepRecord(
            index=self.counters.steps, times=times, entries=entries,
            preempted=[r.request_id for r in sched.preempted], transfers=transfers,
            kv_usage=stats.kv_usage, kv_blocks_used=stats.kv_blocks_used,
            running=stats.num_running, waiting=stats.num_waiting, finished=finished))
