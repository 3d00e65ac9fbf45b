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

from kvflow.observability.metrics import METRICS, EngineMetrics, MetricsUpdate, series_key
from kvflow.orchestrator.engine_loop import EngineLoop
from kvflow.orchestrator.outputs import RequestOutput


class TritonMetrics:
    """The catalogue's families (:data:`kvflow.observability.metrics.METRICS`), and the code that
    feeds them after each step."""

    def __init__(self, pb_utils: Any, model_name: str) -> None:
        kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE,
                 "histogram": pb_utils.MetricFamily.HISTOGRAM}
        # NOTE: a family must outlive its metrics (the backend refuses to observe otherwise),
        # so the families are kept here, and dropped after the metrics in close().
        self.families: dict[str, Any] = {}
        self.metrics: dict[str, Any] = {}  # by series key
        self.model_name = model_name
        for name, m in METRICS.items():
            fam = self.families[name] = pb_utils.MetricFamily(
                name=name, description=m.help, kind=kinds[m.kind])
            if m.dynamic:  # its series come as their label values do (_metric)
                continue
            for key, value in zip(m.series(), m.values or (None,), strict=True):
                labels = {"model": model_name}
                if m.label is not None:
                    labels[m.label] = value  # type: ignore[assignment]
                self.metrics[key] = (fam.Metric(labels=labels, buckets=list(m.buckets))
                                     if m.kind == "histogram" else fam.Metric(labels=labels))
        self.collector = EngineMetrics()
        self._last_counts: dict[str, float] = {}
        self._last_gauges: dict[str, float] = {}
        self._queue: queue.SimpleQueue[_Snapshot | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._publish_loop, name="kvflow-metrics",
                                        daemon=True)
        self._thread.start()

    def on_step(self, loop: EngineLoop, outputs: list[RequestOutput]) -> None:
        """Snapshot this step's numbers (the loop's step hook, on its thread; no backend calls
        here)."""
        self._queue.put(_Snapshot(self.collector.collect(loop.engine, outputs,
                                                         loop.serving_time_s)))

    def count_rejected(self, cause: str) -> None:
        """A request the front door refused before the engine saw it (malformed input):
        counted in ``kvflow_request_rejected_total`` with the engine's own refusals."""
        key = series_key("kvflow_request_rejected_total", "reason", cause)
        self._queue.put(_Snapshot(None, increments={key: 1}))

    def _publish_loop(self) -> None:
        while True:
            snap = self._queue.get()
            if snap is None:
                return
            with contextlib.suppress(Exception):  # metrics never take the server down
                self._publish(snap)
            if snap.done is not None:
                snap.done.set()

    def _metric(self, key: str) -> Any:
        """The backend metric of series ``key``; a dynamic family's (a LoRA adapter's gauge)
        is made the first time its key comes."""
        metric = self.metrics.get(key)
        if metric is None:
            name, _, labels = key.partition("{")
            label, _, value = labels.rstrip("}").partition("=")
            m = METRICS[name]
            metric = self.metrics[key] = self.families[name].Metric(labels={
                "model": self.model_name, label: value.strip('"')}, **(
                    {"buckets": list(m.buckets)} if m.kind == "histogram" else {}))
        return metric

    def _publish(self, snap: _Snapshot) -> None:
        for key, value in snap.increments.items():
            self._metric(key).increment(value)
        update = snap.update
        if update is None:
            return
        for key, value in update.observations:
            self._metric(key).observe(value)
        for key, value in update.gauges.items():
            if self._last_gauges.get(key) != value:
                self._metric(key).set(value)
                self._last_gauges[key] = value
        for key, value in update.totals.items():
            delta = value - self._last_counts.get(key, 0)
            if delta > 0:
                self._metric(key).increment(delta)
                self._last_counts[key] = value

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until every queued snapshot is published (tests, shutdown)."""
        done = threading.Event()
        self._queue.put(_Snapshot(None, done))
        done.wait(timeout_s)

    def close(self) -> None:
        """Stop the metrics thread; the families go after their metrics (the backend's rule)."""
        self._queue.put(None)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self.metrics = {}
            self.families = {}


class _Snapshot:
    __slots__ = ("update", "done", "increments")

    def __init__(self, update: MetricsUpdate | None, done: threading.Event | None = None,
                 increments: dict[str, float] | None = None) -> None:
        self.update = update
        self.done = done
        self.increments = increments or {}  # added to the engine's totals
