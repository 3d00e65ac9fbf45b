"""What the engine hands back: per-request outputs and per-step statistics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from kvflow.orchestrator.request import RequestMetrics

# How error messages begin, by cause: a front door that sees only the text (Triton passes a
# decoupled model's error on without its code) tells overload and engine failure from bad input
# by these. Any other error is the client's.
OVERLOADED_PREFIX = "server overloaded"
ENGINE_ERROR_PREFIX = "engine failed"
# Why admission refused a request (the label of kvflow_request_rejected_total): bad input, a
# full waiting queue, or SLO admission's predicted wait over max_queue_delay_ms.
REJECT_CAUSES = ("bad_request", "queue_full", "queue_delay")
# Where a request was when its deadline passed (the label of kvflow_request_timeout_total).
TIMEOUT_PHASES = ("waiting", "prefill", "decode")


@dataclass(slots=True)
class CompletionOutput:
    """One sequence of a request (vLLM's ``CompletionOutput``): ``index`` in ``0 .. n-1``.

    ``text`` and ``token_ids`` are cumulative; ``delta_text`` and ``delta_token_ids`` are what
    the last step added (empty when this sequence produced nothing in it).
    """

    index: int
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after a step: ``outputs`` holds its ``n`` sequences in index
    order (``outputs[j]`` as in vLLM), each with what is new since the last output.

    ``finished``: every sequence has finished (a request's last output). The properties
    ``text``, ``token_ids``, ``delta_text``, ``delta_token_ids``, ``finish_reason``,
    ``stop_reason`` and ``logprobs`` are those of ``outputs[0]``: the whole answer of an
    ``n = 1`` request.
    """

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    num_prompt_tokens: int
    metrics: RequestMetrics
    error: str | None = None
    # With ``error``: "bad_request" (the client's fault), "overloaded" (retry later) or
    # "engine_error".
    error_code: str | None = None
    cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def delta_text(self) -> str:
        return self.outputs[0].delta_text

    @property
    def delta_token_ids(self) -> list[int]:
        return self.outputs[0].delta_token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs

    @property
    def num_output_tokens(self) -> int:
        """Output tokens of every sequence together."""
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def aborted(self) -> bool:
        """The request was aborted (some sequence ended with ``abort``)."""
        return any(o.finish_reason == "abort" for o in self.outputs)

    @classmethod
    def failed(cls, request_id: str, message: str | None, code: str | None, n: int = 1,
               metrics: RequestMetrics | None = None,
               finish_reason: str = "rejected") -> RequestOutput:
        """A final output for a request that ended before it ran: refused (every sequence
        ``rejected``, with ``message``), or aborted (``finish_reason="abort"``)."""
        return cls(request_id=request_id,
                   outputs=[CompletionOutput(j, "", [], "", [], finish_reason)
                            for j in range(n)],
                   finished=True, num_prompt_tokens=0, metrics=metrics or RequestMetrics(0.0),
                   error=message, error_code=code)


@dataclass(slots=True)
class EngineCounters:
    """Running totals of one :class:`~kvflow.orchestrator.engine.LLMEngine`, written by it
    alone (the Prometheus counters mirror them).

    ``step_time_s`` is the time inside steps, on the engine's clock (simulated seconds in the
    simulator). ``finished_by_reason`` counts every request that ended by its finish reason
    (stop, length, abort, timeout: a group's abort or timeout if any sequence had one, else
    its first sequence's), rejections not;
    ``rejected_by_cause`` counts the rejections by :data:`REJECT_CAUSES`;
    ``timeouts_by_phase`` counts the timeouts by :data:`TIMEOUT_PHASES`.
    """

    prompt_tokens: int = 0  # prefill tokens computed (recomputation after preemption included)
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    prefix_cache_hits: int = 0  # of which found cached
    step_time_s: float = 0.0
    finished_by_reason: Counter[str] = field(default_factory=Counter)
    rejected_by_cause: Counter[str] = field(default_factory=Counter)
    timeouts_by_phase: Counter[str] = field(default_factory=Counter)

    def copy(self) -> EngineCounters:
        """A snapshot that later steps do not change (the per-label counts copied too)."""
        return replace(self, finished_by_reason=Counter(self.finished_by_reason),
                       rejected_by_cause=Counter(self.rejected_by_cause),
                       timeouts_by_phase=Counter(self.timeouts_by_phase))

    @property
    def finished(self) -> int:
        """Requests that ended (not rejected), every reason together."""
        return sum(self.finished_by_reason.values())

    @property
    def rejected(self) -> int:
        """Requests rejected at once, every cause together."""
        return sum(self.rejected_by_cause.values())


@dataclass
class StepStats:
    """One engine step, for metrics and reports."""

    time: float
    num_running: int
    num_waiting: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_scheduled_seqs: int
    kv_blocks_used: int
    kv_usage: float
    num_preempted: int
    schedule_time_s: float
    model_time_s: float
    sample_time_s: float
    postprocess_time_s: float
    num_timed_out: int = 0  # requests timed out before this step
    finished: list[str] = field(default_factory=list)
    # What the scheduler ran: (request id, tokens computed) per sequence, in batch order.
    scheduled: list[tuple[str, int]] = field(default_factory=list)

    @property
    def overhead_time_s(self) -> float:
        """Everything but the model: scheduling, input building, sampling, detokenizing."""
        return self.schedule_time_s + self.sample_time_s + self.postprocess_time_s
