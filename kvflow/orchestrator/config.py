"""Scheduler configuration: one frozen dataclass, validated where it is built."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

POLICIES = ("fcfs", "priority", "static")


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler shares each step and the KV cache among requests.

    Attributes:
        max_num_seqs: most requests running (holding KV and scheduled) at once.
        max_num_batched_tokens: token budget of one step (prefill and decode tokens together).
        max_model_len: longest sequence, prompt + output.
        enable_chunked_prefill: split long prompts over several steps, sharing each step with
            decodes; off, a prompt is computed in one step or waits.
        long_prefill_token_threshold: cap on one request's prefill chunk per step (0 = none), so
            that one long prompt cannot take the whole budget.
        max_waiting_requests: bound of the waiting queue; requests beyond it are rejected.
        policy: ``fcfs`` (arrival order), ``priority`` (lower value first, with aging) or
            ``static`` (static batching: a batch runs to completion before the next is formed).
        priority_aging_s: with ``priority``, a waiting request gains one priority level per
            this many seconds waited, so that no request starves.
        kv_watermark: fraction of KV blocks admission keeps free for running requests to grow
            into, so a new admission does not immediately force a preemption.
        static_batch_size: batch size of the ``static`` policy (default: max_num_seqs).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_waiting_requests: int = 4096
    policy: str = "fcfs"
    priority_aging_s: float = 10.0
    kv_watermark: float = 0.01
    static_batch_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "max_waiting_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got "
                             f"{self.long_prefill_token_threshold}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not self.priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0, got {self.priority_aging_s}")
        if not 0 <= self.kv_watermark < 1:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}")
        if self.static_batch_size is not None and self.static_batch_size < 1:
            raise ValueError(f"static_batch_size must be >= 1, got {self.static_batch_size}")

    def with_overrides(self, **overrides: Any) -> SchedulerConfig:
        """A copy with ``overrides``; unknown keys are refused by name."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown scheduler option(s) {unknown}; known: {sorted(known)}")
        return replace(self, **overrides)
