"""A request and its lifecycle, in vLLM's vocabulary. Pure Python.

    WAITING -> RUNNING -> (PREEMPTED -> RUNNING)* -> FINISHED_STOPPED | FINISHED_LENGTH
                                                   | FINISHED_ABORTED | FINISHED_TIMEOUT
    WAITING -> REJECTED (with a reason), at once
    WAITING | PREEMPTED -> FINISHED_ABORTED | FINISHED_TIMEOUT

A request with ``n > 1`` is a :class:`SequenceGroup` of n sequences, each a :class:`Request`
of its own (ids ``"<id>#<index>"``): the scheduler runs one of them, the leader, until its
prompt is computed, then forks the others off the leader's KV blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.kv_manager.block_pool import block_extra
from kvflow.orchestrator.sampling.params import SamplingParams

if TYPE_CHECKING:
    from kvflow.orchestrator.output_processor import RequestState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_TIMEOUT = "timeout"  # past its deadline (timeout_ms, request_timeout_s)
    REJECTED = "rejected"

    # Members are singletons: identity hashing is exact, and several times cheaper than
    # Enum's hash of the name in the per-step membership tests.
    __hash__ = object.__hash__

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style reason: ``stop``, ``length``, ``abort``, ``timeout``, ``rejected`` or
        None."""
        return self.value if self in _FINISHED else None


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_TIMEOUT,
                       RequestStatus.REJECTED})


@dataclass
class RequestMetrics:
    """Timestamps of one request (seconds on the engine's clock) and what follows from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    cached_tokens: int = 0

    @property
    def queue_time_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time_s(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_time_s(self) -> float | None:
        """First token to last token."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        n = len(self.token_times)
        if n < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    @property
    def e2e_s(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "arrival_time": self.arrival_time,
            "queue_time_s": self.queue_time_s,
            "prefill_time_s": self.prefill_time_s,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "num_output_tokens": len(self.token_times),
            "num_preemptions": self.num_preemptions,
            "cached_tokens": self.cached_tokens,
        }


class Request:
    """One generation request, as the scheduler and the engine see it.

    ``token_ids`` is the whole known sequence (prompt then output); ``num_computed_tokens`` of
    it have their KV in the pool. A request whose KV was dropped by preemption recomputes
    everything, output tokens included, as if they were prompt.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, arrival_time: float, priority: int = 0,
                 eos_token_ids: tuple[int, ...] = (), max_model_len: int | None = None,
                 cache_salt: str | None = None, tenant: str | None = None,
                 parent_id: str | None = None, index: int = 0, lora_name: str | None = None,
                 lora_id: int | None = None, lora_digest: str | None = None) -> None:
        self.request_id = request_id  # this sequence's id (the KV manager's key)
        # The client's request id and this sequence's index in it (``n > 1``: see
        # SequenceGroup); for a single sequence parent_id == request_id and index == 0.
        self.parent_id = request_id if parent_id is None else parent_id
        self.index = index
        self.group: SequenceGroup | None = None
        self.tenant = tenant  # whom the request is accounted to (OpenAI's `user`), or None
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = arrival_time
        self.eos_token_ids = () if sampling_params.ignore_eos else tuple(eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.status = RequestStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.stop_reason: str | int | None = None
        self.reject_reason: str | None = None
        self.reject_code: str | None = None  # "bad_request" or "overloaded"
        self.reject_cause: str | None = None  # the metric's label: one of REJECT_CAUSES
        self.metrics = RequestMetrics(arrival_time)
        # Tenants with different salts never share prefix-cache blocks.
        self.cache_salt = cache_salt.encode("utf-8") if cache_salt else b""
        # The LoRA adapter it runs under (None: the base model), its stable id (Dynamo's
        # lora_id), and the prefix-cache key: salt and adapter digest (block_extra), so that
        # blocks computed under another adapter, or the base, are never hit.
        self.lora_name = lora_name
        self.lora_id = lora_id
        self.cache_key = block_extra(self.cache_salt, lora_digest)
        # The most output this request may produce: max_tokens, clipped by the context limit.
        limit = sampling_params.max_tokens if sampling_params.max_tokens is not None else 1 << 62
        if max_model_len is not None:
            limit = min(limit, max_model_len - len(prompt_token_ids))
        self.max_output_tokens = limit
        # Seconds on the engine's clock past which the request times out (None: never).
        self.deadline: float | None = None
        # Prompt tokens whose KV was computed on another instance and arrives with the request
        # (disaggregated prefill: LLMEngine.add_request's kv_transferred). Its first admission
        # allocates their blocks and computes only the rest; 0 once admitted, so that a
        # preemption by recompute computes them here.
        self.num_transferred_tokens = 0
        # The engine's state of this sequence (random stream, grammar, text, logprobs): set by
        # the OutputProcessor once the scheduler accepts it, dropped with its final output.
        self.engine_state: RequestState | None = None
        # Speculative decoding (kvflow.orchestrator.speculative): the draft tokens proposed for
        # the next step, which are not in token_ids until verified; the proposer's own state
        # of this sequence (its n-gram index, its draft model's progress), dropped with it; and
        # the drafts verified over its life, of those accepted, and the verifications that
        # rejected one (the draft length's cost model reads its acceptance from them).
        self.spec_token_ids: list[int] = []
        self.proposer_state: object | None = None
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_spec_rejections = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def check_stop(self, stop_string: str | None = None,
                   grammar_done: bool = False) -> RequestStatus | None:
        """Whether the request is finished after its last token, and why: the one place that
        decides. ``stop_string``: the stop string the detokenizer found in the new text (it
        ends the request whatever ``min_tokens`` says, since the text is cut there);
        ``grammar_done``: its structured output's grammar is complete and admits nothing more.
        Sets ``stop_reason`` (the stop token id or string; None for EOS and a grammar)."""
        if not self.output_token_ids:
            return None
        status, self.stop_reason = self.stop_after(
            self.output_token_ids[-1], self.num_output_tokens, stop_string, grammar_done)
        return status

    def stop_after(self, token: int, num_output_tokens: int, stop_string: str | None = None,
                   grammar_done: bool = False) -> tuple[RequestStatus | None, str | int | None]:
        """:meth:`check_stop`'s rule for an output of ``num_output_tokens`` ending in
        ``token``, changing nothing: (the status, the stop reason). The output processor asks
        it of each token of a verified draft before any is appended, to cut them at the first
        that stops."""
        if num_output_tokens >= self.sampling_params.min_tokens:
            if token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token in self.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if grammar_done:
            return RequestStatus.FINISHED_STOPPED, None
        if stop_string is not None:
            return RequestStatus.FINISHED_STOPPED, stop_string
        if num_output_tokens >= self.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, "
                f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")


class SequenceGroup:
    """The ``n`` sequences of one request with ``n > 1`` (parallel sampling), in index order.

    Until it is forked, only the *leader* runs (is queued or scheduled); the other members are
    *parked*: they hold no device blocks and wait for the leader. Once the leader's prompt is
    computed, the scheduler forks every parked member off the leader's blocks: they share the
    prompt's blocks by reference count (the partial last block is copied on write at the
    member's first write). The very first fork happens at the step that samples the leader's
    first token: that step's logits give every member its own first token, each from its own
    random stream. A group preempted by recompute parks all but one member again and forks
    again; one preempted by swap swaps out together, its shared blocks once, and comes back
    together.
    """

    __slots__ = ("parent_id", "seqs", "leader", "parked")

    def __init__(self, parent_id: str, seqs: list[Request]) -> None:
        self.parent_id = parent_id
        self.seqs = seqs
        self.leader = seqs[0]
        self.parked: list[Request] = list(seqs[1:])
        for s in seqs:
            s.group = self

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def unfinished(self) -> list[Request]:
        return [s for s in self.seqs if not s.is_finished]


def fans_out_first_token(request: Request) -> bool:
    """Whether ``request`` is a group's leader whose next token is its first, which its parked
    members sample too (from the leader's logits row: :func:`fan_out_first_tokens`). Such a
    step is never speculative: verified drafts would give the members no row."""
    group = request.group
    return (group is not None and bool(group.parked) and request is group.leader
            and not request.output_token_ids)


def fan_out_first_tokens(requests: list[Request]) -> tuple[list[Request], list[int] | None]:
    """The sequences that sample this step, given those whose logits the runner computes:
    when a group's leader samples its first token, its logits row is every parked member's
    too (each samples it with its own stream; the scheduler forks them when it appends).
    Returns the sequences, and the logits row each reads (None: each its own)."""
    first = [r for r in requests if fans_out_first_token(r)]
    if not first:
        return requests, None
    requests, row_of = list(requests), list(range(len(requests)))
    for r in first:
        assert r.group is not None
        k = requests.index(r)
        members = [m for m in r.group.parked if not m.output_token_ids]
        requests.extend(members)
        row_of.extend([k] * len(members))
    return requests, row_of
