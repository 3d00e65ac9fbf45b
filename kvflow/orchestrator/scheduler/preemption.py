"""Preemption: which running request gives way, and how its KV leaves the device. Pure Python.

A running request is preempted when another running one cannot grow (a KV shortage: the
policy's lowest-ranked victim goes, :func:`pick_victim`) or, under ``priority``, when a
waiting request outranks it (:func:`priority_victims`, bounded by
``max_preemptions_per_request`` so that no request thrashes). Its KV then leaves the device
by swap to the host pool or is dropped to be recomputed: ``preemption_mode`` forces one, or
(``auto``) :func:`swap_is_cheaper` compares the transfer time with the recompute time.

A group (``n > 1``) is preempted whole, all by swap or all by recompute. The queue side
(back to the front of the waiting queue, the group's members parked) is the scheduler's.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvflow.kv_manager import KVCacheManager
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.request import Request, RequestStatus
from kvflow.orchestrator.scheduler.output import SchedulerOutput
from kvflow.orchestrator.scheduler.policies import QueuePolicy


def pick_victim(running: Iterable[Request], policy: QueuePolicy) -> Request:
    """The running request to preempt on a KV shortage: the policy's largest victim key
    (the lowest priority, then the newest)."""
    return max(running, key=policy.victim_key)


def preemptible(request: Request, max_preemptions: int) -> bool:
    """Under the thrash bound: every running sequence of its group (preempted together) was
    preempted fewer than ``max_preemptions`` times."""
    seqs = request.group.seqs if request.group is not None else [request]
    return all(m.metrics.num_preemptions < max_preemptions
               for m in seqs if m.status == RequestStatus.RUNNING)


def priority_victims(request: Request, running: Iterable[Request], policy: QueuePolicy,
                     max_preemptions: int) -> list[Request]:
    """The running requests waiting ``request`` may preempt (it outranks them, and they are
    under the thrash bound), in the order to preempt them."""
    return sorted((r for r in running if policy.outranks(request, r)
                   and preemptible(r, max_preemptions)), key=policy.victim_key, reverse=True)


def swap_is_cheaper(members: list[Request], config: EngineOptions,
                    kv: KVCacheManager) -> bool:
    """Swap when forced, or (``auto``) when moving the KV out and back is estimated cheaper
    than recomputing it; never when the host pool lacks room or nothing is computed."""
    items = [(m.request_id, m.num_computed_tokens) for m in members]
    if (any(t == 0 for _, t in items) or config.preemption_mode == "recompute"
            or not kv.can_swap_out_many(items)):
        return False
    if config.preemption_mode == "swap":
        return True
    num_tokens = sum(t for _, t in items)
    blocks = len(kv.distinct_blocks(items))
    swap_s = 2 * blocks * kv.bytes_per_block / config.swap_bytes_per_s
    return swap_s < num_tokens / config.recompute_tokens_per_s


class Preemptor:
    """Takes preempted sequences' KV off the device, by swap or by recompute, and marks them
    preempted. Owns the count of sequences swapped out (``num_swapped_out``); the count of
    preemptions is each request's ``metrics.num_preemptions`` and the engine's counter."""

    def __init__(self, config: EngineOptions, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.num_swapped_out = 0

    def evict(self, members: list[Request], output: SchedulerOutput) -> None:
        """Preempt ``members`` (the running sequences of one request) all by swap or all by
        recompute, recording the transfers and the preempted sequences in ``output``."""
        kv = self.kv
        if swap_is_cheaper(members, self.config, kv):
            # Copies on write decided so far first: their blocks may be among those swapped.
            output.add_transfer("copy", kv.take_copies())
            output.add_transfer("swap_out", kv.swap_out_many(
                [(m.request_id, m.num_computed_tokens) for m in members]))
            self.num_swapped_out += len(members)
        else:
            for m in members:
                kv.free(m.request_id, forget=False)
                m.num_computed_tokens = 0
        for m in members:
            m.status = RequestStatus.PREEMPTED
            m.metrics.num_preemptions += 1
            output.preempted.append(m)
