"""Sampled tokens -> text, logprobs and :class:`RequestOutput`: the per-request output state.

:class:`OutputProcessor` is the engine's postprocessing stage. Each admitted sequence gets one
:class:`RequestState` (its random stream, its grammar, its detokenizer, its text and logprobs),
held by the sequence itself (``Request.engine_state``): it is born when the scheduler accepts
the request and released with the request's final output, the one place it ends, whichever
way the request ended (a stop, an abort, a timeout). There is no second table to keep in step
with the scheduler's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kvflow.kv_manager import KVCacheManager
from kvflow.orchestrator.outputs import (
    CompletionOutput,
    EngineCounters,
    ErrorCode,
    RequestOutput,
)
from kvflow.orchestrator.request import Request, RequestMetrics, RequestStatus
from kvflow.orchestrator.sampling.kernels import logprobs_of
from kvflow.orchestrator.sampling.params import MAX_SEED, SamplingParams
from kvflow.orchestrator.sampling.sampler import SamplerOutput, SamplingRow, make_generator
from kvflow.orchestrator.sampling.structured import Grammar, allocate_bitmask, fill_bitmasks
from kvflow.orchestrator.scheduler.output import RunnerOutput
from kvflow.text.detokenizer import IncrementalDetokenizer
from kvflow.text.tokenizer import EngineTokenizer

# Prompt rows whose logprobs are computed at once: bounds the temporaries of the
# log-softmax to this many vocabulary-wide rows, whatever the chunk's length.
PROMPT_LOGPROBS_ROWS = 256
_NO_ROWS = range(0)


class RequestState:
    """What the engine keeps for one live sequence beside the scheduler's fields: its random
    stream and grammar (read by the sampling stage), and its text and logprobs so far.

    ``prompt_logprobs`` (a request that asked; its first sequence's state alone): one entry
    per prompt position computed so far, the first None; ``prompt_logprobs_sent`` once an
    output carried them whole."""

    __slots__ = ("detok", "generator", "grammar", "text", "logprobs", "prompt_logprobs",
                 "prompt_logprobs_sent")

    def __init__(self, detok: IncrementalDetokenizer | None, generator: np.random.Generator,
                 want_logprobs: bool, grammar: Grammar | None = None,
                 want_prompt_logprobs: bool = False) -> None:
        self.detok = detok
        self.generator = generator
        self.grammar = grammar  # the structured output's state, advanced token by token
        self.text = ""
        self.logprobs: list[dict[int, float]] | None = [] if want_logprobs else None
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if want_prompt_logprobs else None)
        self.prompt_logprobs_sent = False

    def flush(self) -> str:
        """At the sequence's end: the text the detokenizer held back for a possible stop
        string (none once a stop string was found: the text ends there)."""
        if self.detok is None or self.detok.stopped:
            return ""
        return self.detok.finish()


@dataclass(slots=True)
class SampledTokens:
    """The sampling stage's result, row by row: the sequences that sampled and their new
    tokens (one, or with speculative decoding the accepted drafts and the token verification
    drew); per row that asked, each token's logprobs (token id -> log-probability: its own and
    the top ``logprobs``'); and per row the drafts it verified (None: none this step)."""

    requests: list[Request]
    token_ids: list[list[int]]
    logprobs: list[list[dict[int, float]] | None] | None = None
    num_drafts: list[int] | None = None

    @classmethod
    def of(cls, requests: list[Request], tokens: list[int],
           output: SamplerOutput | None = None) -> SampledTokens:
        """One token per row, with the sampler's output (None: the runner took the argmax
        and no row wants logprobs)."""
        logprobs = None
        if output is not None and any(lp is not None for lp in output.logprobs):
            logprobs = [None if lp is None else [{**dict(top or []), token: lp}]
                        for token, lp, top in zip(tokens, output.logprobs,
                                                  output.top_logprobs, strict=True)]
        return cls(requests, [[t] for t in tokens], logprobs)


@dataclass(slots=True)
class NewOutput:
    """What one step added to one sequence: its tokens (none, e.g. at a timeout) and text."""

    token_ids: list[int]
    text: str


class OutputProcessor:
    """Detokenizes, checks stop strings and grammars, and builds every :class:`RequestOutput`.

    ``counters``: the engine's; the processor counts there the requests that end
    (``finished_by_reason``), at their final output. ``kv``: the engine's KV manager, whose
    prompt-logprob cache gives the entries of a cached prefix and keeps those computed.
    """

    def __init__(self, tokenizer: EngineTokenizer | None, counters: EngineCounters,
                 kv: KVCacheManager | None = None) -> None:
        self.tokenizer = tokenizer
        self.counters = counters
        self.kv = kv

    def add_request(self, seqs: list[Request], grammars: list[Grammar | None]) -> None:
        """Give each sequence of an admitted request its state."""
        for seq in seqs:
            params = seq.sampling_params
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer.tokenizer, seq.prompt_token_ids,
                                               params.skip_special_tokens, params.stop)
            # A group's prompt is computed once, by its first sequence: its logprobs too.
            seq.engine_state = RequestState(
                detok, _generator(params, seq.index), params.logprobs is not None,
                grammars[seq.index],
                want_prompt_logprobs=params.prompt_logprobs is not None and seq.index == 0)

    def prompt_rows(self, request: Request, start: int, num_new: int) -> range:
        """The positions of a chunk (``num_new`` tokens from ``start``) whose logits give
        prompt logprobs still missing: position p's give prompt token p + 1's. None once they
        are whole, nor a position already taken (a prompt recomputed after a preemption).
        A chunk after a cached prefix first takes the prefix's entries from the cache."""
        state = request.engine_state
        if state is None or state.prompt_logprobs is None:
            return _NO_ROWS
        if len(state.prompt_logprobs) <= start < request.num_prompt_tokens:
            self._take_cached(request, state.prompt_logprobs, start)
        lo = max(start, len(state.prompt_logprobs) - 1)
        hi = min(start + num_new, request.num_prompt_tokens - 1)
        return range(lo, hi) if lo < hi else _NO_ROWS

    def add_prompt_logprobs(self, request: Request, rows: range, logits: np.ndarray) -> None:
        """Append the prompt logprobs that the logits of positions ``rows`` give (float
        ``[len(rows), vocab]``, the vocabulary only): per position, the next prompt token's
        log-probability and the top ``prompt_logprobs``, a few rows at a time."""
        entries = _state(request).prompt_logprobs
        # NOTE: the entries grow in order, never skipping a position: no entry is missing
        # and none is taken twice.
        assert entries is not None and rows.start == len(entries) - 1, (request, rows)
        k = request.sampling_params.prompt_logprobs or 0
        targets = request.prompt_token_ids[rows.start + 1:rows.stop + 1]
        for i in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
            block = targets[i:i + PROMPT_LOGPROBS_ROWS]
            values, tops = logprobs_of(
                np.asarray(logits[i:i + len(block)], dtype=np.float32), block,
                [k] * len(block))
            for token, value, top in zip(block, values, tops, strict=True):
                entry = dict(top)
                entry[token] = value
                entries.append(entry)
        cache = self.kv.prompt_logprobs if self.kv is not None else None
        if cache is not None:  # the blocks whose every entry is now known
            bs = cache.block_size
            cache.store(self._hashes(request), request.prompt_token_ids, k, entries,
                        range(rows.start // bs, rows.stop // bs))

    def _take_cached(self, request: Request, entries: list[dict[int, float] | None],
                     start: int) -> None:
        """Extend ``entries`` to position ``start`` (the first computed after a cached prefix,
        a block boundary) with the kept entries of the prefix's blocks: the scheduler admitted
        the request after them only if every one is kept
        (:class:`~kvflow.kv_manager.prompt_logprobs_cache.PromptLogprobsCache`)."""
        cache = self.kv.prompt_logprobs if self.kv is not None else None
        assert cache is not None and start % cache.block_size == 0, (request, start)
        k = request.sampling_params.prompt_logprobs or 0
        cached = cache.entries_of(self._hashes(request), request.prompt_token_ids, k,
                                  start // cache.block_size)
        # NOTE: shared with the cache, never modified (nor by the outputs that carry them).
        entries.extend(cached[len(entries) - 1:])

    def _hashes(self, request: Request) -> list[bytes]:
        assert self.kv is not None
        return self.kv.block_hashes(request.request_id, request.token_ids, request.cache_key)

    def sampling_row(self, request: Request) -> SamplingRow:
        """One sequence's sampling row, with no grammar mask (speculative verification makes
        its masks per draft position)."""
        return SamplingRow(request.sampling_params, request.prompt_token_ids,
                           request.output_token_ids, _state(request).generator)

    def sampling_rows(self, requests: list[Request], vocab_size: int) -> list[SamplingRow]:
        """The sampling stage's rows: each sequence's params, tokens so far and random stream
        (its state's), and for a sequence with a grammar, that grammar's next-token mask."""
        states = [_state(r) for r in requests]
        rows = [SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids,
                            st.generator) for r, st in zip(requests, states, strict=True)]
        grammars = [(k, st.grammar) for k, st in enumerate(states) if st.grammar is not None]
        if grammars:  # the grammars' next-token masks, for their rows alone
            bitmask = allocate_bitmask(len(grammars), vocab_size)
            fill_bitmasks([g for _, g in grammars], bitmask)
            for j, (k, _) in enumerate(grammars):
                rows[k].bitmask = bitmask[j]
        return rows

    def check_stops(self, sampled: SampledTokens) -> tuple[RunnerOutput, list[str]]:
        """Before the scheduler appends the step's tokens: each row's new text, and the
        runner output that tells the scheduler what stopped (a stop string the text
        completed, a grammar that is complete or refused the token)."""
        deltas: list[str] = []
        result = RunnerOutput()
        for row, (request, tokens) in enumerate(zip(sampled.requests, sampled.token_ids,
                                                    strict=True)):
            state = _state(request)
            rid = request.request_id
            detok, grammar = state.detok, state.grammar
            delta = ""
            for j, token in enumerate(tokens):
                if detok is not None:
                    delta += detok.step([token])
                stop_string = (detok.stop_reason or "") if detok is not None and detok.stopped \
                    else None
                # NOTE: a token the grammar refuses (it cannot be sampled: the mask bans it)
                # would leave the matcher in error, and is_stopped then ends the sequence.
                grammar_done = grammar is not None and (not grammar.accept(token)
                                                        or grammar.is_stopped)
                if stop_string is not None:
                    result.stop_strings[rid] = stop_string
                if grammar_done:
                    result.grammar_done.add(rid)
                if j + 1 < len(tokens) and request.stop_after(
                        token, request.num_output_tokens + j + 1, stop_string,
                        grammar_done)[0] is not None:
                    # A verified draft stops the sequence: the tokens after it never happened.
                    tokens = sampled.token_ids[row] = tokens[:j + 1]
                    if sampled.logprobs is not None and sampled.logprobs[row] is not None:
                        sampled.logprobs[row] = sampled.logprobs[row][:j + 1]  # type: ignore
                    break
            result.sampled_token_ids[rid] = tokens
            deltas.append(delta)
        return result, deltas

    def step_outputs(self, sampled: SampledTokens, deltas: list[str]) -> list[RequestOutput]:
        """After the scheduler appended the tokens: one output per request (a group's
        sequences together), in the order they sampled."""
        new: dict[str, dict[int, NewOutput]] = {}
        leaders: dict[str, Request] = {}
        entries = sampled.logprobs
        for row, (request, tokens) in enumerate(zip(sampled.requests, sampled.token_ids,
                                                    strict=True)):
            state = _state(request)
            delta = deltas[row]
            if state.logprobs is not None and entries is not None and entries[row] is not None:
                state.logprobs.extend(entries[row])  # type: ignore[arg-type]
            if request.is_finished:
                delta += state.flush()
            state.text += delta
            new.setdefault(request.parent_id, {})[request.index] = NewOutput(tokens, delta)
            leaders.setdefault(request.parent_id,
                               request.group.seqs[0] if request.group else request)
        return [self.output(leaders[pid], news) for pid, news in new.items()]

    def timeout_output(self, request: Request) -> RequestOutput:
        """The final output of a request the scheduler timed out (its partial text, the text
        held back for a possible stop string included)."""
        new: dict[int, NewOutput] = {}
        for seq in _seqs(request):
            state = seq.engine_state
            if seq.status == RequestStatus.FINISHED_TIMEOUT and state is not None:
                delta = state.flush()
                state.text += delta
                new[seq.index] = NewOutput([], delta)
        return self.output(request, new)

    def output(self, request: Request,
               new: dict[int, NewOutput] | None = None) -> RequestOutput:
        """The request's output (every sequence of a group), with ``new``: per sequence index,
        what this step added. The final output releases the sequences' states."""
        seqs = _seqs(request)
        new = new or {}
        outputs = []
        for seq in seqs:
            state = seq.engine_state
            added = new.get(seq.index)
            outputs.append(CompletionOutput(
                index=seq.index, text=state.text if state is not None else "",
                token_ids=seq.output_token_ids, num_tokens=seq.num_output_tokens,
                delta_text=added.text if added is not None else "",
                delta_token_ids=added.token_ids if added is not None else [],
                finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason,
                logprobs=state.logprobs if state is not None else None))
        prompt_logprobs = self._take_prompt_logprobs(seqs[0])
        finished = all(seq.is_finished for seq in seqs)
        if finished:
            for seq in seqs:
                seq.engine_state = None  # NOTE: the one place a sequence's state ends
            if request.status != RequestStatus.REJECTED:
                # A group's reason: an abort or a timeout if any sequence had one (so that it
                # matches kvflow_request_timeout_total), else its first sequence's.
                reasons = {o.finish_reason for o in outputs}
                reason = next((r for r in ("abort", "timeout") if r in reasons),
                              outputs[0].finish_reason or "abort")
                self.counters.finished_by_reason[reason] += 1
        code = request.reject_code
        return RequestOutput(
            request_id=request.parent_id, outputs=outputs, finished=finished,
            num_prompt_tokens=request.num_prompt_tokens, metrics=_request_metrics(seqs),
            error=request.reject_reason, error_code=None if code is None else ErrorCode(code),
            cached_tokens=request.metrics.cached_tokens,
            prompt_token_ids=request.prompt_token_ids, prompt_logprobs=prompt_logprobs,
            num_draft_tokens=sum(seq.num_draft_tokens for seq in seqs),
            num_accepted_tokens=sum(seq.num_accepted_tokens for seq in seqs))

    @staticmethod
    def _take_prompt_logprobs(first: Request) -> list[dict[int, float] | None] | None:
        """The request's prompt logprobs for the first output once they are whole (None
        before, and after it)."""
        state = first.engine_state
        if (state is None or state.prompt_logprobs is None or state.prompt_logprobs_sent
                or len(state.prompt_logprobs) < first.num_prompt_tokens):
            return None
        state.prompt_logprobs_sent = True
        return state.prompt_logprobs


def _seqs(request: Request) -> list[Request]:
    return request.group.seqs if request.group is not None else [request]


def _state(request: Request) -> RequestState:
    state = request.engine_state
    assert state is not None, f"{request!r} has no state: it was never admitted, or ended"
    return state


def _generator(params: SamplingParams, index: int) -> np.random.Generator:
    """Sequence ``index`` of a seeded request draws from its own stream, seed + index."""
    seed = None if params.seed is None else (params.seed + index) % (MAX_SEED + 1)
    return make_generator(seed)


def _request_metrics(seqs: list[Request]) -> RequestMetrics:
    """The request's metrics: a single sequence's own; a group's first sequence's (its token
    times, shared, as a single sequence's are), finished when the last sequence finished."""
    first = seqs[0].metrics
    if len(seqs) == 1:
        return first
    ends = [s.metrics.finished_time for s in seqs]
    return replace(first,
                   finished_time=None if any(t is None for t in ends)
                   else max(ends),  # type: ignore[type-var]
                   num_preemptions=max(s.metrics.num_preemptions for s in seqs))
