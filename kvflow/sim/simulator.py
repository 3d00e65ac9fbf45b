"""Discrete-event simulation that drives the real scheduler and KV manager in simulated time.

The simulator *is* :class:`kvflow.orchestrator.engine.LLMEngine`: the same scheduler, KV
manager, sampler and bookkeeping, with a :class:`SimRunner` whose step costs what a cost model
says, and a clock that only the simulation advances. Events are arrivals (a heap ordered by
time, then request index) and step ends; between steps the arrivals due are admitted, exactly
as the real engine loop drains its inbox. No wall-clock sleeps anywhere.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvflow.bench.metrics import RequestTiming
from kvflow.bench.workloads import RequestSpec
from kvflow.build.engine_config import BuildLimits, EngineConfig
from kvflow.model.config import ModelConfig
from kvflow.observability.metrics import EngineMetrics, MetricsRegistry
from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.outputs import RequestOutput, StepStats
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.runtime.base import ModelRunner, StepInput
from kvflow.sim.cost_model import CostModel, StepShape

SIM_VOCAB = 8  # the simulated model's logits: small, since no token is ever read
SIM_EOS = SIM_VOCAB - 1
SIM_TOKEN = 0  # the token the simulated model always samples (greedy over its logits)


class SimClock:
    """Simulated seconds; only the simulation moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimRunner(ModelRunner):
    """Costs each step by the cost model, advances the clock, returns logits favouring
    :data:`SIM_TOKEN`."""

    name = "sim"
    reads_token_ids = False
    needs_inputs = False  # the cost model reads the step's shape alone

    def __init__(self, engine: EngineConfig, num_blocks: int, cost: CostModel,
                 clock: SimClock) -> None:
        super().__init__(engine, num_blocks)
        self.cost, self.clock = cost, clock
        self._logits = np.zeros((1, SIM_VOCAB), dtype=np.float32)
        self._logits[:, SIM_TOKEN] = 1.0

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Nothing to copy: the simulated pool holds no data (a copy's time is not modelled)."""

    def execute(self, step: StepInput) -> np.ndarray:
        self.clock.now += self.cost.step_time_s(StepShape.of(step))
        return np.repeat(self._logits, len(step.logits_indices), axis=0)

    def execute_argmax(self, step: StepInput) -> np.ndarray:
        """The argmax of :meth:`execute`'s logits, without building them."""
        self.clock.now += self.cost.step_time_s(StepShape.of(step))
        return np.full(len(step.logits_indices), SIM_TOKEN, dtype=np.int64)


def sim_engine_config(block_size: int, max_model_len: int, max_num_tokens: int,
                      max_batch_size: int) -> EngineConfig:
    """An engine config for a model the simulator never runs (only its KV layout matters)."""
    model = ModelConfig(architecture="llama", vocab_size=SIM_VOCAB, hidden_size=8,
                        intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                        num_key_value_heads=1, head_dim=8, eos_token_ids=(SIM_EOS,))
    limits = BuildLimits(max_model_len, max(max_num_tokens, block_size), max_batch_size,
                         block_size)
    return EngineConfig(model, "torch", "float32", limits, {"name": "simulated"}, {})


@dataclass
class SimResult:
    """Per-request timings and queue times (on the simulated clock), the engine's per-step
    stats, the sampled server series and the server's metrics at the end."""

    timings: list[RequestTiming]
    queue_s: list[float | None]
    steps: list[StepStats]
    series: list[dict[str, float]]
    duration_s: float
    metrics: MetricsRegistry

    @property
    def batches(self) -> list[list[tuple[str, int]]]:
        """Each step's batch: (request id, tokens computed) per sequence, as scheduled."""
        return [s.scheduled for s in self.steps]


def _sample_series(engine: LLMEngine, registry: MetricsRegistry, now: float) -> dict[str, float]:
    """One row of server state: every ``kvflow_*`` series, named as the server's metrics
    endpoint names it (histograms by ``_sum`` and ``_count``), and the last step's batch."""
    last = engine.step_stats[-1] if engine.step_stats else None
    return {"t_s": now, **registry.row(),
            "batch_tokens": float(last.num_prefill_tokens + last.num_decode_tokens
                                  if last else 0),
            "batch_seqs": float(last.num_scheduled_seqs if last else 0)}


def simulate(specs: Sequence[RequestSpec], cost: CostModel, sched: EngineOptions,
             num_blocks: int, block_size: int = 16,
             prompts: Sequence[list[int]] | None = None,
             series_period_s: float = 0.25,
             progress: Callable[[int], None] | None = None,
             priorities: Sequence[int] | None = None) -> SimResult:
    """Run ``specs`` through the real scheduler in simulated time.

    ``prompts`` gives each request's token ids (default: ids no two requests share, except
    a declared shared prefix), so that prefix caching sees what a real run would.
    ``series_period_s``: simulated seconds between two samples of the server series.
    ``progress(n)`` is called with the number of requests finished so far as they finish.
    ``priorities``: each request's priority (lower first) for the ``priority`` policy
    (default: each spec's own, else 0). Each spec's ``tenant`` is its request's.
    """
    for name, values in (("prompts", prompts), ("priorities", priorities)):
        if values is not None and len(values) != len(specs):
            raise ValueError(f"got {len(values)} {name} for {len(specs)} requests")
    if not series_period_s > 0:
        raise ValueError(f"series_period_s must be > 0, got {series_period_s}")
    clock = SimClock()
    engine_cfg = sim_engine_config(block_size, sched.max_model_len,
                                   sched.max_num_batched_tokens, sched.max_num_seqs)
    runner = SimRunner(engine_cfg, num_blocks, cost, clock)
    engine = LLMEngine(runner, None, sched, (SIM_EOS,), clock=clock,
                       stats_window=10_000_000, trace_source="simulator")
    arrivals = [(s.arrival_s, i) for i, s in enumerate(specs)]
    heapq.heapify(arrivals)
    finished: dict[int, RequestTiming] = {}
    queue_s: list[float | None] = [None] * len(specs)
    series: list[dict[str, float]] = []
    collector, registry = EngineMetrics(), MetricsRegistry()
    next_sample = 0.0
    while arrivals or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            clock.now = max(clock.now, arrivals[0][0])  # idle: jump to the next arrival
        while arrivals and arrivals[0][0] <= clock.now:
            t, i = heapq.heappop(arrivals)
            spec = specs[i]
            prompt = _prompt_ids(spec, i) if prompts is None else prompts[i]
            priority = (priorities[i] if priorities is not None
                        else spec.priority if spec.priority is not None else 0)
            request, rejected = engine.add_request(
                prompt, SamplingParams(max_tokens=spec.output_tokens, temperature=0.0,
                                       ignore_eos=True),
                request_id=str(i), arrival_time=t, priority=priority, tenant=spec.tenant)
            if rejected is not None:
                finished[i] = RequestTiming(t, [], spec.prompt_tokens, 0, ok=False)
        before = (clock.now, len(engine.step_stats))
        outputs = engine.step()
        registry.observe(collector.observations(engine, outputs))
        if (clock.now, len(engine.step_stats)) == before:  # nothing could be scheduled
            if not arrivals:
                raise RuntimeError("simulation stalled: requests wait, nothing can be scheduled")
            clock.now = max(clock.now, arrivals[0][0])
        if clock.now >= next_sample:  # the gauges and counters: read when sampled
            registry.set_state(*collector.state(engine))
            series.append(_sample_series(engine, registry, clock.now))
            next_sample = clock.now + series_period_s
        for out in outputs:
            if out.finished:
                i = int(out.request_id)
                finished[i] = timing_of(out)
                queue_s[i] = out.metrics.queue_time_s
                if progress is not None:
                    progress(len(finished))
    registry.apply(collector.collect(engine, []))
    series.append(_sample_series(engine, registry, clock.now))
    engine.write_trace()  # with sched.trace_steps: the step timeline, on the simulated clock
    timings = [finished[i] for i in range(len(specs))]
    return SimResult(timings, queue_s, list(engine.step_stats), series, clock.now, registry)


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
