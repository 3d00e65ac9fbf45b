"""The ``kvflow_*`` metrics: one catalogue, and the code that turns each engine step into
metric updates. Pure Python.

:data:`METRICS` names every series, its kind, help text, label and buckets. The Triton
backend publishes it through the Python backend's metrics API
(:mod:`kvflow.triton_backend.metrics`); the simulator keeps it in a :class:`MetricsRegistry`
and samples it as its server series, under the same names. :class:`EngineMetrics` reads an
engine after each step, so both see the very same numbers.

Keys: an unlabeled series is its name; a labeled one is ``name{label="value"}``, as the
Prometheus text format writes it (without the ``model`` label the backend adds). A histogram's
sum and count are ``name_sum`` and ``name_count`` in a registry's rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvflow.observability.tier_metrics import TIER_COUNTERS, TIER_MEDIA, TIER_USAGE, tier_figures
from kvflow.orchestrator.outputs import REJECT_CAUSES, TIMEOUT_PHASES, RequestOutput

if TYPE_CHECKING:
    from kvflow.orchestrator.engine import LLMEngine

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
STEP_TIME_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ACCEPTANCE_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 33)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                         50000, 100000)
TOKEN_KINDS = ("prefill", "decode")
# How a request ended (the label of kvflow_request_success_total); rejections are
# counted by kvflow_request_rejected_total instead.
FINISHED_REASONS = ("stop", "length", "abort", "timeout")


@dataclass(frozen=True)
class Metric:
    """One metric family: ``kind`` is counter, gauge or histogram; ``label`` and ``values``
    name its one label and every value it takes (each series exists from the start, at 0).
    A counter mirrors the :class:`EngineCounters` field ``source`` (a Counter by label value
    when labeled; ``serving_time_s`` is the engine loop's, not the engine's; ``tier:X``: the
    KV tiers' figure X by medium, :mod:`~kvflow.observability.tier_metrics`). ``dynamic``: the
    label's values appear at run time (LoRA adapter names): no series until one does, and a
    reader makes each as it first sees its key."""

    name: str
    kind: str
    help: str
    label: str | None = None
    values: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    source: str = ""
    dynamic: bool = False

    def series(self) -> list[str]:
        """The series' keys: the name, or one ``name{label="value"}`` per value."""
        if self.label is None:
            return [self.name]
        return [series_key(self.name, self.label, v) for v in self.values]


def series_key(name: str, label: str | None = None, value: str | None = None) -> str:
    return name if label is None else f'{name}{{{label}="{value}"}}'


def _m(name: str, kind: str, help: str, **kw: object) -> tuple[str, Metric]:  # noqa: A002
    return name, Metric(name, kind, help, **kw)  # type: ignore[arg-type]


METRICS: dict[str, Metric] = dict((
    # --- gauges: the server's state after each step ---
    _m("kvflow_num_requests_running", "gauge", "Requests holding KV and scheduled"),
    _m("kvflow_num_requests_waiting", "gauge", "Requests waiting or preempted"),
    _m("kvflow_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use"),
    _m("kvflow_kv_cache_fragmentation_ratio", "gauge",
       "Fraction of the token slots in used KV blocks that hold no token (the tails of last "
       "blocks, blocks allocated ahead)"),
    _m("kvflow_lora_requests_running", "gauge",
       "Sequences running under each LoRA adapter (every adapter loaded since the start)",
       label="lora_name", dynamic=True),
    _m("kvflow_lora_resident", "gauge", "LoRA adapters resident in the runner's slot pool"),
    _m(TIER_USAGE[0], "gauge", TIER_USAGE[1], label="medium", values=TIER_MEDIA),
    # --- per-request histograms ---
    _m("kvflow_time_to_first_token_seconds", "histogram", "Time to first token",
       buckets=LATENCY_BUCKETS),
    _m("kvflow_inter_token_latency_seconds", "histogram",
       "Time between consecutive output tokens", buckets=LATENCY_BUCKETS),
    _m("kvflow_decode_itl_with_prefill_seconds", "histogram",
       "Inter-token latency of decode tokens made by steps that also computed a prefill "
       "chunk (the drag of long prompts on running requests)", buckets=LATENCY_BUCKETS),
    _m("kvflow_decode_itl_without_prefill_seconds", "histogram",
       "Inter-token latency of decode tokens made by steps without a prefill chunk",
       buckets=LATENCY_BUCKETS),
    _m("kvflow_e2e_request_latency_seconds", "histogram", "Arrival to last token",
       buckets=LATENCY_BUCKETS),
    _m("kvflow_request_queue_time_seconds", "histogram", "Arrival to first scheduled",
       buckets=LATENCY_BUCKETS),
    _m("kvflow_request_prefill_time_seconds", "histogram",
       "First scheduled to first token, per finished request", buckets=LATENCY_BUCKETS),
    _m("kvflow_request_decode_time_seconds", "histogram",
       "First token to last token, per finished request", buckets=LATENCY_BUCKETS),
    _m("kvflow_time_per_output_token_seconds", "histogram",
       "Mean time per output token after the first, per finished request (TPOT)",
       buckets=LATENCY_BUCKETS),
    _m("kvflow_request_prompt_tokens", "histogram", "Prompt tokens per finished request",
       buckets=REQUEST_TOKEN_BUCKETS),
    _m("kvflow_request_generation_tokens", "histogram",
       "Output tokens per finished request (every sequence of an n > 1 request)",
       buckets=REQUEST_TOKEN_BUCKETS),
    # --- per-step histograms ---
    _m("kvflow_iteration_num_seqs", "histogram", "Sequences in each engine step",
       buckets=BATCH_BUCKETS),
    _m("kvflow_iteration_tokens", "histogram",
       "Tokens computed by each engine step, by kind (every step observes both)",
       label="kind", values=TOKEN_KINDS, buckets=STEP_TOKEN_BUCKETS),
    _m("kvflow_spec_decode_acceptance_length", "histogram",
       "Speculative decoding: tokens a sequence emitted in one step that verified its "
       "drafts (the accepted drafts and one more)", buckets=ACCEPTANCE_LENGTH_BUCKETS),
    _m("kvflow_schedule_time_seconds", "histogram",
       "Each step's scheduling time (building the batch: admission, preemption, KV "
       "allocation)", buckets=STEP_TIME_BUCKETS),
    _m("kvflow_model_time_seconds", "histogram",
       "Each step's model time (inputs built, the runner's forward pass)",
       buckets=STEP_TIME_BUCKETS),
    _m("kvflow_sampling_time_seconds", "histogram", "Each step's sampling time",
       buckets=STEP_TIME_BUCKETS),
    _m("kvflow_postprocess_time_seconds", "histogram",
       "Each step's postprocessing time (detokenizing, stop checks, appending, outputs)",
       buckets=STEP_TIME_BUCKETS),
    # --- counters (mirrors of EngineCounters) ---
    _m("kvflow_prompt_tokens_total", "counter", "Prefill tokens computed",
       source="prompt_tokens"),
    _m("kvflow_generation_tokens_total", "counter", "Output tokens generated",
       source="generation_tokens"),
    _m("kvflow_num_preemptions_total", "counter", "Requests preempted", source="preemptions"),
    _m("kvflow_request_success_total", "counter",
       "Requests that ended, by finished reason (rejections are counted apart)",
       label="finished_reason", values=FINISHED_REASONS, source="finished_by_reason"),
    _m("kvflow_request_rejected_total", "counter",
       "Requests refused at once, by cause: bad input (refused by the front door or by "
       "admission), a full queue, or a predicted wait over max_queue_delay_ms",
       label="reason", values=REJECT_CAUSES, source="rejected_by_cause"),
    _m("kvflow_request_timeout_total", "counter",
       "Requests ended past their deadline, by the phase they were in", label="phase",
       values=TIMEOUT_PHASES, source="timeouts_by_phase"),
    _m("kvflow_prefix_cache_queries_total", "counter",
       "Prompt tokens looked up in the prefix cache (the hit ratio is hits over queries)",
       source="prefix_cache_queries"),
    _m("kvflow_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache",
       source="prefix_cache_hits"),
    _m("kvflow_prompt_logprobs_recomputed_tokens_total", "counter",
       "Prompt tokens found in the prefix cache but recomputed, since their request asked "
       "for prompt logprobs (a cached block has no logits)",
       source="prompt_logprobs_recomputed_tokens"),
    _m("kvflow_spec_decode_num_draft_tokens_total", "counter",
       "Speculative decoding: draft tokens scored and verified", source="spec_draft_tokens"),
    _m("kvflow_spec_decode_num_accepted_tokens_total", "counter",
       "Speculative decoding: draft tokens accepted (part of the output)",
       source="spec_accepted_tokens"),
    _m("kvflow_lora_swaps_total", "counter", "LoRA adapters loaded into a slot of the "
       "runner's pool", source="lora_swaps"),
    _m("kvflow_lora_evictions_total", "counter", "LoRA adapter loads that displaced a resident "
       "adapter no running request used (least recently used first)",
       source="lora_evictions"),
    # The KV tiers' (KVTiers.state()'s figures, not EngineCounters fields: "tier:" sources).
    *(_m(name, "counter", text, label="medium", values=TIER_MEDIA, source="tier:" + figure)
      for name, figure, text in TIER_COUNTERS),
    _m("kvflow_engine_steps_total", "counter", "Engine steps run", source="steps"),
    _m("kvflow_engine_step_seconds_total", "counter",
       "Engine-thread seconds inside engine steps", source="step_time_s"),
    _m("kvflow_serving_seconds_total", "counter",
       "Engine-thread seconds serving around the steps: cancellation checks, metrics "
       "snapshots, handing outputs to the response senders", source="serving_time_s"),
))
assert all(m.source for m in METRICS.values() if m.kind == "counter"), "a counter lacks source"


def all_series() -> list[str]:
    """Every series name a scrape shows (histograms as ``_bucket``, ``_sum``, ``_count``);
    a dynamic family's only once a label value appears, so it is left out."""
    names = []
    for m in METRICS.values():
        if m.dynamic:
            continue
        names += ([f"{m.name}{s}" for s in ("_bucket", "_sum", "_count")]
                  if m.kind == "histogram" else [m.name])
    return names


@dataclass
class MetricsUpdate:
    """What one step changed: histogram observations (key, value), gauge values and counter
    totals, by series key. Plain numbers, so another thread may publish them."""

    observations: list[tuple[str, float]]
    gauges: dict[str, float]
    totals: dict[str, float]


# (series key, the EngineCounters field, the label value within it or None), precomputed
_COUNTER_KEYS = [(key, m.source, value)
                 for m in METRICS.values() if m.kind == "counter"
                 for key, value in zip(m.series(), m.values or (None,), strict=True)]
_PREFILL_TOKENS = series_key("kvflow_iteration_tokens", "kind", "prefill")
_DECODE_TOKENS = series_key("kvflow_iteration_tokens", "kind", "decode")


class EngineMetrics:
    """Reads an engine after each step into a :class:`MetricsUpdate`.

    Call :meth:`collect` once after every ``engine.step()`` with the outputs it returned (and
    after a change without a step, an abort or a rejection, with none). Per-request histograms
    are observed from those outputs: the requests that ended in a step (aborts, which end
    outside one, are counted by ``kvflow_request_success_total`` alone). :meth:`observations`
    and :meth:`state` are its two halves, for a reader (the simulator) that needs the state
    only when it samples it.
    """

    def __init__(self) -> None:
        self._steps_seen = 0

    def collect(self, engine: LLMEngine, outputs: list[RequestOutput],
                serving_time_s: float = 0.0) -> MetricsUpdate:
        gauges, totals = self.state(engine, serving_time_s)
        return MetricsUpdate(self.observations(engine, outputs), gauges, totals)

    def observations(self, engine: LLMEngine,
                     outputs: list[RequestOutput]) -> list[tuple[str, float]]:
        """The histogram observations of the step just run (none twice for one step)."""
        obs: list[tuple[str, float]] = []
        stats = None
        if engine.counters.steps != self._steps_seen and engine.step_stats:
            self._steps_seen = engine.counters.steps
            stats = engine.step_stats[-1]
            obs += [("kvflow_iteration_num_seqs", stats.num_scheduled_seqs),
                    (_PREFILL_TOKENS, stats.num_prefill_tokens),
                    (_DECODE_TOKENS, stats.num_decode_tokens),
                    ("kvflow_schedule_time_seconds", stats.schedule_time_s),
                    ("kvflow_model_time_seconds", stats.model_time_s),
                    ("kvflow_sampling_time_seconds", stats.sample_time_s),
                    ("kvflow_postprocess_time_seconds", stats.postprocess_time_s)]
            obs += [("kvflow_spec_decode_acceptance_length", n)
                    for n in stats.acceptance_lengths]
        itl_key = ("kvflow_decode_itl_with_prefill_seconds"
                   if stats is not None and stats.num_prefill_tokens else
                   "kvflow_decode_itl_without_prefill_seconds")
        for out in outputs:
            m = out.metrics
            times = m.token_times
            num_new = len(out.delta_token_ids)
            if stats is not None and num_new:
                # One latency per step that gave the request tokens (with speculative
                # decoding, several at once): the time since the step that gave the last.
                if len(times) > num_new:
                    itl = times[-1] - times[-1 - num_new]
                    obs += [("kvflow_inter_token_latency_seconds", itl), (itl_key, itl)]
                elif len(times) == num_new and m.ttft_s is not None:
                    obs.append(("kvflow_time_to_first_token_seconds", m.ttft_s))
                    if m.queue_time_s is not None:
                        obs.append(("kvflow_request_queue_time_seconds", m.queue_time_s))
            if out.finished and out.finish_reason != "rejected":
                obs += [("kvflow_request_prompt_tokens", out.num_prompt_tokens),
                        ("kvflow_request_generation_tokens", out.num_output_tokens)]
                for key, value in (("kvflow_e2e_request_latency_seconds", m.e2e_s),
                                   ("kvflow_request_prefill_time_seconds", m.prefill_time_s),
                                   ("kvflow_request_decode_time_seconds", m.decode_time_s),
                                   ("kvflow_time_per_output_token_seconds", m.tpot_s)):
                    if value is not None:
                        obs.append((key, value))
        return obs

    @staticmethod
    def state(engine: LLMEngine,
              serving_time_s: float = 0.0) -> tuple[dict[str, float], dict[str, float]]:
        """The gauges now, and the counters' totals."""
        sched, kv = engine.scheduler, engine.kv
        gauges = {"kvflow_num_requests_running": float(sched.num_running),
                  "kvflow_num_requests_waiting": float(sched.num_waiting),
                  "kvflow_kv_cache_usage_ratio": kv.usage,
                  "kvflow_kv_cache_fragmentation_ratio": kv.fragmentation(
                      [(r.request_id, r.num_computed_tokens) for r in sched.running])}
        lora = engine.lora
        if lora is not None:
            gauges["kvflow_lora_resident"] = float(lora.num_resident)
            running = sched.loras.running
            for name in lora.known_names():
                gauges[series_key("kvflow_lora_requests_running", "lora_name", name)] = float(
                    running.get(name, 0))
        tiers = tier_figures(kv)
        for medium, t in tiers.items():
            gauges[series_key(TIER_USAGE[0], "medium", medium)] = float(t["bytes"])
        counters = engine.counters
        totals: dict[str, float] = {}
        for key, field, value in _COUNTER_KEYS:
            # A counter's field: a number, a Counter by label (``value``), or a tier's figure.
            total: Any = (serving_time_s if field == "serving_time_s"
                          else {m: t[field[5:]] for m, t in tiers.items()}
                          if field.startswith("tier:") else getattr(counters, field))
            totals[key] = total if value is None else total.get(value, 0)
        return gauges, totals


class MetricsRegistry:
    """The catalogue's series held in plain Python (the simulator's server): histograms
    (buckets, sum, count), gauges and counters, updated by :class:`MetricsUpdate`."""

    def __init__(self) -> None:
        self.gauges = {k: 0.0 for m in METRICS.values() if m.kind == "gauge" for k in m.series()}
        self.counters = {k: 0.0 for m in METRICS.values() if m.kind == "counter"
                         for k in m.series()}
        self.histograms = {k: _Histogram(m.buckets) for m in METRICS.values()
                           if m.kind == "histogram" for k in m.series()}

    def apply(self, update: MetricsUpdate) -> None:
        self.observe(update.observations)
        self.set_state(update.gauges, update.totals)

    def observe(self, observations: list[tuple[str, float]]) -> None:
        histograms = self.histograms
        for key, value in observations:
            histograms[key].observe(value)

    def set_state(self, gauges: dict[str, float], totals: dict[str, float]) -> None:
        self.gauges.update(gauges)
        self.counters.update(totals)

    def row(self) -> dict[str, float]:
        """Every series' value now: gauges, counters, and each histogram's ``_sum`` and
        ``_count`` (a labeled one's as ``name_sum{label="value"}``)."""
        row = {**self.gauges, **self.counters}
        for key, h in self.histograms.items():
            name, brace, labels = key.partition("{")
            row[f"{name}_sum{brace}{labels}"] = h.sum
            row[f"{name}_count{brace}{labels}"] = float(h.count)
        return row

    def exposition(self, labels: Mapping[str, str] | None = None) -> str:
        """The Prometheus text format of every series (what Triton's /metrics shows)."""
        extra = ",".join(f'{k}="{v}"' for k, v in (labels or {}).items())
        lines = []

        def line(key: str, value: float, more: str = "") -> None:
            name, _, inner = key.partition("{")
            inner = ",".join(filter(None, (extra, inner.rstrip("}"), more)))
            text = repr(float(value))
            lines.append(f"{name}{{{inner}}} {text}" if inner else f"{name} {text}")

        for m in METRICS.values():
            keys = m.series()
            if m.dynamic:  # its series are the keys its updates brought
                held = self.gauges if m.kind == "gauge" else self.counters
                keys = sorted(k for k in held if k.startswith(m.name + "{"))
                if not keys:
                    continue
            lines += [f"# HELP {m.name} {m.help}", f"# TYPE {m.name} {m.kind}"]
            for key in keys:
                if m.kind == "histogram":
                    h = self.histograms[key]
                    name, brace, labels_ = key.partition("{")
                    for bound, count in zip((*h.buckets, float("inf")), h.cumulative(),
                                            strict=True):
                        le = "+Inf" if bound == float("inf") else f"{bound:g}"
                        line(f"{name}_bucket{brace}{labels_}", count, f'le="{le}"')
                    line(f"{name}_sum{brace}{labels_}", h.sum)
                    line(f"{name}_count{brace}{labels_}", h.count)
                else:
                    line(key, (self.gauges if m.kind == "gauge" else self.counters)[key])
        return "\n".join(lines) + "\n"


class _Histogram:
    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[int]:
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out
