"""Prometheus metrics through the Python backend's custom metrics API (``kvflow_*`` families).

After every step the engine loop thread takes a snapshot (plain numbers: observations, gauge
values, counter totals) and queues it; a dedicated metrics thread makes the backend calls, as
Triton's vLLM backend does. The engine loop never waits on the metrics API, whose calls go
through the stub's IPC to the Triton process. Triton serves the metrics on its metrics port.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any

from kvflow.orchestrator.async_engine import EngineLoop
from kvflow.orchestrator.outputs import REJECT_CAUSES, TIMEOUT_PHASES, RequestOutput

LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]

HISTOGRAMS = {
    "kvflow_time_to_first_token_seconds": ("Time to first token", LATENCY_BUCKETS),
    "kvflow_inter_token_latency_seconds": ("Time between consecutive output tokens",
                                           LATENCY_BUCKETS),
    "kvflow_e2e_request_latency_seconds": ("Arrival to last token", LATENCY_BUCKETS),
    "kvflow_request_queue_time_seconds": ("Arrival to first scheduled", LATENCY_BUCKETS),
    "kvflow_iteration_num_seqs": ("Sequences in each engine step (the running batch)",
                                  BATCH_BUCKETS),
}
GAUGES = {
    "kvflow_num_requests_running": "Requests holding KV and scheduled",
    "kvflow_num_requests_waiting": "Requests waiting or preempted",
    "kvflow_kv_cache_usage_ratio": "Fraction of KV blocks in use",
}
# counter name -> the EngineCounters field it mirrors (serving_time_s: the EngineLoop's)
COUNTERS = {
    "kvflow_prompt_tokens_total": ("Prefill tokens computed", "prompt_tokens"),
    "kvflow_generation_tokens_total": ("Output tokens generated", "generation_tokens"),
    "kvflow_num_preemptions_total": ("Requests preempted", "preemptions"),
    "kvflow_request_success_total": ("Requests finished", "finished"),
    "kvflow_prefix_cache_queries_total": ("Prompt tokens looked up in the prefix cache",
                                          "prefix_cache_queries"),
    "kvflow_prefix_cache_hits_total": ("Prompt tokens found in the prefix cache",
                                       "prefix_cache_hits"),
    "kvflow_engine_steps_total": ("Engine steps run", "steps"),
    "kvflow_engine_step_seconds_total": ("Engine-thread seconds inside engine steps",
                                         "step_time_s"),
    "kvflow_serving_seconds_total": ("Engine-thread seconds serving around the steps: "
                                     "cancellation checks, metrics snapshots, handing outputs "
                                     "to the response senders", "serving_time_s"),
}
# counter name -> (help, the EngineCounters dict it mirrors, its label, the label's values)
LABELED_COUNTERS = {
    "kvflow_request_rejected_total": ("Requests rejected by admission control, by cause: bad "
                                      "input, a full queue, or a predicted wait over "
                                      "max_queue_delay_ms", "rejected_by_cause", "reason",
                                      REJECT_CAUSES),
    "kvflow_request_timeout_total": ("Requests ended past their deadline, by the phase they "
                                     "were in", "timeouts_by_phase", "phase", TIMEOUT_PHASES),
}


class TritonMetrics:
    """The metric families, and the code that feeds them after each step."""

    def __init__(self, pb_utils: Any, model_name: str) -> None:
        labels = {"model": model_name}
        kinds = pb_utils.MetricFamily
        # NOTE: a family must outlive its metrics (the backend refuses to observe otherwise),
        # so the families are kept here, and dropped after the metrics in close().
        self.families: dict[str, Any] = {}

        def family(name: str, desc: str, kind: Any) -> Any:
            self.families[name] = pb_utils.MetricFamily(name=name, description=desc, kind=kind)
            return self.families[name]

        self.histograms = {
            name: family(name, desc, kinds.HISTOGRAM).Metric(labels=labels, buckets=buckets)
            for name, (desc, buckets) in HISTOGRAMS.items()
        }
        self.gauges = {name: family(name, desc, kinds.GAUGE).Metric(labels=labels)
                       for name, desc in GAUGES.items()}
        self.counters = {name: family(name, desc, kinds.COUNTER).Metric(labels=labels)
                         for name, (desc, _) in COUNTERS.items()}
        for name, (desc, _, label, values) in LABELED_COUNTERS.items():
            fam = family(name, desc, kinds.COUNTER)
            for value in values:  # every series exists from the start, at 0
                self.counters[f"{name}|{value}"] = fam.Metric(labels={**labels, label: value})
        self._last_counts: dict[str, int] = {}
        self._last_gauges: dict[str, float] = {}
        self._queue: queue.SimpleQueue[_Snapshot | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._publish_loop, name="kvflow-metrics",
                                        daemon=True)
        self._thread.start()

    def on_step(self, loop: EngineLoop, outputs: list[RequestOutput]) -> None:
        """Snapshot this step's numbers (the loop's step hook, on its thread; no backend calls
        here)."""
        engine = loop.engine
        observations: list[tuple[str, float]] = []
        if outputs and engine.step_stats:
            observations.append(("kvflow_iteration_num_seqs",
                                 engine.step_stats[-1].num_scheduled_seqs))
        for out in outputs:
            m = out.metrics
            times = m.token_times
            if out.delta_token_ids:
                if len(times) == 1 and m.ttft_s is not None:
                    observations.append(("kvflow_time_to_first_token_seconds", m.ttft_s))
                    if m.queue_time_s is not None:
                        observations.append(("kvflow_request_queue_time_seconds",
                                             m.queue_time_s))
                elif len(times) >= 2:
                    observations.append(("kvflow_inter_token_latency_seconds",
                                         times[-1] - times[-2]))
            if out.finished and out.finish_reason != "rejected" and m.e2e_s is not None:
                observations.append(("kvflow_e2e_request_latency_seconds", m.e2e_s))
        sched = engine.scheduler
        gauges = {"kvflow_num_requests_running": sched.num_running,
                  "kvflow_num_requests_waiting": sched.num_waiting,
                  "kvflow_kv_cache_usage_ratio": engine.kv.usage}
        totals = {name: (loop.serving_time_s if key == "serving_time_s"
                         else getattr(engine.counters, key)) for name, (_, key) in COUNTERS.items()}
        for name, (_, key, _, values) in LABELED_COUNTERS.items():
            counts = getattr(engine.counters, key)
            totals.update({f"{name}|{v}": counts.get(v, 0) for v in values})
        self._queue.put(_Snapshot(observations, gauges, totals))

    def _publish_loop(self) -> None:
        while True:
            snap = self._queue.get()
            if snap is None:
                return
            with contextlib.suppress(Exception):  # metrics never take the server down
                self._publish(snap)
            if snap.done is not None:
                snap.done.set()

    def _publish(self, snap: _Snapshot) -> None:
        for name, value in snap.observations:
            self.histograms[name].observe(value)
        for name, value in snap.gauges.items():
            if self._last_gauges.get(name) != value:
                self.gauges[name].set(value)
                self._last_gauges[name] = value
        for name, value in snap.totals.items():
            delta = value - self._last_counts.get(name, 0)
            if delta > 0:
                self.counters[name].increment(delta)
                self._last_counts[name] = value

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until every queued snapshot is published (tests, shutdown)."""
        done = threading.Event()
        self._queue.put(_Snapshot([], {}, {}, done))
        done.wait(timeout_s)

    def close(self) -> None:
        """Stop the metrics thread; the families go after their metrics (the backend's rule)."""
        self._queue.put(None)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self.histograms, self.gauges, self.counters = {}, {}, {}
            self.families = {}


class _Snapshot:
    __slots__ = ("observations", "gauges", "totals", "done")

    def __init__(self, observations: list[tuple[str, float]], gauges: dict[str, float],
                 totals: dict[str, int], done: threading.Event | None = None) -> None:
        self.observations = observations
        self.gauges = gauges
        self.totals = totals
        self.done = done
