"""A simulated cluster's parts: its shape (colocated replicas, or disaggregated prefill and
decode instances with the link KV moves over), its instances, and where a request went.

Every instance *is* :class:`~kvflow.orchestrator.engine.LLMEngine` over a
:class:`~kvflow.sim.runner.SimRunner` (the real scheduler, KV manager and prefix cache), on a
clock of its own. The loop that drives them is :func:`kvflow.sim.simulator.simulate_cluster`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.kv_manager.block_pool import BlockPool
from kvflow.observability.metrics import EngineMetrics, MetricsRegistry
from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.outputs import RequestOutput
from kvflow.orchestrator.speculative.proposers import Proposer
from kvflow.sim.cost_model import CostModel
from kvflow.sim.router import make_router
from kvflow.sim.runner import SIM_EOS, SimClock, SimRunner, sim_engine_config

ALL_STEPS = 10_000_000  # an engine's stats window that keeps every step of a run


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
    """One engine of the cluster on a clock of its own, the metrics its server would publish,
    and what the router knows of it."""

    def __init__(self, index: int, role: str, cost: CostModel, options: EngineOptions,
                 num_blocks: int, block_size: int, keep_steps: bool = False,
                 proposer: Proposer | None = None) -> None:
        self.index, self.role = index, role
        self.clock = SimClock()
        runner = SimRunner(sim_engine_config(block_size, options.max_model_len,
                                             options.max_num_batched_tokens,
                                             options.max_num_seqs), num_blocks, cost, self.clock)
        # keep_steps: every step's stats, for a report that reads its batches. Otherwise the
        # last alone: millions of kept objects slow the garbage collector down by half.
        self.engine = LLMEngine(runner, None, options, (SIM_EOS,), clock=self.clock,
                                stats_window=ALL_STEPS if keep_steps else 1,
                                trace_source="simulator", proposer=proposer)
        self.metrics = MetricsRegistry()  # what its metrics endpoint would show
        self._collector = EngineMetrics()
        self.step_pending = False  # a step-end event of this instance is on the heap
        self.outstanding_tokens = 0  # prompt + output of the requests charged to it
        self._charged: dict[int, int] = {}
        self.num_requests = 0
        self.prompt_tokens = 0
        self.link_free_s = 0.0  # when its link port (out of prefill, into decode) is free

    @property
    def block_pool(self) -> BlockPool:
        return self.engine.kv.pool

    def step(self) -> list[RequestOutput]:
        """One engine step (nothing when it can schedule nothing), observed into its metrics'
        histograms."""
        outputs = self.engine.step()
        self.metrics.observe(self._collector.observations(self.engine, outputs))
        return outputs

    def finish(self) -> None:
        """Bring its metrics' gauges and counters up to date (after its last step)."""
        self.metrics.apply(self._collector.collect(self.engine, []))

    def server_row(self, now: float) -> dict[str, float]:
        """Its server's state now: every ``kvflow_*`` series, named as the served engine's
        metrics endpoint names it (histograms by ``_sum`` and ``_count``), and its last
        step's batch (``batch_tokens``, ``batch_seqs``)."""
        self.metrics.set_state(*self._collector.state(self.engine))  # read when sampled
        last = self.engine.step_stats[-1] if self.engine.step_stats else None
        return {"t_s": now, **self.metrics.row(),
                "batch_tokens": float(last.num_prefill_tokens + last.num_decode_tokens
                                      if last else 0),
                "batch_seqs": float(last.num_scheduled_seqs if last else 0)}

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
