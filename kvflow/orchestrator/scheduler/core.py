"""Schedulers: which tokens of which requests run in the next step. Pure Python.

One base class holds the queues, admission checks (SLO admission included), deadlines,
preemption and bookkeeping; each batching policy is a small subclass with its own
``_schedule()``:

* :class:`ContinuousScheduler` (every queue policy of :mod:`kvflow.orchestrator.scheduler.policies`:
  ``fcfs``, ``priority``, ``cache_aware``, ``sjf``, ``fair``): in-flight batching with a
  token budget, chunked prefill, preemption by recompute or swap, and priority preemption.
* :class:`StaticBatchScheduler` (``static``): the baseline; a batch runs to completion.

The scheduler hands the engine a :class:`~kvflow.orchestrator.scheduler.output.SchedulerOutput`
and gets the sampled tokens back through :meth:`Scheduler.update_from_output` (vLLM v1's
handshake).

Parallel sampling (``n > 1``, a :class:`SequenceGroup`): the base class forks a group's parked
members off its leader once the leader's prompt is computed, and preempts, swaps and aborts a
group as one.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque

from kvflow.kv_manager import KVCacheManager
from kvflow.orchestrator.options import POLICIES, EngineOptions
from kvflow.orchestrator.outputs import OVERLOADED_PREFIX
from kvflow.orchestrator.request import Request, RequestStatus, SequenceGroup
from kvflow.orchestrator.scheduler.output import (
    Clock,
    Rejection,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from kvflow.orchestrator.scheduler.policies import QUEUE_POLICIES, QueuePolicy


class Scheduler:
    """Queues, admission control, deadlines, preemption and bookkeeping shared by every policy.

    Args:
        config: the limits and the policy.
        kv: the KV cache manager whose blocks every scheduled token must have.
        clock: seconds, monotonic; the simulator passes its own.
    """

    def __init__(self, config: EngineOptions, kv: KVCacheManager,
                 clock: Clock = time.monotonic) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # by sequence id
        self.groups: dict[str, SequenceGroup] = {}  # requests with n > 1, by the client's id
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of which found cached
        # The longest sequence that can ever be resident: the context limit or the whole pool.
        self.max_seq_len = min(config.max_model_len,
                               kv.pool.num_usable_blocks * kv.block_size)
        self.watermark_blocks = int(config.kv_watermark * kv.pool.num_usable_blocks)
        self.policy = QUEUE_POLICIES.get(config.policy, QueuePolicy)(config, kv, clock)
        # (deadline, tie, request): the requests with a deadline, soonest first; entries of
        # finished requests are dropped lazily (and all at once when they are the majority).
        self._deadlines: list[tuple[float, int, Request]] = []
        self._deadline_tie = itertools.count()
        # Prefill throughput measured over the steps, for SLO admission's prediction;
        # until a step is seen, the cost model's figure.
        self._prefill_tokens_ewma = 0.0
        self._prefill_time_ewma = 0.0

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
        params = request.sampling_params
        timeout_s = (params.timeout_ms / 1000 if params.timeout_ms is not None
                     else self.config.request_timeout_s)
        if timeout_s is not None:
            for m in members:
                m.deadline = request.arrival_time + timeout_s
            heapq.heappush(self._deadlines, (request.arrival_time + timeout_s,
                                             next(self._deadline_tie), request))
        self.waiting.append(request)
        return True

    def _rejection_reason(self, request: Request) -> Rejection | None:
        """Why ``request`` can never run, or cannot be queued now; None if it can.

        A request that cannot fit is refused rather than cut short (as vLLM does): prompt +
        ``max_tokens`` (or + ``min_tokens``) must fit ``max_model_len`` and the KV pool. With
        ``max_queue_delay_ms``, one whose predicted wait exceeds it is refused as overload
        (reject rather than serve late).
        """
        n, cfg, params = request.num_prompt_tokens, self.config, request.sampling_params
        if n == 0:
            return Rejection.bad_request("prompt must contain at least one token")
        for limit, what in ((cfg.max_model_len, "max_model_len"),
                            (self.max_seq_len, "the KV cache's capacity per sequence")):
            if n >= limit:
                return Rejection.bad_request(f"prompt has {n} tokens; {what} is {limit} tokens "
                                             "(prompt + at least one output token)")
            for name in ("max_tokens", "min_tokens"):
                want = getattr(params, name)
                if want and n + want > limit:
                    return Rejection.bad_request(
                        f"prompt has {n} tokens and {name} is {want}: {n + want} tokens, more "
                        f"than {what} ({limit} tokens)")
        if not cfg.enable_chunked_prefill and n > cfg.max_num_batched_tokens:
            return Rejection.bad_request(f"prompt has {n} tokens, more than "
                                         f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) "
                                         "with chunked prefill disabled")
        if params.n > cfg.max_num_seqs:
            return Rejection.bad_request(f"n is {params.n}; max_num_seqs is {cfg.max_num_seqs} "
                                         "(the n sequences of a request run together)")
        if params.n > 1:
            # The n sequences run (and are preempted) together, so together they must fit the
            # pool: the prompt's full blocks once, the rest of each sequence's own.
            bs, usable = self.kv.block_size, self.kv.pool.num_usable_blocks
            longest = n + (params.max_tokens or self.max_seq_len - n)
            need = n // bs + params.n * (-(-longest // bs) - n // bs)
            if need > usable:
                return Rejection.bad_request(
                    f"n is {params.n}: {params.n} sequences of up to {longest} tokens (prompt + "
                    f"max_tokens) need {need} KV blocks; the KV cache has {usable}")
        if len(self.waiting) >= cfg.max_waiting_requests:
            return Rejection(f"{OVERLOADED_PREFIX}: the waiting queue is full "
                             f"(max_waiting_requests={cfg.max_waiting_requests}); retry later",
                             "overloaded", "queue_full")
        if cfg.max_queue_delay_ms is not None:
            ahead, rate = self.queued_prefill_tokens(), self.prefill_tokens_per_s
            wait_ms = 1000 * ahead / rate
            if wait_ms > cfg.max_queue_delay_ms:
                return Rejection(f"{OVERLOADED_PREFIX}: predicted queue delay {wait_ms:.0f} ms "
                                 f"exceeds max_queue_delay_ms={cfg.max_queue_delay_ms:g} "
                                 f"({ahead} prompt tokens queued ahead, prefill at "
                                 f"{rate:.0f} tokens/s); retry later", "overloaded",
                                 "queue_delay")
        return None

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens (recomputation included) queued to be prefilled: those of the
        waiting requests and the rest of the running prefills."""
        waiting = sum(r.num_tokens - max(r.num_computed_tokens, r.num_transferred_tokens)
                      for r in self.waiting)
        running = sum(left for r in self.running
                      if (left := r.num_tokens - r.num_computed_tokens) > 1)
        return waiting + running

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prefill throughput, measured over recent steps that prefilled (an exponential
        average); ``recompute_tokens_per_s`` until one ran."""
        if self._prefill_time_ewma > 0:
            return self._prefill_tokens_ewma / self._prefill_time_ewma
        return self.config.recompute_tokens_per_s

    def observe_step(self, num_prefill_tokens: int, step_time_s: float,
                     alpha: float = 0.1) -> None:
        """The engine reports each step's prefill tokens and duration (its step statistics)."""
        if num_prefill_tokens <= 0 or step_time_s <= 0:
            return
        if self._prefill_time_ewma == 0:
            self._prefill_tokens_ewma, self._prefill_time_ewma = num_prefill_tokens, step_time_s
            return
        self._prefill_tokens_ewma += alpha * (num_prefill_tokens - self._prefill_tokens_ewma)
        self._prefill_time_ewma += alpha * (step_time_s - self._prefill_time_ewma)

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
        if self._deadlines:
            self._expire(out)
        self._schedule(out)
        return self._flush_copies(out)

    def _schedule(self, out: SchedulerOutput) -> None:
        raise NotImplementedError

    def _expire(self, out: SchedulerOutput) -> None:
        """Finish every request past its deadline (each unfinished sequence of a group) with
        ``timeout``, wherever it is: waiting, prefilling or decoding."""
        heap, now = self._deadlines, self.clock()
        while heap and heap[0][0] <= now:
            request = heapq.heappop(heap)[2]
            if (request.group or request).is_finished:
                continue
            members = request.group.unfinished if request.group is not None else [request]
            phase = ("waiting" if all(m.status != RequestStatus.RUNNING for m in members)
                     else "decode" if any(m.status == RequestStatus.RUNNING
                                          and m.num_computed_tokens + 1 >= m.num_tokens
                                          for m in members) else "prefill")
            for m in members:
                self.finish_request(m, RequestStatus.FINISHED_TIMEOUT)
            out.timed_out.append((request, phase))
        if len(heap) > 64 and len(heap) > 2 * len(self.requests):
            # NOTE: a group's entry is its first sequence, which may finish before the rest.
            self._deadlines = [e for e in heap if not (e[2].group or e[2]).is_finished]
            heapq.heapify(self._deadlines)

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
        for s in output.scheduled:
            request = s.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens = s.start + s.num_new_tokens
            if caching:
                self.kv.cache_blocks(request.request_id, request.token_ids,
                                     request.num_computed_tokens, request.cache_salt)
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
        """Append the request's sampled token, if it has one, and finish it if it stopped."""
        token = result.sampled_token_ids.get(request.request_id)
        if token is None:
            return
        request.append_output_token(token)
        m = request.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
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

    def _preempt(self, victim: Request, output: SchedulerOutput) -> list[Request]:
        """Preempt ``victim`` and every running sequence of its group, all by swap or all by
        recompute (see :meth:`_swap_is_cheaper`); unschedule them. The first goes back to the
        queue front; a group's others are parked behind it. Returns the preempted sequences."""
        group = victim.group
        members = ([m for m in group.seqs if m.status == RequestStatus.RUNNING]
                   if group is not None else [victim])
        if self._swap_is_cheaper(members):
            # Copies on write decided so far first: their blocks may be among those swapped.
            self._flush_copies(output)
            output.add_transfer("swap_out", self.kv.swap_out_many(
                [(m.request_id, m.num_computed_tokens) for m in members]))
            self.num_swapped_out += len(members)
        else:
            for m in members:
                self.kv.free(m.request_id, forget=False)
                m.num_computed_tokens = 0
        for m in members:
            self.running.remove(m)
            m.status = RequestStatus.PREEMPTED
            m.metrics.num_preemptions += 1
            self.num_preemptions += 1
            output.preempted.append(m)
        output.scheduled = [s for s in output.scheduled if s.request not in members]
        self.waiting.appendleft(members[0])
        if group is not None:
            group.leader = members[0]
            group.parked = sorted([*group.parked, *members[1:]], key=lambda r: r.index)
        return members

    def _swap_is_cheaper(self, members: list[Request]) -> bool:
        """Swap when forced, or (``auto``) when moving the KV out and back is estimated cheaper
        than recomputing it; never when the host pool lacks room or nothing is computed."""
        cfg = self.config
        items = [(m.request_id, m.num_computed_tokens) for m in members]
        n = sum(t for _, t in items)
        if (any(t == 0 for _, t in items) or cfg.preemption_mode == "recompute"
                or not self.kv.can_swap_out_many(items)):
            return False
        if cfg.preemption_mode == "swap":
            return True
        blocks = len(self.kv.distinct_blocks(items))
        swap_s = 2 * blocks * self.kv.bytes_per_block / cfg.swap_bytes_per_s
        return swap_s < n / cfg.recompute_tokens_per_s

    def _admission_chunk(self, request: Request, budget: int) -> tuple[int, list[int], int]:
        """What admitting ``request`` under ``budget`` would run: (tokens, its cached blocks,
        its cached tokens). A swapped-out request resumes from its computed tokens and reuses
        no cache; one whose KV was transferred in starts after it (in blocks of its own: it is
        no cache hit); any other starts after its longest cached prefix."""
        if request.num_transferred_tokens:
            num_done = request.num_transferred_tokens
            return self._chunk(request.num_tokens - num_done, budget, prefill=True), [], num_done
        if self.kv.is_swapped(request.request_id):
            remaining = request.num_tokens - request.num_computed_tokens
            return self._chunk(remaining, budget, prefill=remaining > 1), [], 0
        hits, num_cached = self.kv.get_computed_blocks(request.request_id, request.token_ids,
                                                       request.cache_salt)
        num_new = self._chunk(request.num_tokens - num_cached, budget, prefill=True,
                              recompute=request.num_output_tokens > 0)
        return num_new, hits, num_cached

    def _admit_tokens(self, request: Request, budget: int, reserve: int,
                      output: SchedulerOutput) -> int:
        """Give a waiting request its KV (swap-in, or cache hits + new blocks); tokens to run.

        Returns 0, changing nothing, when the request does not fit this step.
        """
        rid = request.request_id
        num_new, hits, num_cached = self._admission_chunk(request, budget)
        if self.kv.is_swapped(rid):
            # A swapped group comes back together: its parked swapped members with it.
            companions = [m for m in request.group.parked if self.kv.is_swapped(m.request_id)
                          ] if request.group is not None else []
            items = [(rid, request.num_computed_tokens + num_new),
                     *((m.request_id, m.num_computed_tokens) for m in companions)]
            pairs = self.kv.swap_in_many(items, reserve) if num_new else None
            if pairs is None:
                return 0
            self._flush_copies(output)
            output.add_transfer("swap_in", pairs)
            for m in companions:
                request.group.parked.remove(m)  # type: ignore[union-attr]
                self._start_running(m)
            return num_new
        if num_new == 0 or not self.kv.allocate_slots(rid, num_cached + num_new, reserve,
                                                      computed_blocks=hits):
            return 0
        request.num_computed_tokens = num_cached
        if request.num_transferred_tokens:
            request.num_transferred_tokens = 0  # in its blocks now; a recompute redoes them
        elif self.kv.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached
            if request.metrics.first_scheduled_time is None:
                request.metrics.cached_tokens = num_cached
        return num_new

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
        running."""
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


class ContinuousScheduler(Scheduler):
    """In-flight batching under a token budget, with chunked prefill and preemption; the
    admission order is the queue policy's (:mod:`kvflow.orchestrator.scheduler.policies`: ``fcfs``,
    ``priority``, ``cache_aware``, ``sjf``, ``fair``)."""

    def _schedule(self, out: SchedulerOutput) -> None:
        """Pick this step's tokens.

        Algorithm. There is no prefill or decode phase: each request has ``num_tokens`` known
        tokens of which ``num_computed_tokens`` have KV, and the step hands out a budget of
        ``max_num_batched_tokens``. (0) Requests past their deadline were finished and freed
        (:meth:`Scheduler.schedule`). (1) Running requests first, in admission order: each
        gets its remaining tokens (one for a decode, the next chunk of a prompt), clamped to
        the budget when chunked prefill is on. If its KV blocks cannot be allocated, the
        running request of lowest priority (largest value), newest arrival, is preempted (by
        swap to the host pool or by recompute, whichever ``preemption_mode`` and its cost
        model pick; back to the front of the queue, unscheduled if it was scheduled this
        step), until the allocation succeeds or the request itself was the victim. (2) Only
        if nothing was preempted, waiting requests are admitted in the policy's order while
        budget, ``max_num_seqs`` and free KV blocks allow: a swapped-out request gets its
        blocks back (copied in before the step), any other reuses its longest cached prefix
        and computes the rest. Admission keeps ``kv_watermark`` of the pool free (unless
        nothing runs) so that running requests can grow. A prompt that does not fit the
        remaining budget without chunking waits for a later step (head of line); a long
        prompt over ``max_long_partial_prefills`` is passed over for a later one. Under
        ``priority``, a request that cannot be admitted by KV blocks or by ``max_num_seqs``
        preempts running requests of strictly lower priority (lowest first; none preempted
        ``max_preemptions_per_request`` times already), when that makes it fit.
        """
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            remaining = len(request.token_ids) - request.num_computed_tokens
            num_new = 1 if remaining == 1 else self._chunk(
                remaining, budget, prefill=True, recompute=request.num_output_tokens > 0)
            if num_new == 0:
                i += 1
                continue
            total = request.num_computed_tokens + num_new
            while not self.kv.allocate_slots(request.request_id, total,
                                             num_computed_tokens=request.num_computed_tokens):
                before = {s.request: s.num_new_tokens for s in out.scheduled}
                indexes = {r: k for k, r in enumerate(self.running)}
                preempted = self._preempt(self._pick_victim(), out)
                budget += sum(before.get(r, 0) for r in preempted)
                # NOTE: before the break: the request's own group members ahead of it went too.
                i -= sum(1 for r in preempted if indexes[r] < i)
                if request in preempted:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens,
                                                      num_new))
                budget -= num_new
                i += 1
        admitted = set() if out.preempted else self._admit(out)
        # Admission charged what it admitted as it went (the next pick sees it).
        self.policy.charge(s for s in out.scheduled if s.request not in admitted)

    def _admit(self, out: SchedulerOutput) -> set[Request]:
        """Admit waiting requests in the policy's order (step 2 of :meth:`_schedule`);
        returns those admitted."""
        cfg = self.config
        skip: set[Request] = set()
        admitted: set[Request] = set()
        cap = cfg.max_long_partial_prefills
        num_long = sum(1 for r in self.running if self._is_long_prefill(r)) if cap else 0
        while self.waiting:
            budget = cfg.max_num_batched_tokens - out.num_batched_tokens
            if budget <= 0:
                break
            request = self.policy.pick(self.waiting, skip)
            if request is None:
                break
            long = cap is not None and self._is_long_prefill(request)
            if long and cap is not None and num_long >= cap:
                skip.add(request)  # a shorter prompt may go first
                continue
            num_new = self._try_admit(request, budget, out)
            if num_new == 0:
                num_new = self._preempt_for(request, out)
            if num_new == 0:
                break
            self.waiting.remove(request)
            self._start_running(request)
            scheduled = ScheduledRequest(request, request.num_computed_tokens, num_new)
            out.scheduled.append(scheduled)
            self.policy.charge((scheduled,))
            admitted.add(request)
            num_long += long
        return admitted

    def _try_admit(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Admit ``request`` if seats and KV allow; the tokens it runs (0: it does not fit)."""
        if self.num_seats_taken + self.seats(request) > self.config.max_num_seqs:
            return 0
        reserve = self.watermark_blocks if self.running else 0
        return self._admit_tokens(request, budget, reserve, out)

    def _preempt_for(self, request: Request, out: SchedulerOutput) -> int:
        """Priority preemption: preempt running requests that ``request`` outranks (the
        policy's :meth:`~kvflow.orchestrator.scheduler.policies.QueuePolicy.outranks`:
        strictly lower priority, both aged), in the policy's victim order, until ``request`` is
        admitted; only when preempting all those eligible would free the seats, the budget and
        the KV blocks it needs (so that none is preempted in vain). A group is preempted whole, and
        is eligible only while each of its running sequences has been preempted fewer than
        ``max_preemptions_per_request`` times. Returns the tokens ``request`` runs (0: not
        admitted, nothing preempted)."""
        cfg = self.config
        if not cfg.priority_preemption:
            return 0
        victims = sorted((r for r in self.running if self.policy.outranks(request, r)
                          and self._preemptible(r)), key=self.policy.victim_key, reverse=True)
        if not victims or not self._would_fit(request, victims, out):
            return 0
        for victim in victims:
            if victim.status != RequestStatus.RUNNING:
                continue  # went with its group
            self._preempt(victim, out)
            budget = cfg.max_num_batched_tokens - out.num_batched_tokens
            num_new = self._try_admit(request, budget, out) if budget > 0 else 0
            if num_new:
                return num_new
        return 0

    def _preemptible(self, request: Request) -> bool:
        """Under the thrash bound: every running sequence of its group (preempted together)."""
        seqs = request.group.seqs if request.group is not None else [request]
        return all(m.metrics.num_preemptions < self.config.max_preemptions_per_request
                   for m in seqs if m.status == RequestStatus.RUNNING)

    def _would_fit(self, request: Request, victims: list[Request],
                   out: SchedulerOutput) -> bool:
        """Whether ``request`` is admitted once every one of ``victims`` is preempted: seats
        (a running leader takes its parked members' with it), budget (the victims' tokens
        this step come back) and KV blocks (a block is freed only if the victims hold every
        reference to it; a cache hit costs a free block only if nothing else holds it)."""
        cfg, kv = self.config, self.kv
        gone = set(victims)
        seats = sum(1 + (len(v.group.parked) if v.group is not None and v is v.group.leader
                         else 0) for v in victims)
        if self.num_seats_taken - seats + self.seats(request) > cfg.max_num_seqs:
            return False
        budget = (cfg.max_num_batched_tokens - out.num_batched_tokens
                  + sum(s.num_new_tokens for s in out.scheduled if s.request in gone))
        held: dict[int, int] = {}
        for v in victims:
            for b in kv.block_tables.get(v.request_id, ()):
                held[b] = held.get(b, 0) + 1
        refs = kv.pool.ref_counts
        freed = {b for b, k in held.items() if refs[b] == k}
        num_new, hits, cached = self._admission_chunk(request, budget)
        if kv.is_swapped(request.request_id):
            need = kv.blocks_needed(request.num_computed_tokens + num_new)
        else:
            need = (kv.blocks_needed(cached + num_new) - len(hits)
                    + sum(1 for b in hits if refs[b] == 0 or b in freed))
        reserve = self.watermark_blocks if any(r not in gone for r in self.running) else 0
        return num_new > 0 and kv.num_free_blocks + len(freed) >= need + reserve

    def _is_long_prefill(self, request: Request) -> bool:
        """More tokens to prefill than ``long_prefill_token_threshold`` (the long-prompt cap)."""
        return (request.num_tokens - request.num_computed_tokens
                > self.config.long_prefill_token_threshold)

    def _pick_victim(self) -> Request:
        return max(self.running, key=self.policy.victim_key)


class StaticBatchScheduler(Scheduler):
    """Static batching, the baseline: gather up to B waiting requests, reserve KV for their
    whole length (prompt + max output), run them together to completion, admit nothing until
    the whole batch has finished. Never preempts."""

    def __init__(self, config: EngineOptions, kv: KVCacheManager,
                 clock: Clock = time.monotonic) -> None:
        super().__init__(config, kv, clock)
        self.batch_size = min(config.static_batch_size or config.max_num_seqs,
                              config.max_num_seqs)

    def _rejection_reason(self, request: Request) -> Rejection | None:
        if request.sampling_params.n > 1:
            return Rejection.bad_request("n > 1 (parallel sampling) needs a continuous policy, "
                                         "not static")
        return super()._rejection_reason(request)

    def _schedule(self, out: SchedulerOutput) -> None:
        if not self.running:
            self._form_batch()
        budget = self.config.max_num_batched_tokens
        for request in self.running:
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = self._chunk(remaining, budget, prefill=remaining > 1)
            if num_new == 0:
                continue
            out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
            budget -= num_new

    def _form_batch(self) -> None:
        while self.waiting and len(self.running) < self.batch_size:
            request = self.waiting[0]
            full = request.num_prompt_tokens + request.max_output_tokens
            if not self.kv.allocate_slots(request.request_id, full):
                break
            self.waiting.popleft()
            self._start_running(request)


SCHEDULERS: dict[str, type[Scheduler]] = {
    **{name: ContinuousScheduler for name in QUEUE_POLICIES},
    "static": StaticBatchScheduler,
}
# NOTE: the options name the policies (for validation and the CLI); each has a class here.
assert set(SCHEDULERS) == set(POLICIES), (sorted(SCHEDULERS), POLICIES)


def make_scheduler(config: EngineOptions, kv: KVCacheManager,
                   clock: Clock = time.monotonic) -> Scheduler:
    """The scheduler class registered for ``config.policy``."""
    return SCHEDULERS[config.policy](config, kv, clock)
