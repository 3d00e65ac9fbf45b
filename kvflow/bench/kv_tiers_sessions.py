"""The KV tiers benchmark's multi-turn chat workload: synthetic sessions on the Azure
conversation trace's lengths, and a closed-loop driver that serves them on an in-process engine.

Every turn re-sends the whole conversation: the system prompt (the same in every session), each
earlier user message and the reply the engine gave to it, then a new user message. Sessions take
turns round-robin (every session's turn 0, then every session's turn 1, ...), so that between
two turns of a session every other session has sent one: with a working set several times the
KV pool, a returning session finds its history evicted from the pool, and only a tier below it
can give it back.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.workloads.specs import RequestSpec


@dataclass(frozen=True)
class ChatSession:
    """One conversation: its user messages (token ids, one list a turn) and the number of tokens
    each reply gets (the engine generates them, greedy, ignoring EOS)."""

    messages: list[list[int]]
    reply_tokens: list[int]

    def __post_init__(self) -> None:
        if not self.messages or len(self.messages) != len(self.reply_tokens):
            raise ValueError(f"messages ({len(self.messages)}) and reply_tokens "
                             f"({len(self.reply_tokens)}) must be as many, and at least one")


@dataclass(frozen=True)
class ChatWorkload:
    """The system prompt every session starts with, and the sessions."""

    system: list[int]
    sessions: list[ChatSession]

    @property
    def num_turns(self) -> int:
        return sum(len(s.messages) for s in self.sessions)

    def working_set_tokens(self) -> int:
        """Distinct prefix tokens across the sessions: the system prompt once, then each
        session's messages and replies (its longest prompt's history, the last reply included:
        what a prefix cache must hold to miss nothing)."""
        return len(self.system) + sum(sum(map(len, s.messages)) + sum(s.reply_tokens)
                                      for s in self.sessions)

    def max_prompt_tokens(self) -> int:
        """The longest prompt: a session's last turn, its last reply not yet in it."""
        return len(self.system) + max(sum(map(len, s.messages)) + sum(s.reply_tokens[:-1])
                                      for s in self.sessions)


def make_chat_workload(corpus: Sequence[int], lengths: Sequence[RequestSpec],
                       working_set_tokens: int, turns: int, system_tokens: int,
                       length_scale: float, max_message_tokens: int, max_reply_tokens: int,
                       seed: int) -> ChatWorkload:
    """Sessions of ``turns`` turns, added until their working set
    (:meth:`ChatWorkload.working_set_tokens`) reaches ``working_set_tokens``.

    Each turn draws a row of ``lengths`` (the Azure trace's): its prompt length becomes the new
    message's, its output length the reply's, both times ``length_scale`` (the trace's shape,
    shrunk to what a small machine serves), rounded and clipped to ``[1, max_*_tokens]``. Text
    is cut from ``corpus`` (token ids of real prose): the system prompt is its first
    ``system_tokens``, then every message takes the next unused stretch, so no two sessions
    share a token past the system prompt. Reproducible for a seed.
    """
    for name, value in (("working_set_tokens", working_set_tokens), ("turns", turns),
                        ("max_message_tokens", max_message_tokens),
                        ("max_reply_tokens", max_reply_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if system_tokens < 0:
        raise ValueError(f"system_tokens must be >= 0, got {system_tokens}")
    if not length_scale > 0 or math.isinf(length_scale):
        raise ValueError(f"length_scale must be finite and > 0, got {length_scale}")
    if not lengths:
        raise ValueError("lengths must hold at least one row")
    rng = np.random.default_rng([seed, 47])
    system, at = list(corpus[:system_tokens]), system_tokens
    sessions: list[ChatSession] = []
    workload = ChatWorkload(system, sessions)
    while workload.working_set_tokens() < working_set_tokens:
        messages, replies = [], []
        for _ in range(turns):
            row = lengths[int(rng.integers(len(lengths)))]
            n = min(max(1, round(row.prompt_tokens * length_scale)), max_message_tokens)
            if at + n > len(corpus):
                raise ValueError(f"corpus has {len(corpus)} tokens, too few for a working set "
                                 f"of {working_set_tokens}")
            messages.append(list(corpus[at:at + n]))
            at += n
            replies.append(min(max(1, round(row.output_tokens * length_scale)),
                               max_reply_tokens))
        sessions.append(ChatSession(messages, replies))
    return workload


def round_robin(workload: ChatWorkload) -> list[tuple[int, int]]:
    """(session, turn) in the order they are sent: turn 0 of every session, then turn 1 of
    every session that has one, ..."""
    most = max(len(s.messages) for s in workload.sessions)
    return [(i, t) for t in range(most) for i, s in enumerate(workload.sessions)
            if t < len(s.messages)]


@dataclass(frozen=True)
class TurnResult:
    """One served turn: its prompt, the prompt tokens served from the prefix cache (any tier),
    the reply's tokens, and its times (engine clock, seconds: arrival, first token, finish)."""

    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    arrival_s: float
    finished_s: float


def serve_chat(engine: Any, workload: ChatWorkload, concurrency: int) -> list[TurnResult]:
    """Serve ``workload`` on ``engine`` (an :class:`~kvflow.orchestrator.engine.LLMEngine`) as
    ``concurrency`` users who each send the next turn of :func:`round_robin` as soon as one of
    them has its reply: closed loop, so a slower configuration takes longer rather than piling
    up a queue. A turn's prompt holds its session's earlier replies as the engine generated
    them. A turn arrives when it is added (between steps, where the previous reply finished),
    and its TTFT is the engine's, from that arrival."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    history = [list(workload.system) for _ in workload.sessions]
    replied = [-1] * len(workload.sessions)  # each session's last turn with its reply
    pending = deque(round_robin(workload))
    in_flight: dict[str, tuple[int, int, int]] = {}  # request id -> session, turn, prompt len
    results: list[TurnResult] = []
    while pending or in_flight:
        while (len(in_flight) < concurrency and pending
               and replied[pending[0][0]] == pending[0][1] - 1):
            s, t = pending.popleft()
            session = workload.sessions[s]
            prompt = history[s] + session.messages[t]
            params = SamplingParams(max_tokens=session.reply_tokens[t], temperature=0.0,
                                    ignore_eos=True)
            request, rejected = engine.add_request(prompt, params, request_id=f"s{s}-t{t}")
            if rejected is not None:
                raise RuntimeError(f"turn {t} of session {s} was refused: {rejected.error}")
            history[s] = prompt
            in_flight[request.parent_id] = (s, t, len(prompt))
        for out in engine.step():
            if not out.finished:
                continue
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            s, t, n = in_flight.pop(out.request_id)
            reply = list(out.outputs[0].token_ids)
            history[s] = history[s] + reply
            replied[s] = t
            m = out.metrics
            results.append(TurnResult(s, t, n, out.cached_tokens, len(reply),
                                      m.ttft_s if m.ttft_s is not None else math.nan,
                                      m.arrival_time, m.finished_time or m.arrival_time))
    return results


def summarize(results: Sequence[TurnResult], tier_state: Sequence[dict[str, Any]],
              block_size: int) -> dict[str, Any]:
    """The run's figures: prefix hit rate (cached prompt tokens / prompt tokens), split into
    the tokens each tier restored (its ``hits`` in blocks, from
    :meth:`~kvflow.kv_manager.tiers.KVTiers.state`, times ``block_size``) and the rest (hits in
    the pool); TTFT p50 / p99 (linear interpolation) and mean; output throughput over the span
    from the first arrival to the last finish."""
    if not results:
        raise ValueError("results must hold at least one turn")
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    output = sum(r.output_tokens for r in results)
    tiers = {t["medium"]: t["hits"] * block_size for t in tier_state}
    ttfts = np.array([r.ttft_s for r in results], dtype=float)
    span_s = max(r.finished_s for r in results) - min(r.arrival_s for r in results)
    return {
        "turns": len(results),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "hit_rate": cached / prompt,
        "hit_rate_pool": max(0, cached - sum(tiers.values())) / prompt,
        "hit_rate_tiers": {medium: n / prompt for medium, n in tiers.items()},
        "tier_tokens": tiers,
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "ttft_mean_s": float(ttfts.mean()),
        "span_s": span_s,
        "output_tok_s": output / span_s if span_s > 0 else math.nan,
        "ttft_by_turn_s": {t: float(np.median([r.ttft_s for r in results if r.turn == t]))
                           for t in sorted({r.turn for r in results})},
    }
