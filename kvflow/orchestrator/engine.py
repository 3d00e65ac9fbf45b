"""The engine step: schedule -> execute -> sample -> postprocess (detokenize, append, finish, emit).

:class:`LLMEngine` is synchronous: each :meth:`LLMEngine.step` runs one model step for
everything the scheduler picked and returns the outputs it produced. :class:`kvflow.LLM` and the
background :class:`~kvflow.orchestrator.engine_loop.EngineLoop` (the Triton backend, the async
API) drive it. It imports no torch: the runner behind it may be anything implementing
:class:`kvflow.runtime.base.ModelRunner`, the simulator's included.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from kvflow.kv_manager import KVCacheManager
from kvflow.observability.trace import StepTimes, StepTracer
from kvflow.orchestrator.engine_lora import LoraEngine
from kvflow.orchestrator.engine_tiers import after_schedule, attach_tiers, close_tiers
from kvflow.orchestrator.input_processor import InputProcessor, PreparedPrompt
from kvflow.orchestrator.memory_budget import MemoryBudget
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.output_processor import OutputProcessor, SampledTokens
from kvflow.orchestrator.outputs import (
    EngineCounters,
    ErrorCode,
    RequestOutput,
    StepStats,
    error_code_of,
)
from kvflow.orchestrator.request import Request, RequestStatus, SequenceGroup, fan_out_first_tokens
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.orchestrator.sampling.sampler import Sampler
from kvflow.orchestrator.scheduler.output import Clock, SchedulerOutput
from kvflow.orchestrator.scheduler.registry import make_scheduler
from kvflow.orchestrator.scheduler.step_budget import default_max_step_ms
from kvflow.orchestrator.speculative.decoder import SpeculativeDecoder
from kvflow.orchestrator.speculative.proposers import Proposer, make_proposer
from kvflow.orchestrator.step_recorder import StepRecorder
from kvflow.runtime.base import ModelRunner
from kvflow.runtime.step_builder import SeqChunk, build_step, build_step_shape
from kvflow.text.tokenizer import EngineTokenizer, Prompt


class LLMEngine(LoraEngine):
    """Continuous-batching engine over one runner and one KV pool (and LoRA adapters, with
    the options' ``enable_lora`` or ``lora_modules``: :class:`LoraEngine`).

    Args:
        runner: executes steps; its ``num_blocks`` sizes the KV manager.
        tokenizer: the engine's tokenizer (None: token ids only, no text, no stop strings).
        options: the engine options (limits, policy, debug_checks; the KV and runner options
            are the caller's, who built ``runner``). ``max_step_ms`` None takes the runner's
            default (:func:`~kvflow.orchestrator.scheduler.step_budget.default_max_step_ms`):
            :attr:`options` holds the value in force.
        eos_token_ids: ids that end a request (unless ``ignore_eos``).
        clock: monotonic seconds; the simulator passes its own.
        stats_window: how many recent :class:`StepStats` to keep.
        trace_source: what the step timeline says produced it (the simulator's says so).
    """

    def __init__(self, runner: ModelRunner, tokenizer: EngineTokenizer | None,
                 options: EngineOptions, eos_token_ids: Sequence[int] = (),
                 clock: Clock = time.monotonic, stats_window: int = 4096,
                 trace_source: str = "engine", proposer: Proposer | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.memory_budget: MemoryBudget | None = None  # create_engine's sizing, when it made it
        if options.max_step_ms is None:
            # The runner decides the default target step time (200 ms on a CPU runner); with
            # chunked prefill off there is none, since a prompt cannot be split to fit it.
            options = replace(options, max_step_ms=default_max_step_ms(runner.name)
                              if options.enable_chunked_prefill else 0.0)
        self.options = options
        self.clock = clock
        self.eos_token_ids = tuple(eos_token_ids)
        self.kv = KVCacheManager(runner.num_blocks, runner.block_size,
                                 enable_caching=options.enable_prefix_caching,
                                 num_host_blocks=runner.num_host_blocks,
                                 bytes_per_block=runner.kv_bytes_per_block,
                                 sliding_window=runner.sliding_window)
        attach_tiers(self.kv, options, runner)  # host / disk tiers below the pool, if asked
        self.scheduler = make_scheduler(options, self.kv, clock)
        self.sampler = Sampler(runner.vocab_size, self.eos_token_ids)
        self.counters = EngineCounters()  # written by this engine (and its output processor)
        self._init_lora(runner, options)
        self._ids = itertools.count()
        # Tokenizing and grammar compiling: thread-safe, so the served loop runs it elsewhere.
        self.inputs = InputProcessor(tokenizer, runner.vocab_size,
                                     self.eos_token_ids, options.max_model_len,
                                     check_token_ids=runner.reads_token_ids)
        # Text, logprobs and outputs: the one owner of each live sequence's output state.
        self.outputs = OutputProcessor(tokenizer, self.counters, self.kv)
        # The step statistics, the counters' per-step totals and the step timeline (trace_steps;
        # without it no step is recorded there, and tracing costs nothing).
        self.recorder = StepRecorder(
            self.scheduler, self.kv, self.counters, clock, stats_window,
            StepTracer(options.trace_steps, options.trace_max_steps, trace_source)
            if options.trace_steps else None)
        # Speculative decoding (options.speculative, or the caller's ``proposer``): drafts
        # after each step, verified in the next. A draft model's proposer is the caller's,
        # who opened its engine (the simulator's too).
        self.speculation: SpeculativeDecoder | None = None
        if (options.speculative is not None or proposer is not None) and \
                self.scheduler.speculates:
            if proposer is None:
                assert options.speculative is not None
                proposer = make_proposer(options.speculative)
            self.speculation = SpeculativeDecoder(proposer, options.num_speculative_tokens,
                                                  options.speculative_draft_length == "dynamic",
                                                  token_budget=options.max_num_batched_tokens)
            # A proposer that draws by the race needs a sampler that races too (verify).
            self.sampler.coupled = proposer.coupled

    @property
    def step_stats(self) -> deque[StepStats]:
        """The recent steps' statistics (the last ``stats_window``)."""
        return self.recorder.step_stats

    @property
    def tracer(self) -> StepTracer | None:
        """The step timeline's ring (None: tracing is off)."""
        return self.recorder.tracer

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: Prompt | PreparedPrompt, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None,
                    cache_salt: str | None = None,
                    tenant: str | None = None, kv_transferred: bool = False,
                    lora_name: str | None = None) -> tuple[Request, RequestOutput | None]:
        """Queue a request. Returns it, and a final output at once if it was rejected.

        ``prompt``: text, token ids, or a :class:`ChatPrompt` (rendered with the model's chat
        template), tokenized here by :attr:`inputs`; or what :attr:`inputs` prepared already
        (on another thread: the served engine's way). A prompt that cannot be tokenized (no
        tokenizer, a chat template error) raises ValueError. Requests with
        different ``cache_salt`` never share prefix-cache blocks; ``tenant`` names whom the
        request is accounted to (the OpenAI ``user``); ``lora_name``: the LoRA adapter it runs
        under (None: the base; one not loaded is refused, naming the field ``model``).

        ``kv_transferred``: the KV of every prompt token but the last was computed on another
        instance and arrives with the request (disaggregated serving: the prompt is the
        prefilled prompt followed by the token the prefill instance sampled). Admission then
        allocates blocks for it, waiting like any request while the pool lacks room, and
        computes only the last token; the transferred tokens count as no prefix-cache hit.
        Prompt logprobs need the prompt computed here, and a runner that reads its tokens.
        """
        params = params or SamplingParams()
        if params.prompt_logprobs is not None and (kv_transferred
                                                   or not self.runner.reads_token_ids):
            why = ("the prompt's KV was transferred, not computed here" if kv_transferred
                   else f"the {self.runner.name} runner computes no logits of real tokens")
            error = ValueError(f"prompt_logprobs cannot be given here: {why}")
            self.count_refused(error)
            raise error
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        try:
            lora = self.lora_fields(lora_name)
            if not isinstance(prompt, PreparedPrompt):
                prompt = self.inputs.prepare(prompt, params)
        except ValueError as e:
            self.count_refused(e)
            raise
        prompt_ids, grammars = prompt.prompt_token_ids, prompt.grammars
        arrival = self.clock() if arrival_time is None else arrival_time
        n = params.n
        seqs = [Request(request_id if n == 1 else f"{request_id}#{j}", prompt_ids, params,
                        arrival, priority, self.eos_token_ids, self.options.max_model_len,
                        cache_salt, tenant, parent_id=request_id, index=j, **lora)
                for j in range(n)]
        request = seqs[0]
        if kv_transferred:  # the leader's; the other sequences of a group fork off its blocks
            request.num_transferred_tokens = len(prompt_ids) - 1
        if n > 1:
            SequenceGroup(request_id, seqs)
        if not self.scheduler.add_request(request):
            assert request.reject_cause is not None  # every rejection names its cause
            self.counters.rejected_by_cause[request.reject_cause] += 1
            return request, self.outputs.output(request)
        self.outputs.add_request(seqs, grammars)
        return request, None

    def count_refused(self, error: Exception) -> None:
        """Count a request refused while it was prepared: bad input, unless the engine's."""
        if error_code_of(error) == ErrorCode.BAD_REQUEST:
            self.counters.rejected_by_cause["bad_request"] += 1

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request; its KV blocks are free when this returns."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return None
        self.recorder.ended(request, RequestStatus.FINISHED_ABORTED)
        return self.outputs.output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --- the step: schedule -> execute -> sample -> postprocess ------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling decision and one model step; the outputs it produced.

        Four stages, each owning its decision: :meth:`_schedule` (the scheduler picks the
        tokens, preempts, swaps), :meth:`_execute` (the runner computes the logits),
        :meth:`_sample` (one token per sequence that reached its end), :meth:`_postprocess`
        (detokenize, then the scheduler appends the tokens and finishes what stopped: the one
        place a running request finishes, besides an abort). Then :attr:`recorder` writes the
        step down (:attr:`step_stats`, :attr:`counters`, the timeline), and with
        ``debug_checks`` the invariants of the KV pool and the scheduler are checked.
        """
        t0 = self.clock()
        sched = self._schedule()
        timed_out = [self._timeout_output(request, phase, t0)
                     for request, phase in sched.timed_out]
        if sched.is_empty:
            if timed_out and self.options.debug_checks:
                self.scheduler.check_integrity()
            return timed_out
        t1 = self.clock()
        logits, greedy = self._execute(sched)
        t2 = self.clock()
        sampled = self._sample(sched, logits, greedy)
        t3 = self.clock()
        outputs = self._postprocess(sched, sampled)
        if self.speculation is not None:
            self._propose(sched, t0)
        self.recorder.record(sched, outputs, sampled, StepTimes(t0, t1, t2, t3, self.clock()))
        outputs = timed_out + outputs
        if self.options.debug_checks:
            self.scheduler.check_integrity()
            if self.lora is not None:
                self.lora.check_integrity()
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
        after_schedule(self.kv, self.runner, sched)  # restored prefixes; wait for a load
        self.counters.preemptions += len(sched.preempted)  # NOTE: the one count of them
        return sched

    def _execute(self, sched: SchedulerOutput) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The logits of the rows to sample, or, when every one is plain greedy and no
        sequence wants prompt logprobs, only their argmax (taken by the runner: no
        vocabulary-wide row crosses to the sampler). Prompt logprobs are taken here, from
        the chunk's own rows, and go to :attr:`outputs`."""
        chunks = []
        prompt_rows = False
        lora_slots = self._lora_slots(sched)
        for s in sched.scheduled:
            request = s.request
            rows = (self.outputs.prompt_rows(request, s.start, s.num_new_tokens)
                    if request.sampling_params.prompt_logprobs is not None else range(0))
            prompt_rows = prompt_rows or bool(rows)
            chunks.append(SeqChunk(request.request_id, s.token_ids(), s.start,
                                   s.num_new_tokens, s.sample, rows, s.num_spec_tokens,
                                   lora_slots.get(request.lora_name, -1)))
        step = (build_step(self.kv, chunks) if self.runner.needs_inputs
                else build_step_shape(chunks))
        plain = self.sampler.is_plain_greedy
        if not prompt_rows and all(plain(s.request.sampling_params,
                                         len(s.request.output_token_ids))
                                   for s in sched.scheduled if s.sample):
            return None, self.runner.execute_argmax(step)
        logits = self.runner.execute(step)
        if not prompt_rows:
            return logits, None
        sample_rows: list[int] = []
        row = 0
        vocab = self.runner.vocab_size
        for s, chunk in zip(sched.scheduled, chunks, strict=True):
            if chunk.prompt_rows:
                end = row + len(chunk.prompt_rows)
                self.outputs.add_prompt_logprobs(s.request, chunk.prompt_rows,
                                                 logits[row:end, :vocab])
                row = end
            if s.sample:
                sample_rows.extend(range(row, row + 1 + s.num_spec_tokens))
                row += 1 + s.num_spec_tokens
        return logits[sample_rows], None

    def _sample(self, sched: SchedulerOutput, logits: np.ndarray | None,
                greedy: np.ndarray | None) -> SampledTokens:
        """Each sampling sequence's new tokens: one sampled from its row, or for a sequence
        with drafts (speculative decoding, ``1 + drafts`` rows) the tokens verification
        emits."""
        scheduled = [s for s in sched.scheduled if s.sample]
        if not any(s.num_spec_tokens for s in scheduled):
            return self._sample_rows([s.request for s in scheduled], logits, greedy)
        assert self.speculation is not None
        plain_rows: list[int] = []
        spec_rows: list[slice] = []
        row = 0
        for s in scheduled:
            if s.num_spec_tokens:
                spec_rows.append(slice(row, row + 1 + s.num_spec_tokens))
            else:
                plain_rows.append(row)
            row += 1 + s.num_spec_tokens
        plain = self._sample_rows(
            [s.request for s in scheduled if not s.num_spec_tokens],
            None if logits is None else logits[plain_rows],
            None if greedy is None else greedy[plain_rows])
        spec = [s for s in scheduled if s.num_spec_tokens]
        drafts = [s.request.spec_token_ids[:s.num_spec_tokens] for s in spec]
        tokens, entries = self.speculation.verify(
            self.sampler, [s.request for s in spec], drafts,
            None if logits is None else [logits[r] for r in spec_rows],
            None if greedy is None else [greedy[r] for r in spec_rows],
            self.outputs.sampling_row)
        logprobs = None
        if plain.logprobs is not None or any(e is not None for e in entries):
            logprobs = (plain.logprobs or [None] * len(plain.requests)) + entries
        return SampledTokens(plain.requests + [s.request for s in spec],
                             plain.token_ids + tokens, logprobs,
                             [0] * len(plain.requests) + [len(d) for d in drafts])

    def _sample_rows(self, requests: list[Request], logits: np.ndarray | None,
                     greedy: np.ndarray | None) -> SampledTokens:
        """One token for each of ``requests`` from its row of ``logits`` (or ``greedy``)."""
        if not requests:
            return SampledTokens([], [])
        # A group's first token: its parked members sample from their leader's row.
        requests, row_of = fan_out_first_tokens(requests)
        if row_of is not None:
            if logits is not None:
                logits = logits[row_of]
            else:
                assert greedy is not None
                greedy = greedy[row_of]
        if logits is None:
            assert greedy is not None
            return SampledTokens.of(requests, greedy.tolist())
        out = self.sampler.sample(logits,
                                  self.outputs.sampling_rows(requests, self.sampler.vocab_size))
        return SampledTokens.of(requests, out.token_ids, out)

    def _propose(self, sched: SchedulerOutput, t0: float) -> None:
        """Speculative decoding, after the step: the running requests get their drafts for
        the next step (its prefill tokens expected to be this step's). Then a step of
        decodes alone goes to the draft-length cost model: its tokens (drafts included) and
        its whole time, drafting the next step's tokens included (a draft model's cost)."""
        assert self.speculation is not None
        decode_tokens = sum(s.num_new_tokens for s in sched.scheduled if s.is_decode)
        prefill_tokens = sched.num_batched_tokens - decode_tokens
        self.speculation.propose(self.scheduler.running, prefill_tokens,
                                  self.scheduler.token_budget)
        if not prefill_tokens:
            # NOTE: prefill chunks run other kernels (large steps: fp32 GEMM), at another
            # cost per token; the fit is of the steps speculation shapes.
            self.speculation.observe_step(decode_tokens, self.clock() - t0)

    def _postprocess(self, sched: SchedulerOutput,
                     sampled: SampledTokens) -> list[RequestOutput]:
        """Detokenize the new tokens (finding stop strings), hand the runner output to the
        scheduler, which appends the tokens and finishes the requests that stopped, then build
        the outputs."""
        result, deltas = self.outputs.check_stops(sampled)
        self.scheduler.update_from_output(sched, result)
        return self.outputs.step_outputs(sampled, deltas)

    def write_trace(self, path: str | None = None) -> Path | None:
        """Write the step timeline (to ``path``, default ``trace_steps``); None when tracing
        is off."""
        return self.tracer.write(path) if self.tracer is not None else None

    def close(self) -> None:
        """Write the step timeline (when tracing) and release the runner (and a draft
        model's)."""
        try:
            self.write_trace()
            close_tiers(self.kv)  # the disk tier keeps the pool's cache for the next process
        finally:
            try:
                if self.speculation is not None:
                    self.speculation.proposer.close()
            finally:
                self.runner.close()

    def _timeout_output(self, request: Request, phase: str, now: float) -> RequestOutput:
        """The final output of a request the scheduler timed out (counted by its phase)."""
        self.recorder.timed_out(request, phase, now)
        return self.outputs.timeout_output(request)
