"""The engine step: schedule -> execute -> sample -> postprocess (detokenize, append, finish, emit).

:class:`LLMEngine` is synchronous: each :meth:`LLMEngine.step` runs one model step for
everything the scheduler picked and returns the outputs it produced. :class:`kvflow.LLM` and the
background :class:`~kvflow.orchestrator.async_engine.EngineLoop` (the Triton backend, the async
API) drive it. It imports no torch: the runner behind it may be anything implementing
:class:`kvflow.runtime.base.ModelRunner`, the simulator's included.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvflow.kv_manager import KVCacheManager
from kvflow.observability.trace import Entry, Finish, StepRecord, StepTracer
from kvflow.orchestrator.input_processor import InputProcessor, PreparedPrompt
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.outputs import (
    ENGINE_ERROR_PREFIX,
    CompletionOutput,
    EngineCounters,
    RequestOutput,
    StepStats,
)
from kvflow.orchestrator.request import Request, RequestMetrics, RequestStatus, SequenceGroup
from kvflow.orchestrator.sampling.params import MAX_SEED, SamplingParams
from kvflow.orchestrator.sampling.sampler import Sampler, SamplerOutput, SamplingRow, make_generator
from kvflow.orchestrator.sampling.structured import Grammar, allocate_bitmask, fill_bitmasks
from kvflow.orchestrator.scheduler.core import make_scheduler
from kvflow.orchestrator.scheduler.output import (
    TRANSFER_KINDS,
    Clock,
    RunnerOutput,
    SchedulerOutput,
)
from kvflow.runtime.base import ModelRunner
from kvflow.runtime.step_builder import SeqChunk, build_step, build_step_shape
from kvflow.text.detokenizer import IncrementalDetokenizer
from kvflow.text.tokenizer import EngineTokenizer, Prompt


class _RequestState:
    """Engine-side state of a live request (the scheduler owns the rest)."""

    __slots__ = ("detok", "generator", "grammar", "text", "logprobs", "emitted_tokens")

    def __init__(self, detok: IncrementalDetokenizer | None, generator: np.random.Generator,
                 want_logprobs: bool, grammar: Grammar | None = None) -> None:
        self.detok = detok
        self.generator = generator
        self.grammar = grammar  # the structured output's state, advanced token by token
        self.text = ""
        self.logprobs: list[dict[int, float]] | None = [] if want_logprobs else None
        self.emitted_tokens = 0

    def flush(self) -> str:
        """At the sequence's end: the text the detokenizer held back for a possible stop
        string (none once a stop string was found: the text ends there)."""
        if self.detok is None or self.detok.stopped:
            return ""
        return self.detok.finish()


class _Sampled(NamedTuple):
    """The sampling stage's result: the requests that sampled, their tokens, the sampler's
    output (logprobs), in one order."""

    requests: list[Request]
    token_ids: list[int]
    output: SamplerOutput | None


class LLMEngine:
    """Continuous-batching engine over one runner and one KV pool.

    Args:
        runner: executes steps; its ``num_blocks`` sizes the KV manager.
        tokenizer: the engine's tokenizer (None: token ids only, no text, no stop strings).
        options: the engine options (limits, policy, debug_checks; the KV and runner options
            are the caller's, who built ``runner``).
        eos_token_ids: ids that end a request (unless ``ignore_eos``).
        clock: monotonic seconds; the simulator passes its own.
        stats_window: how many recent :class:`StepStats` to keep.
        trace_source: what the step timeline says produced it (the simulator's says so).
    """

    def __init__(self, runner: ModelRunner, tokenizer: EngineTokenizer | None,
                 options: EngineOptions, eos_token_ids: Sequence[int] = (),
                 clock: Clock = time.monotonic, stats_window: int = 4096,
                 trace_source: str = "engine") -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = options
        self.clock = clock
        self.eos_token_ids = tuple(eos_token_ids)
        self.kv = KVCacheManager(runner.num_blocks, runner.engine.limits.block_size,
                                 enable_caching=options.enable_prefix_caching,
                                 num_host_blocks=runner.num_host_blocks,
                                 bytes_per_block=runner.engine.kv_bytes_per_block)
        self.scheduler = make_scheduler(options, self.kv, clock)
        self.sampler = Sampler(runner.engine.model.vocab_size, self.eos_token_ids)
        self.states: dict[str, _RequestState] = {}
        self.step_stats: deque[StepStats] = deque(maxlen=stats_window)
        self.counters = EngineCounters()  # written by this engine alone
        self._ids = itertools.count()
        # Tokenizing and grammar compiling: thread-safe, so the served loop runs it elsewhere.
        self.inputs = InputProcessor(tokenizer, runner.engine.model.vocab_size,
                                     self.eos_token_ids, options.max_model_len,
                                     check_token_ids=runner.reads_token_ids)
        # The step timeline (trace_steps); None: no step is recorded, tracing costs nothing.
        self.tracer = (StepTracer(options.trace_steps, options.trace_max_steps, trace_source)
                       if options.trace_steps else None)

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: Prompt | PreparedPrompt, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None,
                    cache_salt: str | None = None,
                    tenant: str | None = None,
                    kv_transferred: bool = False) -> tuple[Request, RequestOutput | None]:
        """Queue a request. Returns it, and a final output at once if it was rejected.

        ``prompt``: text, token ids, or a :class:`ChatPrompt` (rendered with the model's chat
        template), tokenized here by :attr:`inputs`; or what :attr:`inputs` prepared already
        (on another thread: the served engine's way). A prompt that cannot be tokenized (no
        tokenizer, a chat template error) raises ValueError. Requests with
        different ``cache_salt`` never share prefix-cache blocks; ``tenant`` names whom the
        request is accounted to (the OpenAI ``user``).

        ``kv_transferred``: the KV of every prompt token but the last was computed on another
        instance and arrives with the request (disaggregated serving: the prompt is the
        prefilled prompt followed by the token the prefill instance sampled). Admission then
        allocates blocks for it, waiting like any request while the pool lacks room, and
        computes only the last token; the transferred tokens count as no prefix-cache hit.
        """
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(prompt, PreparedPrompt):
            try:
                prompt = self.inputs.prepare(prompt, params)
            except ValueError as e:
                self.count_refused(e)
                raise
        prompt_ids, grammars = prompt.prompt_token_ids, prompt.grammars
        arrival = self.clock() if arrival_time is None else arrival_time
        n = params.n
        seqs = [Request(request_id if n == 1 else f"{request_id}#{j}", prompt_ids, params,
                        arrival, priority, self.eos_token_ids, self.config.max_model_len,
                        cache_salt, tenant, parent_id=request_id, index=j) for j in range(n)]
        request = seqs[0]
        if kv_transferred:  # the leader's; the other sequences of a group fork off its blocks
            request.num_transferred_tokens = len(prompt_ids) - 1
        if n > 1:
            SequenceGroup(request_id, seqs)
        if not self.scheduler.add_request(request):
            assert request.reject_cause is not None  # every rejection names its cause
            self.counters.rejected_by_cause[request.reject_cause] += 1
            return request, self._output(request, {})
        for seq in seqs:
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer.tokenizer, prompt_ids,
                                               params.skip_special_tokens, params.stop)
            # Sequence j of a seeded request draws from its own stream, seed + j.
            seed = None if params.seed is None else (params.seed + seq.index) % (MAX_SEED + 1)
            self.states[seq.request_id] = _RequestState(detok, make_generator(seed),
                                                        params.logprobs is not None,
                                                        grammars[seq.index])
        return request, None

    def count_refused(self, error: ValueError) -> None:
        """Count a request refused while it was prepared: bad input, unless the engine's."""
        if not str(error).startswith(ENGINE_ERROR_PREFIX):
            self.counters.rejected_by_cause["bad_request"] += 1

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request; its KV blocks are free when this returns."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return None
        if self.tracer is not None:  # the sequences this abort ended (not those done before)
            now = self.clock()
            for seq in request.group.seqs if request.group is not None else [request]:
                if seq.status == RequestStatus.FINISHED_ABORTED:
                    self._trace_end(seq, "abort", now)
        return self._output(request, {})

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --- the step: schedule -> execute -> sample -> postprocess ------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling decision and one model step; the outputs it produced.

        Four stages, each owning its decision: :meth:`_schedule` (the scheduler picks the
        tokens, preempts, swaps), :meth:`_execute` (the runner computes the logits),
        :meth:`_sample` (one token per sequence that reached its end), :meth:`_postprocess`
        (detokenize, then the scheduler appends the tokens and finishes what stopped: the one
        place a running request finishes, besides an abort). Then the step is recorded in
        :attr:`step_stats` and :attr:`counters`, and with ``debug_checks`` the invariants of
        the KV pool and the scheduler are checked.
        """
        t0 = self.clock()
        sched = self._schedule()
        timed_out = [self._timeout_output(request, phase, t0)
                     for request, phase in sched.timed_out]
        if sched.is_empty:
            if timed_out and self.config.debug_checks:
                self.scheduler.check_integrity()
            return timed_out
        t1 = self.clock()
        logits, greedy = self._execute(sched)
        t2 = self.clock()
        sampled = self._sample(sched, logits, greedy)
        t3 = self.clock()
        outputs = self._postprocess(sched, sampled)
        self._record(sched, outputs, sampled, (t0, t1, t2, t3, self.clock()))
        outputs = timed_out + outputs
        if self.config.debug_checks:
            self.scheduler.check_integrity()
        return outputs

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        # NOTE: before the step, even if nothing runs (swapped-out blocks may be rewritten by
        # the very next allocation), and in the scheduler's order: a swap-out frees blocks that
        # a later copy on write may reuse, and a copy must land before its block is swapped.
        for kind, pairs in sched.transfers:
            if kind == "copy":
                self.runner.copy_blocks(pairs)
            elif kind == "swap_out":
                self.runner.swap_out(pairs)
            else:
                self.runner.swap_in(pairs)
        self.counters.preemptions += len(sched.preempted)
        return sched

    def _execute(self, sched: SchedulerOutput) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The logits, or, when every row to sample is plain greedy, only their argmax (taken
        by the runner: no vocabulary-wide row crosses to the sampler)."""
        chunks = [SeqChunk(s.request.request_id, s.request.token_ids, s.start, s.num_new_tokens,
                           s.sample) for s in sched.scheduled]
        step = (build_step(self.kv, chunks) if self.runner.needs_inputs
                else build_step_shape(chunks))
        plain = self.sampler.is_plain_greedy
        if all(plain(s.request.sampling_params, len(s.request.output_token_ids))
               for s in sched.scheduled if s.sample):
            return None, self.runner.execute_argmax(step)
        return self.runner.execute(step), None

    def _sample(self, sched: SchedulerOutput, logits: np.ndarray | None,
                greedy: np.ndarray | None) -> _Sampled:
        requests = [s.request for s in sched.scheduled if s.sample]
        if not requests:
            return _Sampled([], [], None)
        # A group's first token: the leader's logits row is every parked member's too (each
        # samples it with its own stream), and the scheduler forks them when it appends.
        first = [r for r in requests if r.group is not None and r.group.parked
                 and r is r.group.leader and not r.output_token_ids]
        if first:
            row_of = list(range(len(requests)))
            for r in first:
                k = requests.index(r)
                members = [m for m in r.group.parked  # type: ignore[union-attr]
                           if not m.output_token_ids]
                requests.extend(members)
                row_of.extend([k] * len(members))
            if logits is not None:
                logits = logits[row_of]
            else:
                assert greedy is not None
                greedy = greedy[row_of]
        if logits is None:
            assert greedy is not None
            return _Sampled(requests, greedy.tolist(), None)
        states = [self.states[r.request_id] for r in requests]
        rows = [SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids,
                            st.generator) for r, st in zip(requests, states, strict=True)]
        constrained = [k for k, st in enumerate(states) if st.grammar is not None]
        if constrained:  # the grammars' next-token masks, for their rows alone
            bitmask = allocate_bitmask(len(constrained), self.sampler.vocab_size)
            fill_bitmasks([states[k].grammar for k in constrained],  # type: ignore[misc]
                          bitmask)
            for j, k in enumerate(constrained):
                rows[k].bitmask = bitmask[j]
        out = self.sampler.sample(logits, rows)
        return _Sampled(requests, out.token_ids, out)

    def _postprocess(self, sched: SchedulerOutput, sampled: _Sampled) -> list[RequestOutput]:
        """Detokenize the new tokens (finding stop strings), hand the tokens to the scheduler,
        which appends them and finishes the requests that stopped, then build the outputs."""
        deltas: list[str] = []
        stop_strings: dict[str, str] = {}
        grammar_done: set[str] = set()
        for request, token in zip(sampled.requests, sampled.token_ids, strict=True):
            state = self.states[request.request_id]
            detok = state.detok
            deltas.append(detok.step([token]) if detok is not None else "")
            if detok is not None and detok.stopped:
                stop_strings[request.request_id] = detok.stop_reason or ""
            # NOTE: a token the grammar refuses (it cannot be sampled: the mask bans it) would
            # leave the matcher in error, and is_stopped then ends the sequence.
            if state.grammar is not None and (not state.grammar.accept(token)
                                              or state.grammar.is_stopped):
                grammar_done.add(request.request_id)
        tokens = {r.request_id: t for r, t in zip(sampled.requests, sampled.token_ids,
                                                  strict=True)}
        self.scheduler.update_from_output(
            sched, RunnerOutput(tokens, stop_strings, grammar_done))
        # One output per request (a group's sequences together), in the order they sampled.
        new: dict[str, dict[int, tuple[int | None, str]]] = {}
        leaders: dict[str, Request] = {}
        for row, (request, token) in enumerate(zip(sampled.requests, sampled.token_ids,
                                                   strict=True)):
            state = self.states[request.request_id]
            delta = deltas[row]
            logprob = sampled.output.logprobs[row] if sampled.output is not None else None
            if state.logprobs is not None and sampled.output is not None and logprob is not None:
                entry = dict(sampled.output.top_logprobs[row] or [])
                entry[token] = logprob
                state.logprobs.append(entry)
            if request.is_finished:
                delta += state.flush()
            state.text += delta
            new.setdefault(request.parent_id, {})[request.index] = (token, delta)
            leaders.setdefault(request.parent_id,
                               request.group.seqs[0] if request.group else request)
        return [self._output(leaders[pid], news) for pid, news in new.items()]

    def _record(self, sched: SchedulerOutput, outputs: list[RequestOutput], sampled: _Sampled,
                times: tuple[float, float, float, float, float]) -> None:
        t0, t1, t2, t3, t4 = times
        num_decode = sched.num_decode_tokens
        num_prefill = sched.num_batched_tokens - num_decode
        c = self.counters
        c.prompt_tokens += num_prefill
        c.generation_tokens += len(sampled.token_ids)
        c.steps += 1
        c.step_time_s += t4 - t0
        c.prefix_cache_queries = self.scheduler.prefix_cache_queries
        c.prefix_cache_hits = self.scheduler.prefix_cache_hits
        self.scheduler.observe_step(num_prefill, t4 - t0)
        stats = StepStats(
            time=t4, num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_prefill_tokens=num_prefill, num_decode_tokens=num_decode,
            num_scheduled_seqs=len(sched.scheduled),
            kv_blocks_used=self.kv.pool.num_used_blocks, kv_usage=self.kv.usage,
            num_preempted=len(sched.preempted), schedule_time_s=t1 - t0,
            model_time_s=t2 - t1, sample_time_s=t3 - t2, postprocess_time_s=t4 - t3,
            num_timed_out=len(sched.timed_out),
            finished=[o.request_id for o in outputs if o.finished],
            scheduled=[(s.request.request_id, s.num_new_tokens) for s in sched.scheduled])
        self.step_stats.append(stats)
        if self.tracer is not None:
            self._trace(sched, sampled, times, stats)

    def _trace(self, sched: SchedulerOutput, sampled: _Sampled,
               times: tuple[float, float, float, float, float], stats: StepStats) -> None:
        """The step's record in the timeline: each chunk (with the arrival of a request
        scheduled for the first time), the preemptions and transfers, the sequences that
        ended (a forked member may end on the token it took from its leader's row), and the
        state after it (from the step's ``stats``)."""
        t0, t4 = times[0], times[-1]
        entries: list[Entry] = []
        for s in sched.scheduled:
            r = s.request
            m = r.metrics
            if s.is_decode:
                entries.append((r.request_id, "decode", 1, None, True))
                continue
            first = m.first_scheduled_time is not None and m.first_scheduled_time >= t0
            entries.append((r.request_id, "recompute" if m.num_preemptions else "prefill",
                            s.num_new_tokens, m.arrival_time if first else None, s.sample))
        # A sequence ends only on a token it sampled (aborts and timeouts are traced apart).
        finished: list[Finish] = [(r.request_id, r.status.finish_reason or "", t4, None)
                                  for r in sampled.requests if r.is_finished]
        transfers = {f"{kind}_blocks": sum(len(p) for k, p in sched.transfers if k == kind)
                     for kind in TRANSFER_KINDS}
        assert self.tracer is not None
        self.tracer.record(StepRecord(
            self.counters.steps, times, entries, [r.request_id for r in sched.preempted],
            transfers, stats.kv_usage, stats.kv_blocks_used, stats.num_running,
            stats.num_waiting, finished))

    def _trace_end(self, seq: Request, reason: str, now: float) -> None:
        """A sequence that ended outside a step (an abort, a timeout), with its arrival if
        it never ran (so that its wait is drawn)."""
        assert self.tracer is not None
        m = seq.metrics
        self.tracer.finish(seq.request_id, reason, now,
                           m.arrival_time if m.first_scheduled_time is None else None)

    def write_trace(self, path: str | None = None) -> Path | None:
        """Write the step timeline (to ``path``, default ``trace_steps``); None when tracing
        is off."""
        return self.tracer.write(path) if self.tracer is not None else None

    def close(self) -> None:
        """Write the step timeline (when tracing) and release the runner."""
        try:
            self.write_trace()
        finally:
            self.runner.close()

    def _timeout_output(self, request: Request, phase: str, now: float) -> RequestOutput:
        """The final output of a request the scheduler timed out (its partial text, the text
        held back for a possible stop string included)."""
        self.counters.timeouts_by_phase[phase] += 1
        new: dict[int, tuple[int | None, str]] = {}
        for seq in request.group.seqs if request.group is not None else [request]:
            state = self.states.get(seq.request_id)
            if seq.status != RequestStatus.FINISHED_TIMEOUT:
                continue
            if self.tracer is not None:
                self._trace_end(seq, "timeout", now)
            if state is not None:
                delta = state.flush()
                state.text += delta
                new[seq.index] = (None, delta)
        return self._output(request, new)

    def _output(self, request: Request,
                new: dict[int, tuple[int | None, str]]) -> RequestOutput:
        """The request's output (every sequence of a group), with ``new``: per sequence index,
        the token and text this step added. The last output of a request drops its state."""
        seqs = request.group.seqs if request.group is not None else [request]
        outputs = []
        for seq in seqs:
            state = self.states.get(seq.request_id)
            token, delta = new.get(seq.index, (None, ""))
            outputs.append(CompletionOutput(
                index=seq.index, text=state.text if state is not None else "",
                token_ids=list(seq.output_token_ids), delta_text=delta,
                delta_token_ids=[] if token is None else [token],
                finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason,
                logprobs=state.logprobs if state is not None else None))
        finished = all(seq.is_finished for seq in seqs)
        if finished:
            for seq in seqs:
                self.states.pop(seq.request_id, None)
            if request.status != RequestStatus.REJECTED:
                # A group's reason: an abort or a timeout if any sequence had one (so that it
                # matches kvflow_request_timeout_total), else its first sequence's.
                reasons = {o.finish_reason for o in outputs}
                reason = next((r for r in ("abort", "timeout") if r in reasons),
                              outputs[0].finish_reason or "abort")
                self.counters.finished_by_reason[reason] += 1
        return RequestOutput(
            request_id=request.parent_id, outputs=outputs, finished=finished,
            num_prompt_tokens=request.num_prompt_tokens, metrics=_request_metrics(seqs),
            error=request.reject_reason, error_code=request.reject_code,
            cached_tokens=request.metrics.cached_tokens)


def _request_metrics(seqs: list[Request]) -> RequestMetrics:
    """The request's metrics: a single sequence's own; a group's first sequence's (its token
    times), finished when the last sequence finished."""
    first = seqs[0].metrics
    if len(seqs) == 1:
        return first
    ends = [s.metrics.finished_time for s in seqs]
    m = RequestMetrics(**{**first.__dict__, "token_times": list(first.token_times)})
    m.finished_time = None if any(t is None for t in ends) else max(ends)  # type: ignore[type-var]
    m.num_preemptions = max(s.metrics.num_preemptions for s in seqs)
    return m
