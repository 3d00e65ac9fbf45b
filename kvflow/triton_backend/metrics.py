"""Prometheus metrics through the Python backend's custom metrics API (``kvflow_*`` families).

Updated on the engine loop thread after every step, from the engine's outputs, counters and
scheduler state. Triton serves them on its metrics port.
"""

from __future__ import annotations

from typing import Any

from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.outputs import RequestOutput

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
# counter name -> the LLMEngine.counters key it mirrors (None: not yet produced by the engine)
COUNTERS = {
    "kvflow_prompt_tokens_total": ("Prefill tokens computed", "prompt_tokens"),
    "kvflow_generation_tokens_total": ("Output tokens generated", "generation_tokens"),
    "kvflow_num_preemptions_total": ("Requests preempted", "preemptions"),
    "kvflow_request_rejected_total": ("Requests rejected by admission control", "rejected"),
    "kvflow_request_success_total": ("Requests finished", "finished"),
    "kvflow_prefix_cache_queries_total": ("Prompt tokens looked up in the prefix cache",
                                          "prefix_cache_queries"),
    "kvflow_prefix_cache_hits_total": ("Prompt tokens found in the prefix cache",
                                       "prefix_cache_hits"),
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
        self._last_counts: dict[str, int] = {}
        self._families_alive = True

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        if not self._families_alive:
            return
        h = self.histograms
        if engine.step_stats:
            h["kvflow_iteration_num_seqs"].observe(engine.step_stats[-1].num_scheduled_seqs)
        for out in outputs:
            m = out.metrics
            times = m.token_times
            if out.delta_token_ids:
                if len(times) == 1 and m.ttft_s is not None:
                    h["kvflow_time_to_first_token_seconds"].observe(m.ttft_s)
                    if m.queue_time_s is not None:
                        h["kvflow_request_queue_time_seconds"].observe(m.queue_time_s)
                elif len(times) >= 2:
                    h["kvflow_inter_token_latency_seconds"].observe(times[-1] - times[-2])
            if out.finished and out.finish_reason != "rejected" and m.e2e_s is not None:
                h["kvflow_e2e_request_latency_seconds"].observe(m.e2e_s)
        self.refresh(engine)

    def refresh(self, engine: LLMEngine) -> None:
        """Gauges and counters from the engine's current state (also called when idle)."""
        sched = engine.scheduler
        self.gauges["kvflow_num_requests_running"].set(sched.num_running)
        self.gauges["kvflow_num_requests_waiting"].set(sched.num_waiting)
        self.gauges["kvflow_kv_cache_usage_ratio"].set(engine.kv.usage)
        for name, (_, key) in COUNTERS.items():
            value = engine.counters.get(key, 0)
            delta = value - self._last_counts.get(name, 0)
            if delta > 0:
                self.counters[name].increment(delta)
                self._last_counts[name] = value

    def close(self) -> None:
        self._families_alive = False
        self.histograms, self.gauges, self.counters = {}, {}, {}
        self.families = {}
