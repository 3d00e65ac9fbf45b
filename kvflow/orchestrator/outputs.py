"""What the engine hands back: per-request outputs, per-step statistics, and typed errors."""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvflow.orchestrator.request import RequestMetrics


class ErrorCode(enum.StrEnum):
    """Whose fault a failed request is, carried as data from where it failed to every front
    door (never read back from the message): each door maps it to its own status."""

    BAD_REQUEST = "bad_request"  # the client's: the request can never run as asked (400)
    OVERLOADED = "overloaded"  # the server's load: retry later (503)
    ENGINE_ERROR = "engine_error"  # the engine's: a bug or a broken runner (500)


class RequestError(ValueError):
    """A request that cannot run; ``code`` says whose fault (a ValueError: bad input by
    default)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.BAD_REQUEST) -> None:
        super().__init__(message)
        self.code = code


def error_code_of(error: BaseException) -> ErrorCode:
    """The code of an error raised while preparing a request: a :class:`RequestError`'s own,
    any other ValueError the client's, anything else the engine's."""
    if isinstance(error, RequestError):
        return error.code
    return ErrorCode.BAD_REQUEST if isinstance(error, ValueError) else ErrorCode.ENGINE_ERROR


# Message wording only (humans read it; no code parses it: the code is ``error_code``).
OVERLOADED_PREFIX = "server overloaded"
ENGINE_ERROR_PREFIX = "engine failed"
# Why admission refused a request (the label of kvflow_request_rejected_total): bad input, a
# full waiting queue, or SLO admission's predicted wait over max_queue_delay_ms.
REJECT_CAUSES = ("bad_request", "queue_full", "queue_delay")
# Where a request was when its deadline passed (the label of kvflow_request_timeout_total).
TIMEOUT_PHASES = ("waiting", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One output token's log-probability and its likeliest alternatives (most likely first;
    ties: lower id first). ``token`` and ``top_tokens`` (id -> text) are set where a front door
    decoded them. :meth:`to_wire` / :meth:`from_wire` are the JSON object of the Triton
    backend's ``output_logprobs`` entries, its public format."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()
    token: str | None = None
    top_tokens: dict[int, str] | None = None

    def to_wire(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"token_id": self.token_id, "logprob": self.logprob,
                                 "top_logprobs": {str(t): lp for t, lp in self.top}}
        if self.token is not None:
            entry["token"] = self.token
        if self.top_tokens is not None:
            entry["top_tokens"] = {str(t): text for t, text in self.top_tokens.items()}
        return entry

    @classmethod
    def from_wire(cls, entry: dict[str, Any]) -> TokenLogprobs:
        top = sorted(((int(t), float(lp)) for t, lp in entry.get("top_logprobs", {}).items()),
                     key=lambda kv: (-kv[1], kv[0]))
        texts = entry.get("top_tokens")
        return cls(int(entry["token_id"]), entry.get("logprob"), tuple(top),
                   entry.get("token"),
                   None if texts is None else {int(t): s for t, s in texts.items()})


def _typed(token: int, alternatives: dict[int, float]) -> TokenLogprobs:
    """One logprobs entry (token id -> log-probability) as the :class:`TokenLogprobs` of
    ``token``, its alternatives most likely first."""
    return TokenLogprobs(token, alternatives.get(token), tuple(
        sorted(alternatives.items(), key=lambda kv: (-kv[1], kv[0]))))


class CompletionOutput:
    """One sequence of a request (vLLM's ``CompletionOutput``): ``index`` in ``0 .. n-1``.

    ``text`` and ``token_ids`` are cumulative; ``delta_text`` and ``delta_token_ids`` are what
    the last step added (empty when this sequence produced nothing in it). ``logprobs``: per
    output token, token id -> log-probability (the sampled token and the top alternatives).

    The engine builds one each step for each live sequence: it passes its own, growing, token
    list with ``num_tokens``, and ``token_ids`` copies that prefix at its first read (the
    sequence only appends), so that a step never copies a whole output.
    """

    __slots__ = ("index", "text", "_token_ids", "_shared", "num_tokens", "delta_text",
                 "delta_token_ids", "finish_reason", "stop_reason", "logprobs")

    def __init__(self, index: int, text: str, token_ids: Sequence[int], delta_text: str,
                 delta_token_ids: list[int], finish_reason: str | None,
                 stop_reason: str | int | None = None,
                 logprobs: list[dict[int, float]] | None = None,
                 num_tokens: int | None = None) -> None:
        self.index = index
        self.text = text
        self._token_ids = token_ids
        # num_tokens given: token_ids is a list the engine still appends to (read its prefix).
        self._shared = num_tokens is not None
        self.num_tokens = len(token_ids) if num_tokens is None else num_tokens
        self.delta_text = delta_text
        self.delta_token_ids = delta_token_ids
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.logprobs = logprobs

    @property
    def token_ids(self) -> list[int]:
        if self._shared:
            self._token_ids, self._shared = list(self._token_ids[:self.num_tokens]), False
        return self._token_ids  # type: ignore[return-value]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_logprobs(self, start: int = 0) -> list[TokenLogprobs]:
        """The logprobs of the output tokens from ``start`` on, typed (reading only those
        tokens' ids)."""
        if self.logprobs is None:
            return []
        ids, end = self._token_ids, min(len(self.logprobs), self.num_tokens)
        return [_typed(ids[i], self.logprobs[i]) for i in range(start, end)]

    def _fields(self) -> tuple[Any, ...]:
        return (self.index, self.text, self.token_ids, self.delta_text, self.delta_token_ids,
                self.finish_reason, self.stop_reason, self.logprobs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass it was

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, "
                f"token_ids={self.token_ids!r}, delta_text={self.delta_text!r}, "
                f"delta_token_ids={self.delta_token_ids!r}, "
                f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r})")


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after a step: ``outputs`` holds its ``n`` sequences in index
    order (``outputs[j]`` as in vLLM), each with what is new since the last output.

    ``finished``: every sequence has finished (a request's last output). The properties
    ``text``, ``token_ids``, ``delta_text``, ``delta_token_ids``, ``finish_reason``,
    ``stop_reason`` and ``logprobs`` are those of ``outputs[0]``: the whole answer of an
    ``n = 1`` request.

    ``prompt_token_ids``: the prompt (the request's own list: do not change it).
    ``prompt_logprobs`` (``SamplingParams.prompt_logprobs``; vLLM's): one entry per prompt
    token, the first None, each other token id -> log-probability holding the prompt token
    and the top ``prompt_logprobs`` at its position, as ``CompletionOutput.logprobs``' entries
    do. A request's prompt logprobs come once, for all its sequences, on its first output that
    carries a token; None on every other output, and when not asked for.
    """

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    num_prompt_tokens: int
    metrics: RequestMetrics
    error: str | None = None
    # With ``error``: whose fault (an ErrorCode; it compares equal to its string).
    error_code: ErrorCode | None = None
    cached_tokens: int = 0
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Speculative decoding: the draft tokens verified for the request (every sequence's), and
    # of those accepted (part of its output; the rest were rejected).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def prompt_token_logprobs(self) -> list[TokenLogprobs | None]:
        """:attr:`prompt_logprobs` typed: per prompt token (the first None) its
        log-probability and its position's likeliest tokens; empty when it has none."""
        if self.prompt_logprobs is None or self.prompt_token_ids is None:
            return []
        return [None if entry is None else _typed(token, entry)
                for token, entry in zip(self.prompt_token_ids, self.prompt_logprobs,
                                        strict=True)]

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
        return sum(o.num_tokens for o in self.outputs)

    @property
    def aborted(self) -> bool:
        """The request was aborted (some sequence ended with ``abort``)."""
        return any(o.finish_reason == "abort" for o in self.outputs)

    @classmethod
    def failed(cls, request_id: str, message: str | None, code: ErrorCode | None, n: int = 1,
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
    alone (with its output processor and step recorder; the Prometheus counters mirror them).

    ``step_time_s`` is the time inside steps, on the engine's clock (simulated seconds in the
    simulator). ``finished_by_reason`` counts every request that ended by its finish reason
    (stop, length, abort, timeout: a group's abort or timeout if any sequence had one, else
    its first sequence's), rejections not;
    ``rejected_by_cause`` counts the rejections by :data:`REJECT_CAUSES`;
    ``timeouts_by_phase`` counts the timeouts by :data:`TIMEOUT_PHASES`.
    """

    prompt_tokens: int = 0  # prefill tokens computed (recomputation after preemption included)
    generation_tokens: int = 0
    # Sequences preempted (each SchedulerOutput.preempted, summed): the one count of them;
    # a request's own is its metrics.num_preemptions.
    preemptions: int = 0
    steps: int = 0
    # Mirrors of the scheduler's counts, refreshed at each step.
    prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    prefix_cache_hits: int = 0  # of which found cached
    # Prompt tokens found cached but recomputed, since their request asked for prompt
    # logprobs (counted apart from the queries and hits above).
    prompt_logprobs_recomputed_tokens: int = 0
    step_time_s: float = 0.0
    # Speculative decoding: draft tokens verified, and of those accepted.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # LoRA: adapter loads into a runner slot, and of those the ones that displaced another
    # (written by the engine's LoraManager).
    lora_swaps: int = 0
    lora_evictions: int = 0
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
    # Preempted by this step's scheduling. A step that runs nothing is not recorded, so the
    # steps' sum may fall short: the one count is EngineCounters.preemptions.
    num_preempted: int
    schedule_time_s: float
    model_time_s: float
    sample_time_s: float
    postprocess_time_s: float
    num_timed_out: int = 0  # requests timed out before this step
    finished: list[str] = field(default_factory=list)
    # What the scheduler ran: (request id, tokens computed) per sequence, in batch order.
    scheduled: list[tuple[str, int]] = field(default_factory=list)
    # Speculative decoding: the draft tokens the step scored (not in num_prefill_tokens nor
    # num_decode_tokens), and per sequence that verified drafts, the tokens it emitted (its
    # accepted drafts and one more: vLLM's acceptance length).
    num_spec_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)

    @property
    def overhead_time_s(self) -> float:
        """Everything but the model: scheduling, input building, sampling, detokenizing."""
        return self.schedule_time_s + self.sample_time_s + self.postprocess_time_s
