"""The simulator's one loop: a cluster of real engines in simulated time. The plain simulation
(:func:`simulate`) is a cluster of one replica.

Every instance *is* :class:`~kvflow.orchestrator.engine.LLMEngine` over a
:class:`~kvflow.sim.runner.SimRunner` (the real scheduler, KV manager, sampler and
bookkeeping), each on a clock of its own. One event heap orders the cluster, by (time, kind,
id): a request's arrival, a KV transfer's completion, an instance's step end. Arrivals and
transfers due at a time are handed over before the instances due then step, as one engine's
loop drains its inbox between steps. An instance runs its step when the step starts (so its
state, the prefix cache the router reads included, is the step's end state from then on); the
step's cost moves its clock, and its next step is an event at that time. An instance with
nothing to run sleeps until a request is handed to it. No wall-clock sleeps anywhere.

Each request reaches its instance's scheduler with its priority and tenant, as a served one
does. The series is sampled when an event's time passes the next sample time, before the
events of that time are handled: the state as of just before it.

Disaggregated (``P:D``): a request is prefilled on a prefill instance with ``max_tokens=1``,
whose token is the first token (as DistServe counts it). Its decode instance is picked then;
its prompt's KV (``prompt tokens x KV bytes per token``, split over the devices of the
instance) moves over the link, one transfer at a time out of each prefill instance and into
each decode instance (first come, first served), taking the link's latency plus bytes over
bandwidth. Then the decode instance gets the request with ``kv_transferred`` (its blocks are
allocated on admission; while its pool lacks room it waits) and decodes the rest. The
prefill instance frees the blocks when its token is out: holding them for the transfer is
not modelled.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvflow.observability.metrics import MetricsRegistry
from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.outputs import EngineCounters, RequestOutput, StepStats
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.orchestrator.speculative.proposers import Proposer
from kvflow.reports.summary import RequestTiming
from kvflow.sim.cluster import ClusterSpec, Instance, RequestRoute
from kvflow.sim.cost_model import CostModel
from kvflow.sim.router import make_router
from kvflow.workloads.specs import RequestSpec


@dataclass
class ClusterResult:
    """Per-request timings (first token included, as a client sees them), queue times (at
    the instance a request entered) and routes; each instance's statistics, steps (every
    one with ``keep_steps``, else none), engine counters and server metrics at the end; the
    sampled series and the simulated duration."""

    timings: list[RequestTiming]
    routes: list[RequestRoute]
    instances: list[dict[str, float | int | str | None]]
    series: list[dict[str, float]]
    duration_s: float
    steps: int
    queue_s: list[float | None]
    instance_steps: list[list[StepStats]]
    counters: list[EngineCounters]
    metrics: list[MetricsRegistry]


ARRIVAL, TRANSFER, STEP = 0, 1, 2  # event kinds, in the order they go at one time


def simulate_cluster(specs: Sequence[RequestSpec], cost: CostModel, options: EngineOptions,
                     num_blocks: int, cluster: ClusterSpec, block_size: int = 16,
                     prompts: Sequence[list[int]] | None = None,
                     series_period_s: float = 0.25,
                     progress: Callable[[int], None] | None = None,
                     priorities: Sequence[int] | None = None,
                     on_step: Callable[[int, LLMEngine], None] | None = None,
                     keep_steps: bool = False,
                     proposer: Callable[[], Proposer] | None = None) -> ClusterResult:
    """Run ``specs`` through a cluster of real engines in simulated time (module docstring).

    ``num_blocks``: each instance's KV pool. ``prompts``: each request's token ids (default:
    ids no two requests share, except a declared shared prefix), so that prefix caching sees
    what a real run would. ``series_period_s``: simulated seconds between two samples of the
    series. ``progress(n)`` is called with the number of requests finished so far.
    ``priorities``: each request's priority (lower first) for the ``priority`` policy
    (default: each spec's own, else 0); each spec's ``tenant`` is its request's.
    ``on_step(k, engine)`` is called just before each step of instance ``k``: a read-only
    view of what its scheduler holds (``engine.scheduler.requests``), for tests and tools.
    ``keep_steps``: keep every step's :class:`StepStats` for the result. ``proposer``:
    speculative decoding, each instance drafting with a proposer it makes (the simulated one,
    :mod:`kvflow.sim.speculation`).
    """
    for name, values in (("prompts", prompts), ("priorities", priorities)):
        if values is not None and len(values) != len(specs):
            raise ValueError(f"got {len(values)} {name} for {len(specs)} requests")
    if not series_period_s > 0:
        raise ValueError(f"series_period_s must be > 0, got {series_period_s}")
    if options.trace_steps and len(cluster.roles) > 1:
        raise ValueError("trace_steps: one step timeline per engine; a cluster has several")
    instances = [Instance(k, role, cost, options, num_blocks, block_size, keep_steps,
                          proposer() if proposer is not None else None)
                 for k, role in enumerate(cluster.roles)]
    entry = [x for x in instances if x.role != "decode"]
    decoders = [x for x in instances if x.role == "decode"]
    router = make_router(cluster.router, block_size, cluster.overlap_weight)
    decode_router = make_router("least_loaded", block_size)
    ids = [list(prompts[i]) if prompts is not None else _prompt_ids(s, i)
           for i, s in enumerate(specs)]
    priority = [priorities[i] if priorities is not None
                else s.priority if s.priority is not None else 0 for i, s in enumerate(specs)]
    routes = [RequestRoute() for _ in specs]
    first: dict[int, RequestOutput] = {}  # prefilled, decoding elsewhere: the prefill's output
    timings: dict[int, RequestTiming] = {}
    queue_s: list[float | None] = [None] * len(specs)
    events = [(s.arrival_s, ARRIVAL, i) for i, s in enumerate(specs)]
    heapq.heapify(events)
    series: list[dict[str, float]] = []
    next_sample = 0.0

    def wake(x: Instance, t: float) -> None:
        if not x.step_pending:
            x.clock.now = max(x.clock.now, t)
            x.step_pending = True
            heapq.heappush(events, (x.clock.now, STEP, x.index))

    def submit(x: Instance, i: int, prompt: list[int], max_tokens: int, t: float,
               kv_transferred: bool = False) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        x.charge(i, len(prompt) + max_tokens)
        x.num_requests += 1
        x.prompt_tokens += len(prompt)
        _, rejected = x.engine.add_request(prompt, params, request_id=str(i), arrival_time=t,
                                           priority=priority[i], tenant=specs[i].tenant,
                                           kv_transferred=kv_transferred)
        if rejected is not None:
            done(x, i, rejected)
        else:
            wake(x, t)

    def done(x: Instance, i: int, out: RequestOutput) -> None:
        x.release(i)
        spec = specs[i]
        if x.role != "decode":
            queue_s[i] = out.metrics.queue_time_s
        if x.role == "prefill" and out.finish_reason == "length" and spec.output_tokens > 1:
            first[i] = out
            d = decoders[decode_router.pick(ids[i], decoders)]
            d.charge(i, spec.prompt_tokens + spec.output_tokens)  # from now: in transit
            ready = out.metrics.token_times[0]
            start = max(ready, x.link_free_s, d.link_free_s)
            took = cluster.link.transfer_s(spec.prompt_tokens
                                           * cluster.kv_bytes_per_token_per_device)
            x.link_free_s = d.link_free_s = start + took
            route = routes[i]
            route.decode_instance, route.transfer_wait_s, route.transfer_s = (
                d.index, start - ready, took)
            heapq.heappush(events, (start + took, TRANSFER, i))
            return
        timing = timing_of(out)
        if x.role == "decode":
            pre = first.pop(i)
            timing = RequestTiming(pre.metrics.arrival_time,
                                   [*pre.metrics.token_times, *timing.token_times_s],
                                   spec.prompt_tokens, 1 + timing.output_tokens, timing.ok)
        else:
            routes[i].cached_tokens = out.cached_tokens
        timings[i] = timing
        if progress is not None:
            progress(len(timings))

    while events:
        t, kind, k = heapq.heappop(events)
        if t >= next_sample:
            series.append(_sample(instances, t))
            next_sample = t + series_period_s
        if kind == ARRIVAL:
            x = entry[router.pick(ids[k], entry)]
            routes[k].instance = x.index
            max_tokens = 1 if cluster.disaggregated else specs[k].output_tokens
            submit(x, k, ids[k], max_tokens, t)
        elif kind == TRANSFER:
            d = instances[routes[k].decode_instance]  # type: ignore[index]
            submit(d, k, ids[k] + first[k].outputs[0].token_ids[:1],
                   specs[k].output_tokens - 1, t, kv_transferred=True)
        else:
            x = instances[k]
            x.step_pending = False
            if on_step is not None:
                on_step(x.index, x.engine)
            steps = x.engine.counters.steps
            for out in x.step():
                if out.finished:
                    done(x, int(out.request_id), out)
            if x.engine.counters.steps > steps:  # it ran a step: the next starts at its end
                wake(x, x.clock.now)
    stuck = [x.index for x in instances if x.engine.has_unfinished_requests()]
    if stuck:
        raise RuntimeError(f"simulation stalled: instances {stuck} hold requests that cannot "
                           "be scheduled")
    duration = max((x.clock.now for x in instances), default=0.0)
    for x in instances:
        x.finish()
        x.engine.write_trace()  # with options.trace_steps: the timeline, on simulated time
    series.append(_sample(instances, duration))
    return ClusterResult([timings[i] for i in range(len(specs))], routes,
                         [x.stats(duration) for x in instances], series, duration,
                         sum(x.engine.counters.steps for x in instances), queue_s,
                         [list(x.engine.step_stats) if keep_steps else [] for x in instances],
                         [x.engine.counters.copy() for x in instances],
                         [x.metrics for x in instances])


@dataclass
class SimResult:
    """One engine's run: per-request timings and queue times (on the simulated clock), the
    engine's per-step stats, the sampled server series, and the engine's counters and the
    server's metrics at the end (``counters.preemptions`` is the one count of preemptions:
    summing the steps' misses those of steps that ran nothing)."""

    timings: list[RequestTiming]
    queue_s: list[float | None]
    steps: list[StepStats]
    series: list[dict[str, float]]
    duration_s: float
    counters: EngineCounters
    metrics: MetricsRegistry

    @property
    def batches(self) -> list[list[tuple[str, int]]]:
        """Each step's batch: (request id, tokens computed) per sequence, as scheduled."""
        return [s.scheduled for s in self.steps]


def simulate(specs: Sequence[RequestSpec], cost: CostModel, sched: EngineOptions,
             num_blocks: int, block_size: int = 16,
             prompts: Sequence[list[int]] | None = None,
             series_period_s: float = 0.25,
             progress: Callable[[int], None] | None = None,
             priorities: Sequence[int] | None = None,
             proposer: Callable[[], Proposer] | None = None,
             on_step: Callable[[int, LLMEngine], None] | None = None) -> SimResult:
    """Run ``specs`` through the real scheduler in simulated time: :func:`simulate_cluster`
    with one replica (the arguments are its own), seen as one engine's run."""
    result = simulate_cluster(specs, cost, sched, num_blocks, ClusterSpec(), block_size,
                              prompts, series_period_s, progress, priorities, on_step=on_step,
                              keep_steps=True, proposer=proposer)
    return SimResult(result.timings, result.queue_s, result.instance_steps[0], result.series,
                     result.duration_s, result.counters[0], result.metrics[0])


def _sample(instances: list[Instance], now: float) -> dict[str, float]:
    """One row of the series. One instance: its server's every series (as the served engine's
    metrics endpoint names them) and its last step's batch. Several: the cluster's sums under
    the same names (KV usage averaged), and each instance's KV usage and queue."""
    if len(instances) == 1:
        return instances[0].server_row(now)
    row = {"t_s": now,
           "kvflow_num_requests_running": float(sum(x.engine.scheduler.num_running
                                                    for x in instances)),
           "kvflow_num_requests_waiting": float(sum(x.engine.scheduler.num_waiting
                                                    for x in instances)),
           "kvflow_kv_cache_usage_ratio": sum(x.engine.kv.usage for x in instances)
           / len(instances)}
    for x in instances:
        row[f"kv_usage_{x.index}"] = x.engine.kv.usage
        row[f"waiting_{x.index}"] = float(x.engine.scheduler.num_waiting)
    return row


def timing_of(out: RequestOutput) -> RequestTiming:
    """A finished request's timing, as a client would have measured it on the engine's clock."""
    m = out.metrics
    return RequestTiming(m.arrival_time, list(m.token_times), out.num_prompt_tokens,
                         len(out.token_ids), ok=out.finish_reason in ("length", "stop"))


def run_in_real_time(engine: LLMEngine, arrivals_s: Sequence[float],
                     add: Callable[[int, float], None]) -> tuple[list[RequestOutput], float]:
    """The wall-clock twin of :func:`simulate`: request ``i`` is submitted by
    ``add(i, arrival)`` (``arrival`` on the engine's monotonic clock) once ``arrivals_s[i]``
    seconds (ascending) have passed; the engine steps while it has work and sleeps until the
    next arrival when idle. Returns the finished outputs and the duration."""
    finished: list[RequestOutput] = []
    t0, i, n = time.monotonic(), 0, len(arrivals_s)
    while i < n or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while i < n and arrivals_s[i] <= now:
            add(i, t0 + arrivals_s[i])
            i += 1
        if engine.has_unfinished_requests():
            finished += [out for out in engine.step() if out.finished]
        elif i < n:
            time.sleep(max(0.0, arrivals_s[i] - now))
    return finished, time.monotonic() - t0


def _prompt_ids(spec: RequestSpec, index: int) -> list[int]:
    """Token ids no other request shares, except a declared shared prefix (for the cache)."""
    if spec.prefix_group is None:
        base = 1_000_000 * (index + 1)
        return list(range(base, base + spec.prompt_tokens))
    question = min(16, spec.prompt_tokens - 1)
    prefix = list(range(spec.prefix_group * 1_000_000_000, spec.prefix_group * 1_000_000_000
                        + spec.prompt_tokens - question))
    base = 1_000_000 * (index + 1)
    return prefix + list(range(base, base + question))
