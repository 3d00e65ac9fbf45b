"""The scheduler base class, shared by every batching policy. Pure Python.

:class:`Scheduler` holds the queues and the per-request bookkeeping: requests in
(:meth:`~Scheduler.add_request`, after admission control) and out (abort, finish), the step
(:meth:`~Scheduler.schedule`: deadlines first, then the policy's ``_schedule()``), the sampled
tokens back (:meth:`~Scheduler.update_from_output`, vLLM v1's handshake), the queue side of a
preemption, the token-budget clamp (``_chunk``), the counters and
:meth:`~Scheduler.check_integrity`. The other rooms: :mod:`kvflow.orchestrator.scheduler`.

Parallel sampling (``n > 1``, a :class:`SequenceGroup`): the base class forks a group's parked
members off its leader once the leader's prompt is computed, and preempts, swaps and aborts a
group as one.
"""

from __future__ import annotations

import time
from collections import deque

from kvflow.kv_manager import KVCacheManager
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.request import Request, RequestStatus, SequenceGroup
from kvflow.orchestrator.scheduler import admission
from kvflow.orchestrator.scheduler.deadlines import Deadlines, timeout_phase, timeout_s
from kvflow.orchestrator.scheduler.lora_gate import LoraGate
from kvflow.orchestrator.scheduler.output import (
    Clock,
    Rejection,
    RunnerOutput,
    SchedulerOutput,
)
from kvflow.orchestrator.scheduler.policies import QUEUE_POLICIES, QueuePolicy
from kvflow.orchestrator.scheduler.preemption import Preemptor
from kvflow.orchestrator.scheduler.step_budget import StepBudget


class Scheduler:
    """Queues, requests in and out, the step's frame and the bookkeeping shared by every
    policy; a subclass implements ``_schedule()``.

    Args:
        config: the limits and the policy.
        kv: the KV cache manager whose blocks every scheduled token must have.
        clock: seconds, monotonic; the simulator passes its own.
    """

    # Whether the policy schedules draft tokens (Request.spec_token_ids; speculative decoding).
    speculates = True

    def __init__(self, config: EngineOptions, kv: KVCacheManager,
                 clock: Clock = time.monotonic) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # by sequence id
        self.groups: dict[str, SequenceGroup] = {}  # requests with n > 1, by the client's id
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of which found cached
        # Prompt tokens found cached but recomputed: their request asked for prompt logprobs.
        self.prompt_logprobs_recomputed_tokens = 0
        # The longest sequence that can ever be resident: the context limit or the whole pool
        # (under a sliding window, the pool need only hold the window and a step's tokens).
        self.max_seq_len = min(config.max_model_len,
                               kv.max_sequence_tokens(config.max_num_batched_tokens))
        self.watermark_blocks = int(config.kv_watermark * kv.pool.num_usable_blocks)
        self.policy = QUEUE_POLICIES.get(config.policy, QueuePolicy)(config, kv, clock)
        self.deadlines = Deadlines()
        self.preemptor = Preemptor(config, kv)
        # At most max_loras distinct LoRA adapters among the running requests.
        self.loras = LoraGate(config.max_loras)
        # Measured over the steps, for SLO admission's queue-delay prediction.
        self.prefill_rate = admission.PrefillRate(config.recompute_tokens_per_s)
        # The step's token budget from its target time (max_step_ms; None or 0: no target,
        # the engine resolves None by its runner before it builds the scheduler).
        self.step_budget = (StepBudget(config.max_step_ms / 1000, config.max_num_batched_tokens)
                            if config.max_step_ms else None)

    # --- requests in and out ------------------------------------------------------------------
    def add_request(self, request: Request) -> bool:
        """Queue ``request``, or reject it at once (status REJECTED; ``reject_reason`` says why
        with the numbers, ``reject_code`` is ``bad_request`` or ``overloaded``)."""
        group = request.group
        members = group.seqs if group is not None else [request]
        rejection = self._rejection_reason(request)
        if rejection is not None:
            for m in members:
                m.status = RequestStatus.REJECTED
                m.reject_reason, m.reject_code, m.reject_cause = rejection
                m.metrics.finished_time = self.clock()
            return False
        if request.parent_id in self.groups or any(
                m.request_id in self.requests for m in (*members, request)) or (
                request.parent_id in self.requests):
            raise ValueError(f"request_id {request.parent_id!r} is already in flight")
        for m in members:
            # max_tokens=None: as much as the context (and the pool) allow.
            m.max_output_tokens = min(m.max_output_tokens,
                                      self.max_seq_len - m.num_prompt_tokens)
            self.requests[m.request_id] = m
            self.policy.on_arrival(m)
        if group is not None:
            self.groups[group.parent_id] = group
        limit_s = timeout_s(request, self.config)
        if limit_s is not None:
            self.deadlines.add(request, members, limit_s)
        self.waiting.append(request)
        return True

    def _rejection_reason(self, request: Request) -> Rejection | None:
        """Why ``request`` can never run, or cannot be queued now; None if it can
        (:mod:`~kvflow.orchestrator.scheduler.admission`)."""
        return (admission.never_fits(request, self.config, self.kv, self.max_seq_len)
                or admission.overloaded(self.config, self.waiting, self.running,
                                        self.prefill_rate))

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens (recomputation included) queued to be prefilled."""
        return admission.queued_prefill_tokens(self.waiting, self.running)

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prefill throughput measured over recent steps (``recompute_tokens_per_s`` until
        one prefilled): SLO admission's prediction divides by it."""
        return self.prefill_rate.tokens_per_s

    def observe_step(self, num_prefill_tokens: int, step_time_s: float,
                     num_tokens: int | None = None) -> None:
        """The engine reports each step's prefill tokens, duration and (``num_tokens``) all
        its tokens, decodes and drafts included (its step statistics): the prefill rate and
        the step budget's fit."""
        self.prefill_rate.observe(num_prefill_tokens, step_time_s)
        if self.step_budget is not None and num_tokens is not None:
            self.step_budget.observe(num_tokens, step_time_s)

    @property
    def token_budget(self) -> int:
        """The next step's token budget: with a target step time (``max_step_ms``), the
        tokens that fit it at the measured cost per token (:class:`StepBudget`), within
        ``max_num_batched_tokens``; without one, ``max_num_batched_tokens``. (The continuous
        policy gives every running request a token even past it: progress before time.)"""
        if self.step_budget is None:
            return self.config.max_num_batched_tokens
        return self.step_budget.tokens

    def abort_request(self, request_id: str) -> Request | None:
        """Abort a queued or running request (by the client's id: every sequence of an
        ``n > 1`` request); its KV blocks are freed now. Returns the request (a group's first
        sequence)."""
        group = self.groups.get(request_id)
        if group is not None:
            for member in group.unfinished:
                self.finish_request(member, RequestStatus.FINISHED_ABORTED)
            return group.seqs[0]
        request = self.requests.get(request_id)
        if request is None or request.group is not None:
            return None
        self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Move ``request`` to a finished status and release everything it holds."""
        group = request.group
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self.loras.stopped(request)
        elif group is not None and request in group.parked:
            group.parked.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.metrics.finished_time = self.clock()
        self.kv.free(request.request_id)
        if self.requests.pop(request.request_id, None) is not None:
            self.policy.on_finish(request)
        # NOTE: a group's leader finishes only by sampling, after its parked members were
        # forked, or by an abort, which takes the whole group (check_integrity checks it).
        if group is not None and group.is_finished:
            self.groups.pop(group.parent_id, None)

    # --- the step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """This step's work: first the requests past their deadline are finished (their blocks
        free for this very step), then the policy's :meth:`_schedule` picks the tokens."""
        out = SchedulerOutput()
        if self.deadlines:
            self._expire(out)
        self._schedule(out)
        return self._flush_copies(out)

    def _schedule(self, out: SchedulerOutput) -> None:
        raise NotImplementedError

    def _expire(self, out: SchedulerOutput) -> None:
        """Finish every request past its deadline (each unfinished sequence of a group) with
        ``timeout``, wherever it is: waiting, prefilling or decoding."""
        for request in self.deadlines.expired(self.clock()):
            members = request.group.unfinished if request.group is not None else [request]
            phase = timeout_phase(members)
            for m in members:
                self.finish_request(m, RequestStatus.FINISHED_TIMEOUT)
            out.timed_out.append((request, phase))
        self.deadlines.compact(len(self.requests))

    def update_from_output(self, output: SchedulerOutput,
                           result: RunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish what stopped.

        ``result`` holds the token sampled for each request that reached its sequence's end,
        the stop strings their new text completed and the structured outputs that are
        complete. Each request's :meth:`Request.check_stop` decides; this is where a running
        request finishes. Returns the requests that finished.
        """
        now = self.clock()
        finished: list[Request] = []
        caching = self.kv.enable_caching
        sampled = result.sampled_token_ids
        for s in output.scheduled:
            request = s.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if s.num_spec_tokens:
                # Rollback is bookkeeping: the rejected drafts' KV stays in the slots past
                # num_computed_tokens, to be overwritten; no block hash covers them, since
                # token_ids holds only accepted tokens.
                accepted = len(sampled.get(request.request_id, ())) - 1
                request.num_computed_tokens = s.start + s.num_new_tokens - s.num_spec_tokens
                if accepted > 0:
                    request.num_computed_tokens += accepted
                request.num_draft_tokens += s.num_spec_tokens
                request.num_accepted_tokens += max(accepted, 0)
                request.num_spec_rejections += accepted < s.num_spec_tokens
            else:
                request.num_computed_tokens = s.start + s.num_new_tokens
            request.spec_token_ids = []
            if caching:
                self.kv.cache_blocks(request.request_id, request.token_ids,
                                     request.num_computed_tokens, request.cache_key,
                                     request.lora_id, bool(request.cache_salt))
            group = request.group
            if (group is not None and group.parked and request is group.leader
                    and request.num_computed_tokens >= request.num_prompt_tokens):
                # Before the leader's own token: it may finish, and its blocks go with it.
                for member in self._fork(group):
                    self._append(member, result, now, finished)
            self._append(request, result, now, finished)
        return finished

    def _append(self, request: Request, result: RunnerOutput, now: float,
                finished: list[Request]) -> None:
        """Append the request's sampled tokens, if it has any, and finish it if it stopped
        (only the last may stop it: the output processor cut them there)."""
        tokens = result.sampled_token_ids.get(request.request_id)
        if not tokens:
            return
        m = request.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        for token in tokens:
            request.append_output_token(token)
            m.token_times.append(now)
        status = request.check_stop(result.stop_strings.get(request.request_id),
                                    request.request_id in result.grammar_done)
        if status is not None:
            self.finish_request(request, status)
            finished.append(request)

    def _fork(self, group: SequenceGroup) -> list[Request]:
        """Fork the group's parked members (those not swapped out) off its leader, whose
        prompt is computed: each shares the blocks of the prompt and starts running with the
        prompt computed (its own output tokens, if it has any, are computed next)."""
        leader, forked = group.leader, []
        prompt_len = leader.num_prompt_tokens
        for member in list(group.parked):
            if self.kv.is_swapped(member.request_id):
                continue
            self.kv.fork(leader.request_id, member.request_id, prompt_len)
            if not member.output_token_ids:  # its first token comes from the leader's logits
                self.policy.charge_tokens(member, 0, 1)
            member.num_computed_tokens = prompt_len
            group.parked.remove(member)
            self._start_running(member)
            forked.append(member)
        return forked

    # --- helpers for the policies -----------------------------------------------------------
    def _chunk(self, num_new: int, budget: int, prefill: bool, recompute: bool = False) -> int:
        """How many of ``num_new`` tokens fit this step (0: none; the request waits).

        ``recompute``: the tokens are a preempted request's prompt and output, computed again;
        they are chunked even with chunked prefill off, since together they may exceed the
        budget, and the request would then never run again."""
        if prefill and self.config.long_prefill_token_threshold:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        if num_new <= budget:
            return num_new
        return budget if self.config.enable_chunked_prefill or recompute else 0

    def _flush_copies(self, output: SchedulerOutput) -> SchedulerOutput:
        """Move the copies on write decided so far into ``output``'s ordered transfers."""
        output.add_transfer("copy", self.kv.take_copies())
        return output

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = self.clock()
        self.running.append(request)
        self.loras.started(request)

    def _preempt(self, victim: Request, output: SchedulerOutput) -> list[Request]:
        """Preempt ``victim`` and every running sequence of its group (their KV by swap or
        recompute: :class:`~kvflow.orchestrator.scheduler.preemption.Preemptor`) and
        unschedule them. The first goes back to the queue front; a group's others are parked
        behind it. Returns the preempted sequences."""
        group = victim.group
        members = ([m for m in group.seqs if m.status == RequestStatus.RUNNING]
                   if group is not None else [victim])
        self.preemptor.evict(members, output)
        for m in members:
            self.running.remove(m)
            self.loras.stopped(m)
            m.spec_token_ids = []  # proposed for the state it loses
        output.scheduled = [s for s in output.scheduled if s.request not in members]
        self.waiting.appendleft(members[0])
        if group is not None:
            group.leader = members[0]
            group.parked = sorted([*group.parked, *members[1:]], key=lambda r: r.index)
        return members

    # --- introspection ----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_seats_taken(self) -> int:
        """Running sequences, and the parked members running leaders will fork."""
        return len(self.running) + sum(len(g.parked) for g in self.groups.values()
                                       if g.parked and g.leader.status == RequestStatus.RUNNING)

    def seats(self, request: Request) -> int:
        """Running slots admitting ``request`` takes: a group's leader brings its parked
        members (they fork off it, or swap in with it)."""
        return 1 + len(request.group.parked) if request.group is not None else 1

    def check_integrity(self) -> None:
        """KV pool consistent; exactly the running requests hold blocks, enough for their KV;
        a group's parked members hold no device block and wait for a leader in the queue or
        running; at most ``max_loras`` adapters run."""
        self.kv.check_integrity()
        for parent_id, group in self.groups.items():
            assert not group.is_finished, f"finished group {parent_id!r} still registered"
            for m in group.parked:
                assert m.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), m
                assert m.request_id not in self.kv.block_tables, m
                assert m not in self.waiting and m not in self.running, m
                assert m.num_computed_tokens == 0 or self.kv.is_swapped(m.request_id), m
            if group.parked:
                leader = group.leader
                assert leader in self.waiting or leader in self.running, leader
        holders = set(self.kv.block_tables)
        running = {r.request_id for r in self.running}
        assert holders <= running, f"blocks held by non-running requests {holders - running}"
        for r in self.running:
            assert r.status == RequestStatus.RUNNING, r
            have = len(self.kv.block_tables.get(r.request_id, ()))
            assert have >= self.kv.blocks_needed(r.num_computed_tokens), r
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r
            swapped = self.kv.is_swapped(r.request_id)
            assert r.num_computed_tokens == 0 or swapped, r
            assert r.request_id not in self.kv.block_tables, r
        assert self.num_seats_taken <= self.config.max_num_seqs
        self.loras.check_integrity(self.running)
