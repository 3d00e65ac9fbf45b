"""Synthetic workloads: random lengths, a shared prefix, multi-turn sessions, and a heavy
tenant among light ones (the last two on the Azure trace's lengths). Pure Python + numpy;
reproducible for a seed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvflow.workloads.arrivals import check_n_rate, gamma_arrivals, poisson_arrivals
from kvflow.workloads.specs import RequestSpec


def _uniform_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float,
                     name: str) -> np.ndarray:
    if length < 1:
        raise ValueError(f"{name} must be >= 1, got {length}")
    lo = max(1, round(length * (1.0 - range_ratio)))
    hi = max(lo, round(length * (1.0 + range_ratio)))
    return rng.integers(lo, hi, size=n, endpoint=True)


def random_workload(
    n: int,
    input_len: int,
    output_len: int,
    rate: float,
    burstiness: float,
    seed: int,
    range_ratio: float = 0.0,
) -> list[RequestSpec]:
    """``n`` requests with gamma arrivals and lengths uniform in ``len*(1 ± range_ratio)``.

    Integer lengths, bounds rounded and at least 1; ``range_ratio=0`` gives fixed lengths.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    arrivals = gamma_arrivals(n, rate, burstiness, seed)
    # A separate stream for lengths, so changing the rate keeps the same lengths.
    rng = np.random.default_rng([seed, 1])
    ins = _uniform_lengths(rng, n, input_len, range_ratio, "input_len")
    outs = _uniform_lengths(rng, n, output_len, range_ratio, "output_len")
    return [RequestSpec(a, int(i), int(o)) for a, i, o in zip(arrivals, ins, outs, strict=True)]


def shared_prefix_workload(
    n: int,
    prefix_tokens: int,
    question_tokens: int,
    output_len: int,
    rate: float,
    seed: int,
    num_prefixes: int = 1,
) -> list[RequestSpec]:
    """``n`` Poisson-arriving requests whose prompts are one of ``num_prefixes`` shared
    prefixes of ``prefix_tokens`` followed by ``question_tokens`` of their own.

    The group of each request is drawn uniformly; ``prompt_tokens`` is the total length.
    """
    if prefix_tokens < 0:
        raise ValueError(f"prefix_tokens must be >= 0, got {prefix_tokens}")
    if question_tokens < 1:
        raise ValueError(f"question_tokens must be >= 1, got {question_tokens}")
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    arrivals = poisson_arrivals(n, rate, seed)
    groups = np.random.default_rng([seed, 2]).integers(0, num_prefixes, size=n)
    return [RequestSpec(a, prefix_tokens + question_tokens, output_len, int(g))
            for a, g in zip(arrivals, groups, strict=True)]

@dataclass(frozen=True)
class SessionsWorkload:
    """Multi-turn conversations, one entry per request in arrival order: its spec, its prompt's
    token ids, its session and its turn (0 first)."""

    specs: list[RequestSpec]
    prompts: list[list[int]]
    sessions: list[int]
    turns: list[int]


def sessions_workload(lengths: list[RequestSpec], n: int, rate: float, seed: int,
                      turns_per_session: int = 4, think_time_s: float = 20.0,
                      system_prompt_tokens: int = 0, max_prompt_tokens: int | None = None,
                      output_token_id: int = 0) -> SessionsWorkload:
    """``n`` requests of chat sessions whose turns share their history, as a prefix cache
    sees it: turn ``k``'s prompt is the system prompt (``system_prompt_tokens``, the same in
    every session), then every earlier turn's prompt message and output, then a new message.

    Each turn draws its new message's length and its output's from a row of ``lengths`` (the
    Azure trace's). Sessions start as a Poisson process at ``rate / turns_per_session`` per
    second, so that requests arrive at about ``rate``; each later turn is sent ``think_time_s
    * U(0.5, 1.5)`` after the one before (open loop: a turn sent before the previous one
    finished finds only the older history cached). A session ends after
    ``turns_per_session`` turns, or earlier when its next prompt would exceed
    ``max_prompt_tokens``. An earlier turn's output appears in the history as
    ``output_token_id`` repeated, the token the simulator's model always samples: a real
    model's history holds what it generated, and so does this one's. Each session's
    messages have token ids no other session uses.
    """
    check_n_rate(n, rate)
    if turns_per_session < 1:
        raise ValueError(f"turns_per_session must be >= 1, got {turns_per_session}")
    if not think_time_s >= 0 or math.isinf(think_time_s):
        raise ValueError(f"think_time_s must be finite and >= 0, got {think_time_s}")
    if system_prompt_tokens < 0:
        raise ValueError(f"system_prompt_tokens must be >= 0, got {system_prompt_tokens}")
    if max_prompt_tokens is not None and max_prompt_tokens <= system_prompt_tokens:
        raise ValueError(f"max_prompt_tokens ({max_prompt_tokens}) must exceed "
                         f"system_prompt_tokens ({system_prompt_tokens})")
    rng = np.random.default_rng([seed, 5])
    starts = poisson_arrivals(n, rate / turns_per_session, seed)
    system = list(range(1, system_prompt_tokens + 1))
    rows: list[tuple[float, int, int, list[int], int]] = []  # arrival, session, turn, ids, out
    session = 0
    while len(rows) < n:
        history, t = list(system), starts[session]
        base = 1_000_000_000 * (session + 1)  # this session's own token ids
        for turn in range(turns_per_session):
            row = lengths[int(rng.integers(len(lengths)))]
            message = row.prompt_tokens
            if turn == 0 and max_prompt_tokens is not None:
                message = min(message, max_prompt_tokens - len(history))
            prompt = history + list(range(base, base + message))
            if max_prompt_tokens is not None and len(prompt) > max_prompt_tokens:
                break
            base += message
            rows.append((t, session, turn, prompt, row.output_tokens))
            history = prompt + [output_token_id] * row.output_tokens
            t += think_time_s * float(rng.uniform(0.5, 1.5))
            if len(rows) == n:
                break
        session += 1  # NOTE: each session has a first turn, so n starts always suffice
    rows.sort(key=lambda r: r[0])  # stable: a session's turns keep their order
    return SessionsWorkload([RequestSpec(a, len(ids), out) for a, _, _, ids, out in rows],
                            [r[3] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


HEAVY_TENANT = "heavy"


def tenants_workload(lengths: list[RequestSpec], n: int, rate: float, seed: int,
                     num_light: int = 4, heavy_share: float = 0.5) -> list[RequestSpec]:
    """The multi-tenant workload: one heavy tenant sends long prompts at a high rate, and
    ``num_light`` light tenants send short chats, all drawn from the lengths of ``lengths``
    (the Azure trace's).

    ``heavy_share`` of the ``n`` requests are the heavy tenant's, Poisson at that share of
    ``rate``; their prompts are drawn from the trace's longest quarter of prompts (with their
    outputs). The rest are split evenly over the light tenants ``light-0 ..``, each Poisson
    at its share of ``rate``, with prompts from the shortest half and outputs of at most the
    trace's median output. The light tenants get priority 0 and the heavy one priority 1
    (interactive before batch), for the ``priority`` policy.
    """
    if num_light < 1:
        raise ValueError(f"num_light must be >= 1, got {num_light}")
    if not 0.0 < heavy_share < 1.0:
        raise ValueError(f"heavy_share must be in (0, 1), got {heavy_share}")
    check_n_rate(n, rate)
    prompts = np.array([s.prompt_tokens for s in lengths])
    outputs = np.array([s.output_tokens for s in lengths])
    order = np.argsort(prompts, kind="stable")
    long_pool = order[len(order) * 3 // 4:]
    short_pool = order[: max(1, len(order) // 2)]
    short_output = max(1, int(np.median(outputs)))
    rng = np.random.default_rng([seed, 4])
    num_heavy = max(1, round(n * heavy_share))
    specs: list[RequestSpec] = []
    # (tenant, requests, prompt pool, output cap: None keeps the sampled one, priority)
    streams: list[tuple[str, int, np.ndarray, int | None, int]] = [
        (HEAVY_TENANT, num_heavy, long_pool, None, 1)]
    per_light = [(n - num_heavy) // num_light + (k < (n - num_heavy) % num_light)
                 for k in range(num_light)]
    streams += [(f"light-{k}", m, short_pool, short_output, 0)
                for k, m in enumerate(per_light) if m]
    for k, (tenant, m, pool, cap, priority) in enumerate(streams):
        share = m / n
        for arrival in poisson_arrivals(m, rate * share, seed * 1000 + k):
            i = int(rng.choice(pool))
            out = int(outputs[i]) if cap is None else min(int(outputs[i]), cap)
            specs.append(RequestSpec(arrival, int(prompts[i]), out, tenant=tenant,
                                     priority=priority))
    specs.sort(key=lambda s: s.arrival_s)
    return specs
