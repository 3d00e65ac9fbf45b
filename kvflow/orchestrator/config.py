"""Scheduler configuration: one frozen dataclass, validated where it is built."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

POLICIES = ("fcfs", "priority", "cache_aware", "static")
PREEMPTION_MODES = ("auto", "recompute", "swap")


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
        policy: ``fcfs`` (arrival order), ``priority`` (lower value first, with aging),
            ``cache_aware`` (longest cached prefix first, within ``cache_aware_max_wait_s``) or
            ``static`` (static batching: a batch runs to completion before the next is formed).
        priority_aging_s: with ``priority``, a waiting request gains one priority level per
            this many seconds waited, so that no request starves.
        kv_watermark: fraction of KV blocks admission keeps free for running requests to grow
            into, so a new admission does not immediately force a preemption.
        static_batch_size: batch size of the ``static`` policy (default: max_num_seqs).
        enable_prefix_caching: reuse the KV of cached full blocks across requests.
        preemption_mode: ``recompute`` (drop the KV), ``swap`` (copy it to the host pool and
            back; recompute when the host pool is full) or ``auto`` (whichever is estimated
            cheaper for the victim).
        recompute_tokens_per_s, swap_bytes_per_s: the cost model of ``auto``: recomputing
            ``n`` tokens costs ``n / recompute_tokens_per_s``; swapping ``b`` bytes out and back
            ``2 * b / swap_bytes_per_s``.
        cache_aware_max_wait_s: with ``cache_aware``, a request that has waited this long is
            admitted first whatever its cache hit, so that no request waits forever.
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
    enable_prefix_caching: bool = True
    preemption_mode: str = "auto"
    recompute_tokens_per_s: float = 2000.0
    swap_bytes_per_s: float = 4e9
    cache_aware_max_wait_s: float = 5.0

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
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        for name in ("recompute_tokens_per_s", "swap_bytes_per_s", "cache_aware_max_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.static_batch_size is not None and self.static_batch_size < 1:
            raise ValueError(f"static_batch_size must be >= 1, got {self.static_batch_size}")

    def with_overrides(self, **overrides: Any) -> SchedulerConfig:
        """A copy with ``overrides``; unknown keys are refused by name."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown scheduler option(s) {unknown}; known: {sorted(known)}")
        return replace(self, **overrides)
