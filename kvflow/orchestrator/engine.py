"""The engine loop: schedule -> build the step -> runner -> sample -> append -> detokenize -> emit.

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

import numpy as np

from kvflow.kv_manager import KVCacheManager
from kvflow.orchestrator.config import SchedulerConfig
from kvflow.orchestrator.detokenizer import IncrementalDetokenizer
from kvflow.orchestrator.outputs import RequestOutput, StepStats
from kvflow.orchestrator.request import Request, RequestStatus
from kvflow.orchestrator.sampler import Sampler, SamplingRow, make_generator
from kvflow.orchestrator.sampling_params import SamplingParams
from kvflow.orchestrator.scheduler import Clock, make_scheduler
from kvflow.orchestrator.tokenizer import EngineTokenizer
from kvflow.runtime.base import ModelRunner
from kvflow.runtime.step_builder import SeqChunk, build_step


class _RequestState:
    """Engine-side state of a live request (the scheduler owns the rest)."""

    __slots__ = ("detok", "generator", "text", "logprobs", "emitted_tokens")

    def __init__(self, detok: IncrementalDetokenizer | None, generator: np.random.Generator,
                 want_logprobs: bool) -> None:
        self.detok = detok
        self.generator = generator
        self.text = ""
        self.logprobs: list[dict[int, float]] | None = [] if want_logprobs else None
        self.emitted_tokens = 0


class LLMEngine:
    """Continuous-batching engine over one runner and one KV pool.

    Args:
        runner: executes steps; its ``num_blocks`` sizes the KV manager.
        tokenizer: the engine's tokenizer (None: token ids only, no text, no stop strings).
        scheduler_config: limits and policy.
        eos_token_ids: ids that end a request (unless ``ignore_eos``).
        clock: monotonic seconds; the simulator passes its own.
        stats_window: how many recent :class:`StepStats` to keep.
    """

    def __init__(self, runner: ModelRunner, tokenizer: EngineTokenizer | None,
                 scheduler_config: SchedulerConfig, eos_token_ids: Sequence[int] = (),
                 clock: Clock = time.monotonic, stats_window: int = 4096) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = scheduler_config
        self.clock = clock
        self.eos_token_ids = tuple(eos_token_ids)
        self.kv = KVCacheManager(runner.num_blocks, runner.engine.limits.block_size,
                                 enable_caching=scheduler_config.enable_prefix_caching,
                                 num_host_blocks=runner.num_host_blocks,
                                 bytes_per_block=runner.engine.kv_bytes_per_block)
        self.scheduler = make_scheduler(scheduler_config, self.kv, clock)
        self.sampler = Sampler(runner.engine.model.vocab_size, self.eos_token_ids)
        self.states: dict[str, _RequestState] = {}
        self.step_stats: deque[StepStats] = deque(maxlen=stats_window)
        # NOTE: step_time_s / serving_time_s are kept by whoever loops over step() (the
        # EngineLoop): the time inside steps, and the time serving around them.
        self.counters: dict[str, float] = {
            "prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0, "rejected": 0,
            "finished": 0, "steps": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
            "step_time_s": 0.0, "serving_time_s": 0.0}
        self._ids = itertools.count()

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None,
                    cache_salt: str | None = None) -> tuple[Request, RequestOutput | None]:
        """Queue a request. Returns it, and a final output at once if it was rejected.

        Requests with different ``cache_salt`` never share prefix-cache blocks.
        """
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompt token ids")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
        request = Request(request_id, prompt_ids, params,
                          self.clock() if arrival_time is None else arrival_time, priority,
                          self.eos_token_ids, self.config.max_model_len, cache_salt)
        if not self.scheduler.add_request(request):
            self.counters["rejected"] += 1
            return request, self._output(request, None, [])
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer.tokenizer, prompt_ids,
                                           params.skip_special_tokens, params.stop)
        self.states[request_id] = _RequestState(detok, make_generator(params.seed),
                                                params.logprobs is not None)
        return request, None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request; its KV blocks are free when this returns."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return None
        state = self.states.pop(request_id, None)
        return self._output(request, state, [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling decision and one model step; the outputs it produced."""
        t0 = self.clock()
        sched = self.scheduler.schedule()
        self.counters["preemptions"] += len(sched.preempted)
        self.counters["prefix_cache_queries"] = self.scheduler.prefix_cache_queries
        self.counters["prefix_cache_hits"] = self.scheduler.prefix_cache_hits
        # NOTE: before the step, and even if nothing runs: swapped-out blocks may be rewritten
        # by the very next allocation.
        if sched.blocks_to_swap_out:
            self.runner.swap_out(sched.blocks_to_swap_out)
        if sched.blocks_to_swap_in:
            self.runner.swap_in(sched.blocks_to_swap_in)
        if sched.is_empty:
            return []
        chunks = [SeqChunk(s.request.request_id, s.request.token_ids, s.start, s.num_new_tokens,
                           s.sample) for s in sched.scheduled]
        step_input = build_step(self.kv, chunks)
        t1 = self.clock()
        logits = self.runner.execute(step_input)
        t2 = self.clock()
        sampling = [s.request for s in sched.scheduled if s.sample]
        rows = [SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids,
                            self.states[r.request_id].generator) for r in sampling]
        sampled = self.sampler.sample(logits, rows) if rows else None
        t3 = self.clock()

        tokens = dict(zip((r.request_id for r in sampling),
                          sampled.token_ids if sampled else [], strict=True))
        self.scheduler.update_from_output(sched, tokens)
        outputs = []
        for row, request in enumerate(sampling):
            state = self.states.get(request.request_id)
            if state is None:
                continue
            token = tokens[request.request_id]
            if state.logprobs is not None and sampled is not None:
                entry = dict(sampled.top_logprobs[row] or [])
                entry[token] = sampled.logprobs[row]
                state.logprobs.append(entry)
            delta = self._detokenize(request, state, token)
            outputs.append(self._output(request, state, [token], delta))
        num_decode = sched.num_decode_tokens
        num_prefill = sched.num_batched_tokens - num_decode
        self.counters["prompt_tokens"] += num_prefill
        self.counters["generation_tokens"] += len(sampling)
        self.counters["steps"] += 1
        t4 = self.clock()
        self.step_stats.append(StepStats(
            time=t4, num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_prefill_tokens=num_prefill, num_decode_tokens=num_decode,
            num_scheduled_seqs=len(sched.scheduled),
            kv_blocks_used=self.kv.pool.num_used_blocks, kv_usage=self.kv.usage,
            num_preempted=len(sched.preempted), schedule_time_s=t1 - t0,
            model_time_s=t2 - t1, sample_time_s=t3 - t2, postprocess_time_s=t4 - t3,
            finished=[o.request_id for o in outputs if o.finished]))
        return outputs

    def _detokenize(self, request: Request, state: _RequestState, token: int) -> str:
        """Text delta of ``token``; finishes the request on a stop string."""
        detok = state.detok
        if detok is None:
            return ""
        delta = detok.step([token])
        if detok.stopped and not request.is_finished:
            request.stop_reason = detok.stop_reason
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        elif request.is_finished and not detok.stopped:
            delta += detok.finish()
        return delta

    def _output(self, request: Request, state: _RequestState | None,
                new_tokens: list[int], delta: str = "") -> RequestOutput:
        finished = request.is_finished
        if state is not None:
            state.text += delta
            text, logprobs = state.text, state.logprobs
        else:
            text, logprobs = "", None
        if finished:
            self.states.pop(request.request_id, None)
            if request.status != RequestStatus.REJECTED:
                self.counters["finished"] += 1
        return RequestOutput(
            request_id=request.request_id, text=text,
            token_ids=list(request.output_token_ids), delta_text=delta,
            delta_token_ids=new_tokens, finished=finished,
            finish_reason=request.status.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
            metrics=request.metrics, stop_reason=request.stop_reason,
            error=request.reject_reason, cached_tokens=request.metrics.cached_tokens,
            logprobs=logprobs)
