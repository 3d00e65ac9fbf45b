"""Queue policies: which waiting request the continuous scheduler admits next. Pure Python.

The continuous scheduler (:mod:`~kvflow.orchestrator.scheduler.continuous`) decides how much
runs and what is preempted; a policy decides only the order of admission. Each is one small
class over :class:`QueuePolicy`, registered by name in :data:`QUEUE_POLICIES`:

* ``fcfs``: arrival order (a preempted request goes back to the front).
* ``priority``: the lowest ``priority`` value first, with aging; the one policy under which a
  waiting request may preempt a running one of lower priority (``priority_preemption``,
  :meth:`QueuePolicy.outranks`).
* ``cache_aware``: the longest cached prefix first, with a wait bound.
* ``sjf``: shortest job first, with a wait bound.
* ``fair``: per-tenant fair share by a Virtual Token Counter (Sheng et al., OSDI 2024).

Every policy has a starvation bound: aging (priority), a maximum wait (sjf, cache_aware), or
the counters themselves (fair: a tenant that was not served falls behind the others, and is
then served first).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING

from kvflow.kv_manager import KVCacheManager
from kvflow.orchestrator.options import EngineOptions, parse_tenant_weights
from kvflow.orchestrator.request import Request

if TYPE_CHECKING:
    from kvflow.orchestrator.scheduler.output import Clock, ScheduledRequest

DEFAULT_TENANT = ""  # whom a request without a tenant is accounted to


class QueuePolicy:
    """The admission order of the waiting queue; the base class is ``fcfs``.

    The scheduler calls :meth:`pick` for the next request to admit (``skip``: requests it
    passed over this step), :meth:`on_arrival` and :meth:`on_finish` for every sequence that
    enters or leaves it, and :meth:`charge` with the tokens each step gave a request.
    """

    name = "fcfs"

    def __init__(self, config: EngineOptions, kv: KVCacheManager,
                 clock: Clock = time.monotonic) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock

    def pick(self, waiting: Sequence[Request], skip: Collection[Request]) -> Request | None:
        """The next request to admit, or None when every waiting one is in ``skip``."""
        return next((r for r in waiting if r not in skip), None)

    def outranks(self, request: Request, running: Request) -> bool:
        """Whether waiting ``request`` may preempt ``running`` (``priority_preemption``)."""
        return False

    def victim_key(self, request: Request) -> tuple[float, float]:
        """Preemption order: the running request with the largest key goes first (the lowest
        priority, then the newest)."""
        return (request.priority, request.arrival_time)

    def on_arrival(self, request: Request) -> None:
        """A sequence was queued (once per sequence: a group's members each arrive)."""

    def on_finish(self, request: Request) -> None:
        """A sequence finished (stopped, cut, aborted or timed out)."""

    def charge(self, scheduled: Iterable[ScheduledRequest]) -> None:
        """The tokens a step gave these requests (the service they received)."""
        for s in scheduled:
            prompt = s.num_new_tokens - 1 if s.is_decode else s.num_new_tokens
            self.charge_tokens(s.request, prompt, 1 if s.sample else 0)

    def charge_tokens(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        """``request`` was served ``prompt_tokens`` computed and ``output_tokens`` sampled."""


class PriorityPolicy(QueuePolicy):
    """Lowest ``priority`` value first, ties by arrival, with aging: a waiting request's
    effective priority improves by one level per ``priority_aging_s`` seconds waited, so a
    low-priority request is not starved by a stream of high-priority ones."""

    name = "priority"

    def effective_priority(self, request: Request, now: float) -> float:
        return request.priority - (now - request.arrival_time) / self.config.priority_aging_s

    def pick(self, waiting: Sequence[Request], skip: Collection[Request]) -> Request | None:
        now = self.clock()
        return min((r for r in waiting if r not in skip), default=None,
                   key=lambda r: (self.effective_priority(r, now), r.arrival_time))

    def outranks(self, request: Request, running: Request) -> bool:
        """Strictly higher priority, both aged: a request that has aged past the newcomer's
        level (it waited long, or has run long) is not preempted for it."""
        now = self.clock()
        return self.effective_priority(request, now) < self.effective_priority(running, now)

    def victim_key(self, request: Request) -> tuple[float, float]:
        """The lowest aged priority first: the same order as :meth:`outranks`, so that a KV
        shortage never evicts the request a priority preemption would keep."""
        return (self.effective_priority(request, self.clock()), request.arrival_time)


def job_size(request: Request) -> int:
    """Tokens a request still needs: its uncomputed known tokens, plus its remaining output
    where ``max_tokens`` says how long that is (otherwise the output is unknown and left out)."""
    size = request.num_tokens - request.num_computed_tokens
    if request.sampling_params.max_tokens is not None:
        size += max(0, request.max_output_tokens - request.num_output_tokens)
    return size


class ShortestJobFirst(QueuePolicy):
    """Shortest job first (:func:`job_size`), ties by arrival; the starvation bound: a request
    that has waited ``sjf_max_wait_s`` goes ahead of every shorter one (the longest-waiting
    first among those)."""

    name = "sjf"

    def pick(self, waiting: Sequence[Request], skip: Collection[Request]) -> Request | None:
        oldest = self.clock() - self.config.sjf_max_wait_s
        return min((r for r in waiting if r not in skip), default=None,
                   key=lambda r: ((0, 0, r.arrival_time) if r.arrival_time <= oldest
                                  else (1, job_size(r), r.arrival_time)))


class CacheAware(QueuePolicy):
    """Longest cached prefix first among the first ``window`` waiting; but the head of the
    queue once it has waited ``cache_aware_max_wait_s`` (the starvation bound)."""

    name = "cache_aware"
    window = 64

    def pick(self, waiting: Sequence[Request], skip: Collection[Request]) -> Request | None:
        head = super().pick(waiting, skip)
        if head is None or (self.kv.is_swapped(head.request_id) or self.clock()
                            - head.arrival_time >= self.config.cache_aware_max_wait_s):
            return head
        best, best_key = head, (-1, 0.0)
        for i, r in enumerate(waiting):
            if i >= self.window:
                break
            if r in skip or self.kv.is_swapped(r.request_id):
                continue
            _, cached = self.kv.get_computed_blocks(r.request_id, r.token_ids, r.cache_key)
            key = (cached, -r.arrival_time)
            if key > best_key:
                best, best_key = r, key
        return best


class FairShare(QueuePolicy):
    """Per-tenant fair share: the Virtual Token Counter (VTC) of Sheng et al., "Fairness in
    Serving Large Language Models" (OSDI 2024).

    Each tenant has a counter of the service it received: every prompt token computed adds
    ``1 / weight``, every output token ``fair_output_weight / weight`` (``tenant_weights``;
    a tenant not named weighs 1). Admission takes the earliest waiting request of the tenant
    with the smallest counter. A tenant that becomes active (its first unfinished request
    arrives) has its counter lifted to the smallest counter of the active tenants, or, when
    none is active, to that of the tenant that left last: idle time earns no credit, so a
    returning tenant cannot starve the others to catch up, and a tenant is never behind
    others by more than what it is owed since it became active.

    Two choices differ from the paper: a tenant counts as active while it has any unfinished
    request (the paper: a waiting one), so a tenant whose requests all run is not lifted
    again; and tokens recomputed after a preemption are charged as service, since they take
    the engine's time.
    """

    name = "fair"

    def __init__(self, config: EngineOptions, kv: KVCacheManager,
                 clock: Clock = time.monotonic) -> None:
        super().__init__(config, kv, clock)
        self.weights = parse_tenant_weights(config.tenant_weights)
        self.counters: dict[str, float] = {}
        self.active: dict[str, int] = {}  # tenant -> unfinished sequences
        self.floor = 0.0  # the counter of the tenant that left last

    def tenant(self, request: Request) -> str:
        return request.tenant if request.tenant is not None else DEFAULT_TENANT

    def pick(self, waiting: Sequence[Request], skip: Collection[Request]) -> Request | None:
        counters = self.counters
        # min() keeps the first of equal keys: the earliest in queue order.
        return min((r for r in waiting if r not in skip), default=None,
                   key=lambda r: counters[self.tenant(r)])

    def on_arrival(self, request: Request) -> None:
        tenant = self.tenant(request)
        if not self.active.get(tenant):
            lift = min((self.counters[t] for t in self.active), default=self.floor)
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), lift)
        self.active[tenant] = self.active.get(tenant, 0) + 1

    def on_finish(self, request: Request) -> None:
        tenant = self.tenant(request)
        left = self.active[tenant] - 1
        if left:
            self.active[tenant] = left
        else:
            del self.active[tenant]
            self.floor = self.counters[tenant]

    def charge_tokens(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        tenant = self.tenant(request)
        cost = prompt_tokens + self.config.fair_output_weight * output_tokens
        self.counters[tenant] += cost / self.weights.get(tenant, 1.0)


QUEUE_POLICIES: dict[str, type[QueuePolicy]] = {
    p.name: p for p in (QueuePolicy, PriorityPolicy, CacheAware, ShortestJobFirst, FairShare)}

