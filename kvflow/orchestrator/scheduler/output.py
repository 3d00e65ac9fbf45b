"""What the scheduler hands the engine each step, and why it refuses a request. Pure Python.

:class:`SchedulerOutput` is the one handoff from scheduler to runner (vLLM v1's): the
:class:`ScheduledRequest` chunks of the step, the preempted requests, the timed-out ones and
the ordered block transfers. :class:`RunnerOutput` is the one handoff back (vLLM's
``ModelRunnerOutput``): the tokens the step sampled, and what postprocessing found in them.
:class:`Rejection` is admission's answer to a request it refuses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvflow.orchestrator.request import Request

Clock = Callable[[], float]


class ScheduledRequest:
    """``num_new_tokens`` tokens of ``request`` from ``start`` run this step.

    ``num_spec_tokens``: the last that many are draft tokens (``request.spec_token_ids``),
    scored in the same step as the sequence's last token and verified after it
    (speculative decoding); the step then has logits for each of them too.
    ``sample``: the chunk reaches the end of the known sequence, so a token is sampled. It is
    fixed when scheduled, since the sequence grows once the sampled token is appended.
    """

    __slots__ = ("request", "start", "num_new_tokens", "num_spec_tokens", "sample")

    def __init__(self, request: Request, start: int, num_new_tokens: int,
                 num_spec_tokens: int = 0) -> None:
        self.request = request
        self.start = start
        self.num_new_tokens = num_new_tokens
        self.num_spec_tokens = num_spec_tokens
        self.sample = start + num_new_tokens - num_spec_tokens == len(request.token_ids)

    @property
    def is_decode(self) -> bool:
        """One new token (and its drafts) continuing a sequence whose output has begun."""
        return (self.num_new_tokens - self.num_spec_tokens == 1
                and self.start >= self.request.num_prompt_tokens)

    def token_ids(self) -> list[int]:
        """The sequence's tokens the chunk reads from: the known ones, then its drafts."""
        request = self.request
        if not self.num_spec_tokens:
            return request.token_ids
        return [*request.token_ids, *request.spec_token_ids[:self.num_spec_tokens]]

    def __repr__(self) -> str:
        spec = f", spec={self.num_spec_tokens}" if self.num_spec_tokens else ""
        return (f"ScheduledRequest({self.request.request_id!r}, start={self.start}, "
                f"n={self.num_new_tokens}{spec}, sample={self.sample})")


BlockCopies = list[tuple[int, int]]
# The kinds of block transfers: device -> device (copy on write of a block forked sequences
# share), device -> host (preemption by swap), host -> device (a swapped request resumes).
TRANSFER_KINDS = ("copy", "swap_out", "swap_in")


@dataclass
class SchedulerOutput:
    """What to run this step, and what the scheduler did to get there.

    ``transfers``: the block copies to make before the step, in the order the scheduler
    decided them (it matters: a swap-out frees blocks a later copy on write may reuse, and a
    copy on write must land before its sequence is swapped out).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests finished past their deadline before this step (a group's first sequence), and
    # the phase each was in: "waiting", "prefill" or "decode".
    timed_out: list[tuple[Request, str]] = field(default_factory=list)
    transfers: list[tuple[str, BlockCopies]] = field(default_factory=list)

    def add_transfer(self, kind: str, pairs: BlockCopies) -> None:
        assert kind in TRANSFER_KINDS, kind
        if not pairs:
            return
        if self.transfers and self.transfers[-1][0] == kind:
            self.transfers[-1][1].extend(pairs)
        else:
            self.transfers.append((kind, list(pairs)))

    def _pairs(self, kind: str) -> BlockCopies:
        return [p for k, pairs in self.transfers if k == kind for p in pairs]

    @property
    def blocks_to_swap_out(self) -> BlockCopies:
        """(device block, host block) copies of requests preempted by swap."""
        return self._pairs("swap_out")

    @property
    def blocks_to_swap_in(self) -> BlockCopies:
        """(host block, device block) copies of swapped requests resuming this step."""
        return self._pairs("swap_in")

    @property
    def blocks_to_copy(self) -> BlockCopies:
        """(src, dst) device copies: copy on write of blocks forked sequences share."""
        return self._pairs("copy")

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def num_spec_tokens(self) -> int:
        """Draft tokens scored this step (speculative decoding)."""
        return sum(s.num_spec_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RunnerOutput:
    """One step's result, handed back to :meth:`Scheduler.update_from_output`.

    Attributes:
        sampled_token_ids: request id -> the tokens the step gave it, in order: the one it
            sampled, or with speculative decoding its accepted drafts and then the token
            verification sampled (a request whose chunk did not reach the end of its sequence
            sampled nothing). Only the last may stop the request: the tokens are cut there.
        stop_strings: request id -> the stop string its new text completed.
        grammar_done: the requests whose structured output is complete.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    stop_strings: dict[str, str] = field(default_factory=dict)
    grammar_done: set[str] = field(default_factory=set)


class Rejection(NamedTuple):
    """Why a request is refused: the message (it names the field and the limit), the error
    code (``bad_request`` or ``overloaded``) and the metric's cause (``REJECT_CAUSES``)."""

    message: str
    code: str
    cause: str

    @classmethod
    def bad_request(cls, message: str) -> Rejection:
        """The client's fault: the request can never run as asked."""
        return cls(message, "bad_request", "bad_request")
