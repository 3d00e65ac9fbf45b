"""Continuous batching: in-flight batching under a token budget. Pure Python.

Running requests go first, each getting its next tokens (a decode's one, a prompt's next
chunk); a KV shortage preempts the policy's victim. Then, if nothing was preempted, waiting
requests are admitted in the queue policy's order (:mod:`~kvflow.orchestrator.scheduler.policies`)
while the budget, the seats and the KV blocks allow; under ``priority`` a waiting request may
preempt running ones it outranks. The algorithm in full: :meth:`ContinuousScheduler._schedule`.
"""

from __future__ import annotations

from kvflow.kv_manager.block_pool import BlockPool
from kvflow.orchestrator.request import Request, RequestStatus, fans_out_first_token
from kvflow.orchestrator.scheduler.core import Scheduler
from kvflow.orchestrator.scheduler.output import ScheduledRequest, SchedulerOutput
from kvflow.orchestrator.scheduler.preemption import pick_victim, priority_victims

NULL_BLOCK = BlockPool.NULL_BLOCK


class ContinuousScheduler(Scheduler):
    """In-flight batching under a token budget, with chunked prefill and preemption; the
    admission order is the queue policy's (:mod:`kvflow.orchestrator.scheduler.policies`: ``fcfs``,
    ``priority``, ``cache_aware``, ``sjf``, ``fair``)."""

    _step_tokens = 0  # this step's whole budget (set by _schedule, read by admission)

    def _schedule(self, out: SchedulerOutput) -> None:
        """Pick this step's tokens.

        Algorithm. There is no prefill or decode phase: each request has ``num_tokens`` known
        tokens of which ``num_computed_tokens`` have KV, and the step hands out a token
        budget (:meth:`_budget_of_step`: what fits the target step time ``max_step_ms`` at
        the measured cost per token, within ``max_num_batched_tokens``; at least a token per
        running request and one more). (0) Requests past their deadline were finished and
        freed (:meth:`Scheduler.schedule`). (1) Running requests first, in admission order:
        each gets its remaining tokens (one for a decode, the next chunk of a prompt),
        clamped when chunked prefill is on to the budget less a token for each decode still
        behind it (no decode waits for a prompt: stall-free batching, as Sarathi-Serve's);
        a decode with draft tokens (speculative
        decoding) gets them too, if they fit without preempting anything. If its KV blocks
        cannot be allocated, the
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
        budget = self._step_tokens = self._budget_of_step()
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            remaining = len(request.token_ids) - request.num_computed_tokens
            if remaining == 1 and request.spec_token_ids and self._schedule_drafts(
                    request, budget, len(self.running) - i, out):
                budget -= out.scheduled[-1].num_new_tokens
                i += 1
                continue
            num_new = 1 if remaining == 1 else self._chunk(
                remaining, max(budget - self._decodes_after(i), 0), prefill=True,
                recompute=request.num_output_tokens > 0)
            if num_new == 0:
                i += 1
                continue
            total = request.num_computed_tokens + num_new
            while not self.kv.allocate_slots(request.request_id, total,
                                             num_computed_tokens=request.num_computed_tokens):
                before = {s.request: s.num_new_tokens for s in out.scheduled}
                indexes = {r: k for k, r in enumerate(self.running)}
                preempted = self._preempt(pick_victim(self.running, self.policy), out)
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

    def _budget_of_step(self) -> int:
        """This step's budget: :attr:`token_budget` (from the target step time), raised to a
        token for each running request and one more, so that no decode is starved and a
        prompt always advances, within ``max_num_batched_tokens``."""
        return min(self.config.max_num_batched_tokens,
                   max(self.token_budget, len(self.running) + 1))

    def _decodes_after(self, i: int) -> int:
        """Running decodes behind ``running[i]``: a prefill chunk leaves them their token."""
        return sum(1 for r in self.running[i + 1:] if len(r.token_ids) - r.num_computed_tokens
                   == 1)

    def _schedule_drafts(self, request: Request, budget: int, num_behind: int,
                         out: SchedulerOutput) -> bool:
        """Schedule a decode with its draft tokens (speculative decoding), if the budget and
        the free KV blocks allow. Drafts never take what a plain decode would need: they
        leave a token of the budget and a free block for each of the ``num_behind`` running
        requests still to schedule (this one included), and drafts that do not fit are
        dropped (the decode is then scheduled plainly). Whether it was scheduled."""
        num_spec = 0 if fans_out_first_token(request) else min(len(request.spec_token_ids),
                                                                 budget - num_behind)
        computed = request.num_computed_tokens
        if num_spec > 0 and self.kv.allocate_slots(request.request_id, computed + 1 + num_spec,
                                                   reserve=num_behind,
                                                   num_computed_tokens=computed):
            out.scheduled.append(ScheduledRequest(request, computed, 1 + num_spec, num_spec))
            return True
        request.spec_token_ids = []
        return False

    def _admit(self, out: SchedulerOutput) -> set[Request]:
        """Admit waiting requests in the policy's order (step 2 of :meth:`_schedule`);
        returns those admitted."""
        cfg = self.config
        skip: set[Request] = set()
        admitted: set[Request] = set()
        cap = cfg.max_long_partial_prefills
        num_long = sum(1 for r in self.running if self._is_long_prefill(r)) if cap else 0
        self.loras.blocked = False
        while self.waiting:
            budget = self._step_tokens - out.num_batched_tokens
            if budget <= 0:
                break
            request = self.policy.pick(self.waiting, skip)
            if request is None:
                break
            long = cap is not None and self._is_long_prefill(request)
            if long and cap is not None and num_long >= cap:
                skip.add(request)  # a shorter prompt may go first
                continue
            if self._prefix_loading(request):
                skip.add(request)  # its prefix loads from a tier off this thread: others go
                continue
            num_new = self._try_admit(request, budget, out)
            if num_new == 0:
                num_new = self._preempt_for(request, out)
            if num_new == 0 and not self.loras.admits(request):
                # It waits for a LoRA slot, not for KV or budget: others may go, but no
                # adapter's request after it (lora_gate: it is not starved).
                self.loras.blocked = True
                # Every later adapter request is refused now: skip them all at once, or each
                # pick would scan past the others (quadratic in a long queue).
                skip.update(r for r in self.waiting if r.lora_name is not None)
                continue
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

    def _from_tiers(self, request: Request) -> bool:
        """Whether ``request``'s prefix may come from the KV tiers: tiers exist, and its KV is
        neither transferred in nor swapped out."""
        return (self.kv.tiers is not None and not request.num_transferred_tokens
                and not self.kv.is_swapped(request.request_id))

    def _prefix_loading(self, request: Request) -> bool:
        """Whether ``request``'s prefix is still loading from the KV tiers (started here)."""
        return self._from_tiers(request) and self.kv.prefetch_prefix(
            request.request_id, request.token_ids, request.cache_key)

    def _try_admit(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Admit ``request`` if seats and KV allow; the tokens it runs (0: it does not fit)."""
        if self.num_seats_taken + self.seats(request) > self.config.max_num_seqs:
            return 0
        if not self.loras.admits(request):
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
        victims = priority_victims(request, self.running, self.policy,
                                   cfg.max_preemptions_per_request)
        if not victims or not self._would_fit(request, victims, out):
            return 0
        for victim in victims:
            if victim.status != RequestStatus.RUNNING:
                continue  # went with its group
            self._preempt(victim, out)
            budget = self._step_tokens - out.num_batched_tokens
            num_new = self._try_admit(request, budget, out) if budget > 0 else 0
            if num_new:
                return num_new
        return 0

    def _would_fit(self, request: Request, victims: list[Request],
                   out: SchedulerOutput) -> bool:
        """Whether ``request`` is admitted once every one of ``victims`` is preempted: seats
        (a running leader takes its parked members' with it), budget (the victims' tokens
        this step come back), LoRA slots and KV blocks (a block is freed only if the victims
        hold every reference to it; a cache hit costs a free block only if nothing else holds
        it)."""
        cfg, kv = self.config, self.kv
        gone = set(victims)
        seats = sum(1 + (len(v.group.parked) if v.group is not None and v is v.group.leader
                         else 0) for v in victims)
        if self.num_seats_taken - seats + self.seats(request) > cfg.max_num_seqs:
            return False
        leaving = {m for v in victims for m in (v.group.seqs if v.group is not None else [v])
                   if m.status == RequestStatus.RUNNING}
        if not self.loras.admits(request, leaving):
            return False
        budget = (self._step_tokens - out.num_batched_tokens
                  + sum(s.num_new_tokens for s in out.scheduled if s.request in gone))
        held: dict[int, int] = {}
        for v in victims:
            for b in kv.block_tables.get(v.request_id, ()):
                held[b] = held.get(b, 0) + 1
        refs = kv.pool.ref_counts
        # The null block (entries released past a sliding window) is never freed nor taken.
        freed = {b for b, k in held.items() if refs[b] == k and b != NULL_BLOCK}
        num_new, hits, cached = self._admission_chunk(request, budget)
        if kv.is_swapped(request.request_id):
            need = (kv.blocks_needed(request.num_computed_tokens + num_new)
                    - kv.host_tables[request.request_id].count(NULL_BLOCK))
        else:
            need = (kv.blocks_needed(cached + num_new) - len(hits)
                    + sum(1 for b in hits if b != NULL_BLOCK and (refs[b] == 0 or b in freed)))
        reserve = self.watermark_blocks if any(r not in gone for r in self.running) else 0
        return num_new > 0 and kv.num_free_blocks + len(freed) >= need + reserve

    def _is_long_prefill(self, request: Request) -> bool:
        """More tokens to prefill than ``long_prefill_token_threshold`` (the long-prompt cap)."""
        return (request.num_tokens - request.num_computed_tokens
                > self.config.long_prefill_token_threshold)

    def _admission_chunk(self, request: Request, budget: int) -> tuple[int, list[int], int]:
        """What admitting ``request`` under ``budget`` would run: (tokens, its cached blocks,
        its cached tokens). A swapped-out request resumes from its computed tokens and reuses
        no cache; one whose KV was transferred in starts after it (in blocks of its own: it is
        no cache hit); one that asks for prompt logprobs, and has not had them, takes the
        cached blocks whose prompt logprobs are kept too (a cached block has no logits:
        :class:`~kvflow.kv_manager.prompt_logprobs_cache.PromptLogprobsCache`); any other
        starts after its longest cached prefix."""
        if request.num_transferred_tokens:
            num_done = request.num_transferred_tokens
            return self._chunk(request.num_tokens - num_done, budget, prefill=True), [], num_done
        if self.kv.is_swapped(request.request_id):
            remaining = request.num_tokens - request.num_computed_tokens
            return self._chunk(remaining, budget, prefill=remaining > 1), [], 0
        token_ids = request.token_ids
        if self.kv.sliding_window is not None and _forks_at_prompt_end(request):
            # Its parked members fork off it at the prompt's end and see the window there: a
            # hit past it (its own outputs, recomputed) would have released their blocks.
            token_ids = token_ids[:request.num_prompt_tokens + 1]
        hits, num_cached = self.kv.get_computed_blocks(request.request_id, token_ids,
                                                       request.cache_key)
        if hits and _needs_prompt_logits(request):
            # Cut where the kept prompt logprobs end (under a window, a cut must still hold
            # the blocks its next token's window reaches).
            hits = self.kv.trim_hit(hits, self._num_with_prompt_logprobs(request, len(hits)))
            num_cached = len(hits) * self.kv.block_size
        num_new = self._chunk(request.num_tokens - num_cached, budget, prefill=True,
                              recompute=request.num_output_tokens > 0)
        return num_new, hits, num_cached

    def _admit_tokens(self, request: Request, budget: int, reserve: int,
                      output: SchedulerOutput) -> int:
        """Give a waiting request its KV (swap-in, or cache hits + new blocks); tokens to run.

        Returns 0, changing nothing, when the request does not fit this step.
        """
        rid = request.request_id
        if self._from_tiers(request):
            # The prefix continues in the host / disk tiers: back into the pool first, as
            # cached blocks (written by the engine before the step), then hit like any other.
            self.kv.restore_prefix(rid, request.token_ids, request.cache_key,
                                   self.kv.num_free_blocks - reserve - 1,
                                   bool(request.cache_salt), request.lora_id)
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
            if _needs_prompt_logits(request):  # cached, but their prompt logprobs are not
                _, num_found = self.kv.get_computed_blocks(rid, request.token_ids,
                                                           request.cache_key)
                self.prompt_logprobs_recomputed_tokens += num_found - num_cached
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached
            if request.metrics.first_scheduled_time is None:
                request.metrics.cached_tokens = num_cached
        return num_new

    def _num_with_prompt_logprobs(self, request: Request, num_hits: int) -> int:
        """Of a prompt's first ``num_hits`` cached blocks, how many lead with their prompt
        logprobs kept (for the request's ``prompt_logprobs``)."""
        plc = self.kv.prompt_logprobs
        if plc is None:
            return 0
        hashes = self.kv.block_hashes(request.request_id, request.token_ids, request.cache_key)
        k = request.sampling_params.prompt_logprobs or 0
        return plc.num_usable(hashes, request.prompt_token_ids, k, num_hits)


def _forks_at_prompt_end(request: Request) -> bool:
    """Whether ``request`` leads a group with parked members: they fork off it once its
    prompt is computed (or, swapped out, come back with it)."""
    return request.group is not None and bool(request.group.parked)


def _needs_prompt_logits(request: Request) -> bool:
    """Whether admitting ``request`` must compute its prompt whole, cache or not: it asks for
    prompt logprobs, and has not had them (they are whole once it has an output token)."""
    return (request.sampling_params.prompt_logprobs is not None
            and not request.output_token_ids)
