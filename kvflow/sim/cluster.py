"""A cluster of engines in simulated time: replicas behind a router, or disaggregated prefill
and decode instances with the KV moved between them over a link.

Every instance *is* :class:`~kvflow.orchestrator.engine.LLMEngine` over a
:class:`~kvflow.sim.simulator.SimRunner` (the real scheduler, KV manager and prefix cache),
each on a clock of its own. One event heap orders the cluster, by (time, kind, id): a
request's arrival, a KV transfer's completion, an instance's step end. Arrivals and transfers
due at a time are handed over before the instances due then step, as one engine's loop
drains its inbox between steps. An instance runs its step when the step starts (so its
state, the prefix cache the router reads included, is the step's end state from then on);
the step's cost moves its clock, and its next step is an event at that time. An instance
with nothing to run sleeps until a request is handed to it. No wall-clock sleeps.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvflow.bench.metrics import RequestTiming
from kvflow.bench.workloads import RequestSpec
from kvflow.kv_manager.block_pool import BlockPool
from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.outputs import RequestOutput
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.sim.cost_model import CostModel
from kvflow.sim.router import make_router
from kvflow.sim.simulator import (
    SIM_EOS,
    SimClock,
    SimRunner,
    _prompt_ids,
    sim_engine_config,
    timing_of,
)


@dataclass(frozen=True)
class Link:
    """The link KV moves over between a prefill and a decode instance: per-device bandwidth
    (each device sends its own share of the KV, in parallel) and a fixed cost per transfer."""

    name: str
    bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {self.bytes_per_s}")
        if not self.latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")

    def transfer_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


# Per device and direction. The latencies are assumed per-transfer costs (launch, RDMA
# setup), not measurements; at these bandwidths a prompt's megabytes dominate them.
LINKS = {
    "nvlink": Link("NVLink 4 (H100 SXM), 450 GB/s", 450e9, 10e-6),
    "infiniband": Link("InfiniBand NDR, 400 Gb/s = 50 GB/s", 50e9, 20e-6),
    "pcie": Link("PCIe Gen5 x16, ~50 GB/s effective (64 theoretical)", 50e9, 15e-6),
    "ethernet": Link("25 Gb Ethernet, 3.1 GB/s", 3.125e9, 50e-6),
}


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster's shape: ``replicas`` colocated instances, or (``prefill`` and ``decode``
    both >= 1) that many disaggregated instances; the router and its overlap weight; and for
    disaggregation the link and the KV bytes per token each device sends
    (``kv_bytes_per_token_per_device``)."""

    replicas: int = 1
    prefill: int = 0
    decode: int = 0
    router: str = "round_robin"
    overlap_weight: float = 1.0
    link: Link = LINKS["nvlink"]
    kv_bytes_per_token_per_device: float = 0.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if (self.prefill > 0) != (self.decode > 0) or self.prefill < 0 or self.decode < 0:
            raise ValueError(f"prefill and decode must both be >= 1 (disaggregated) or both "
                             f"0, got {self.prefill}:{self.decode}")
        if self.disaggregated and self.replicas != 1:
            raise ValueError("replicas must be 1 when disaggregated (the instances are "
                             f"prefill + decode), got {self.replicas}")
        if self.disaggregated and not self.kv_bytes_per_token_per_device > 0:
            raise ValueError("kv_bytes_per_token_per_device must be > 0 when disaggregated")
        make_router(self.router, 16, self.overlap_weight)  # validates the name and the weight

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    @property
    def roles(self) -> list[str]:
        if self.disaggregated:
            return ["prefill"] * self.prefill + ["decode"] * self.decode
        return ["replica"] * self.replicas


class Instance:
    """One engine of the cluster on a clock of its own, and what the router knows of it."""

    def __init__(self, index: int, role: str, cost: CostModel, options: EngineOptions,
                 num_blocks: int, block_size: int) -> None:
        self.index, self.role = index, role
        self.clock = SimClock()
        runner = SimRunner(sim_engine_config(block_size, options.max_model_len,
                                             options.max_num_batched_tokens,
                                             options.max_num_seqs), num_blocks, cost, self.clock)
        self.engine = LLMEngine(runner, None, options, (SIM_EOS,), clock=self.clock,
                                stats_window=1, trace_source="simulator")
        self.step_pending = False  # a step-end event of this instance is on the heap
        self.outstanding_tokens = 0  # prompt + output of the requests charged to it
        self._charged: dict[int, int] = {}
        self.num_requests = 0
        self.prompt_tokens = 0
        self.link_free_s = 0.0  # when its link port (out of prefill, into decode) is free

    @property
    def block_pool(self) -> BlockPool:
        return self.engine.kv.pool

    def charge(self, request: int, tokens: int) -> None:
        """Count ``tokens`` of request ``request`` as its outstanding work (once)."""
        if request not in self._charged:
            self._charged[request] = tokens
            self.outstanding_tokens += tokens

    def release(self, request: int) -> None:
        self.outstanding_tokens -= self._charged.pop(request, 0)

    def stats(self, duration_s: float) -> dict[str, float | int | str | None]:
        """What it served: requests, tokens, busy fraction, prefix-cache hit rate."""
        c, s = self.engine.counters, self.engine.scheduler
        return {"instance": self.index, "role": self.role, "requests": self.num_requests,
                "prompt_tokens": self.prompt_tokens, "prefill_tokens": c.prompt_tokens,
                "output_tokens": c.generation_tokens, "steps": c.steps,
                "busy_s": c.step_time_s,
                "busy_fraction": c.step_time_s / duration_s if duration_s > 0 else 0.0,
                "preemptions": c.preemptions, "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits,
                "hit_rate": (s.prefix_cache_hits / s.prefix_cache_queries
                             if s.prefix_cache_queries else None)}


@dataclass
class RequestRoute:
    """Where one request went: its replica (or prefill instance), its decode instance, and
    its KV transfer (seconds waiting for the link, seconds on it)."""

    instance: int | None = None
    decode_instance: int | None = None
    transfer_wait_s: float | None = None
    transfer_s: float | None = None
    cached_tokens: int = 0


@dataclass
class ClusterResult:
    """Per-request timings (first token included, as a client sees them) and routes, each
    instance's statistics, the sampled cluster series and the simulated duration."""

    timings: list[RequestTiming]
    routes: list[RequestRoute]
    instances: list[dict[str, float | int | str | None]]
    series: list[dict[str, float]]
    duration_s: float
    steps: int = field(default=0)


ARRIVAL, TRANSFER, STEP = 0, 1, 2  # event kinds, in the order they go at one time


def simulate_cluster(specs: Sequence[RequestSpec], cost: CostModel, options: EngineOptions,
                     num_blocks: int, cluster: ClusterSpec, block_size: int = 16,
                     prompts: Sequence[list[int]] | None = None,
                     series_period_s: float = 0.25,
                     progress: Callable[[int], None] | None = None) -> ClusterResult:
    """Run ``specs`` through a cluster of real engines in simulated time (module docstring).

    ``num_blocks``: each instance's KV pool. ``prompts``: each request's token ids (default:
    ids no two requests share, except a declared shared prefix). ``progress(n)`` is called
    with the number of requests finished so far.
    """
    if prompts is not None and len(prompts) != len(specs):
        raise ValueError(f"got {len(prompts)} prompts for {len(specs)} requests")
    if not series_period_s > 0:
        raise ValueError(f"series_period_s must be > 0, got {series_period_s}")
    instances = [Instance(k, role, cost, options, num_blocks, block_size)
                 for k, role in enumerate(cluster.roles)]
    entry = [x for x in instances if x.role != "decode"]
    decoders = [x for x in instances if x.role == "decode"]
    router = make_router(cluster.router, block_size, cluster.overlap_weight)
    decode_router = make_router("least_loaded", block_size)
    ids = [list(prompts[i]) if prompts is not None else _prompt_ids(s, i)
           for i, s in enumerate(specs)]
    routes = [RequestRoute() for _ in specs]
    first: dict[int, RequestOutput] = {}  # prefilled, decoding elsewhere: the prefill's output
    timings: dict[int, RequestTiming] = {}
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
                                           kv_transferred=kv_transferred)
        if rejected is not None:
            done(x, i, rejected)
        else:
            wake(x, t)

    def done(x: Instance, i: int, out: RequestOutput) -> None:
        x.release(i)
        spec = specs[i]
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
            steps = x.engine.counters.steps
            for out in x.engine.step():
                if out.finished:
                    done(x, int(out.request_id), out)
            if x.engine.counters.steps > steps:  # it ran a step: the next starts at its end
                wake(x, x.clock.now)
        if t >= next_sample:
            series.append(_sample(instances, t))
            next_sample = t + series_period_s
    stuck = [x.index for x in instances if x.engine.has_unfinished_requests()]
    if stuck:
        raise RuntimeError(f"simulation stalled: instances {stuck} hold requests that cannot "
                           "be scheduled")
    duration = max((x.clock.now for x in instances), default=0.0)
    series.append(_sample(instances, duration))
    return ClusterResult([timings[i] for i in range(len(specs))], routes,
                         [x.stats(duration) for x in instances], series, duration,
                         sum(x.engine.counters.steps for x in instances))


def _sample(instances: list[Instance], now: float) -> dict[str, float]:
    """One row of cluster state, under the names the server's series use (summed over the
    instances; KV usage averaged), and each instance's KV usage and queue."""
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
