"""Static batching, the baseline policy (``static``): a batch runs to completion. Pure Python."""

from __future__ import annotations

import time

from kvflow.kv_manager import KVCacheManager
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.request import Request
from kvflow.orchestrator.scheduler.core import Scheduler
from kvflow.orchestrator.scheduler.output import (
    Clock,
    Rejection,
    ScheduledRequest,
    SchedulerOutput,
)


class StaticBatchScheduler(Scheduler):
    """Static batching, the baseline: gather up to B waiting requests, reserve KV for their
    whole length (prompt + max output), run them together to completion, admit nothing until
    the whole batch has finished. Never preempts."""

    def __init__(self, config: EngineOptions, kv: KVCacheManager,
                 clock: Clock = time.monotonic) -> None:
        super().__init__(config, kv, clock)
        # It reserves a request's whole length at once, so no block is released under a
        # window: the pool must hold the whole sequence.
        self.max_seq_len = min(config.max_model_len, kv.pool.num_usable_blocks * kv.block_size)
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
            if not self.loras.admits(request) or not self.kv.allocate_slots(request.request_id,
                                                                            full):
                break
            self.waiting.popleft()
            self._start_running(request)
