"""Admission control: whether a request may be queued at all. Pure Python.

A request that can never run (it does not fit ``max_model_len``, the KV pool or the budget)
is refused as a bad request, rather than cut short (as vLLM does). A request that cannot be
queued now is refused as overload: the waiting queue is full, or (SLO admission, with
``max_queue_delay_ms``) its predicted queue delay is too long; rejecting it beats serving it
late. The prediction divides the prompt tokens queued ahead by the prefill throughput the
engine measured (:class:`PrefillRate`).
"""

from __future__ import annotations

from collections.abc import Collection

from kvflow.kv_manager import KVCacheManager
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.outputs import OVERLOADED_PREFIX
from kvflow.orchestrator.request import Request
from kvflow.orchestrator.scheduler.output import Rejection


class PrefillRate:
    """Prefill throughput (tokens/s), an exponential average over the steps that prefilled;
    ``prior_tokens_per_s`` (the cost model's figure) until one is seen."""

    def __init__(self, prior_tokens_per_s: float, alpha: float = 0.1) -> None:
        self.prior_tokens_per_s = prior_tokens_per_s
        self.alpha = alpha
        self._tokens_ewma = 0.0
        self._time_ewma = 0.0

    @property
    def tokens_per_s(self) -> float:
        if self._time_ewma > 0:
            return self._tokens_ewma / self._time_ewma
        return self.prior_tokens_per_s

    def observe(self, num_prefill_tokens: int, step_time_s: float) -> None:
        """One step prefilled ``num_prefill_tokens`` in ``step_time_s``; a decode-only step
        says nothing about prefill and is left out."""
        if num_prefill_tokens <= 0 or step_time_s <= 0:
            return
        if self._time_ewma == 0:
            self._tokens_ewma, self._time_ewma = num_prefill_tokens, step_time_s
            return
        self._tokens_ewma += self.alpha * (num_prefill_tokens - self._tokens_ewma)
        self._time_ewma += self.alpha * (step_time_s - self._time_ewma)


def queued_prefill_tokens(waiting: Collection[Request], running: Collection[Request]) -> int:
    """Prompt tokens (recomputation included) queued to be prefilled: those of the waiting
    requests and the rest of the running prefills."""
    queued = sum(r.num_tokens - max(r.num_computed_tokens, r.num_transferred_tokens)
                 for r in waiting)
    return queued + sum(left for r in running
                        if (left := r.num_tokens - r.num_computed_tokens) > 1)


def never_fits(request: Request, config: EngineOptions, kv: KVCacheManager,
               max_seq_len: int) -> Rejection | None:
    """Why ``request`` can never run (a bad request), or None.

    Prompt + ``max_tokens`` (or + ``min_tokens``) must fit ``max_model_len`` and the KV pool
    (``max_seq_len``: the longest sequence that can be resident); the prompt must fit the
    budget unless prefill is chunked; and the ``n`` sequences of a request, which run
    together, must fit the seats and the pool together.
    """
    n, cfg, params = request.num_prompt_tokens, config, request.sampling_params
    if n == 0:
        return Rejection.bad_request("prompt must contain at least one token")
    for limit, what in ((cfg.max_model_len, "max_model_len"),
                        (max_seq_len, "the KV cache's capacity per sequence")):
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
        bs, usable = kv.block_size, kv.pool.num_usable_blocks
        longest = n + (params.max_tokens or max_seq_len - n)
        need = n // bs + params.n * (-(-longest // bs) - n // bs)
        window_held = kv.max_blocks_per_sequence(cfg.max_num_batched_tokens)
        if window_held is not None:  # released past a sliding window, none holds more
            need = min(need, params.n * window_held)
        if need > usable:
            return Rejection.bad_request(
                f"n is {params.n}: {params.n} sequences of up to {longest} tokens (prompt + "
                f"max_tokens) need {need} KV blocks; the KV cache has {usable}")
    return None


def overloaded(config: EngineOptions, waiting: Collection[Request],
               running: Collection[Request], prefill_rate: PrefillRate) -> Rejection | None:
    """Why no request can be queued now (overload: retry later), or None."""
    if len(waiting) >= config.max_waiting_requests:
        return Rejection(f"{OVERLOADED_PREFIX}: the waiting queue is full "
                         f"(max_waiting_requests={config.max_waiting_requests}); retry later",
                         "overloaded", "queue_full")
    if config.max_queue_delay_ms is not None:
        ahead, rate = queued_prefill_tokens(waiting, running), prefill_rate.tokens_per_s
        wait_ms = 1000 * ahead / rate
        if wait_ms > config.max_queue_delay_ms:
            return Rejection(f"{OVERLOADED_PREFIX}: predicted queue delay {wait_ms:.0f} ms "
                             f"exceeds max_queue_delay_ms={config.max_queue_delay_ms:g} "
                             f"({ahead} prompt tokens queued ahead, prefill at "
                             f"{rate:.0f} tokens/s); retry later", "overloaded",
                             "queue_delay")
    return None
