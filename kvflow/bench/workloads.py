"""Benchmark workloads: arrival processes, the Azure conversation trace, and real-text prompts.

Pure Python + numpy so a load generator can import it without any runtime. Every generator
takes a seed and is reproducible for it; arrival times are seconds relative to the first
request, which arrives at 0.0.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import numpy as np

__all__ = [
    "CORPUS",
    "RequestSpec",
    "gamma_arrivals",
    "load_azure_trace",
    "make_prompt_ids",
    "make_prompt_text",
    "poisson_arrivals",
    "random_workload",
    "retime",
    "SessionsWorkload",
    "sessions_workload",
    "shared_prefix_workload",
    "tenants_workload",
]


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: when it is sent and how long its prompt and output are.

    ``prefix_group`` names the shared prefix a request starts with (None: no shared prefix);
    requests with the same group share their first tokens. ``tenant`` names whom it is
    accounted to (the ``fair`` policy's unit) and ``priority`` its priority (lower first), or
    None for the defaults.
    """

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: int | None = None
    tenant: str | None = None
    priority: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"arrival_s must be finite and >= 0, got {self.arrival_s}")
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens}")
        if self.prefix_group is not None and self.prefix_group < 0:
            raise ValueError(f"prefix_group must be None or >= 0, got {self.prefix_group}")


def _check_n_rate(n: int, rate: float) -> None:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not rate > 0:  # also rejects NaN
        raise ValueError(f"rate must be > 0 (requests/s, inf allowed), got {rate}")


def gamma_arrivals(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Arrival times of ``n`` requests with gamma-distributed inter-arrival gaps.

    The gaps have shape ``burstiness`` and scale ``1/(rate*burstiness)``, so their mean is
    ``1/rate`` whatever the burstiness and their coefficient of variation is
    ``1/sqrt(burstiness)``: 1.0 is a Poisson process, < 1 is burstier, > 1 is more regular.
    The first request arrives at 0.0 and ``n-1`` gaps follow, so the times are sorted.
    ``rate=inf`` sends everything at 0.0.
    """
    _check_n_rate(n, rate)
    if not burstiness > 0 or math.isinf(burstiness):
        raise ValueError(f"burstiness must be finite and > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times of ``n`` requests of a Poisson process at ``rate`` requests/s.

    Exponential gaps (``gamma_arrivals`` with burstiness 1.0); first request at 0.0;
    ``rate=inf`` sends everything at 0.0.
    """
    return gamma_arrivals(n, rate, 1.0, seed)


def _parse_timestamp(text: str) -> tuple[datetime, float]:
    """Split ``2023-11-16 18:15:46.6805900`` into (whole seconds, fraction of a second).

    ``datetime`` takes at most 6 fractional digits and the trace has 7, so the fraction is
    parsed separately, as a float.
    """
    text = text.strip()
    whole, _, frac = text.partition(".")
    try:
        dt = datetime.strptime(whole.replace("T", " "), "%Y-%m-%d %H:%M:%S")
        return dt, float("0." + frac) if frac else 0.0
    except ValueError as e:
        raise ValueError(f"TIMESTAMP {text!r} is not 'YYYY-MM-DD HH:MM:SS[.fffffff]'") from e


def load_azure_trace(
    path: str | Path,
    limit: int | None = None,
    time_scale: float = 1.0,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
    length_scale: float = 1.0,
) -> tuple[list[RequestSpec], dict]:
    """Read the Azure LLM inference trace (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Returns the requests (sorted by arrival, times relative to the earliest of the rows read,
    divided by ``time_scale``: 2.0 replays twice as fast) and a report of how the lengths
    were changed: ``prompt_clipped``/``output_clipped`` count rows cut to ``max_*_tokens``,
    ``prompt_raised``/``output_raised`` count lengths raised to the minimum of 1 token, and the
    ``*_mean_original``/``*_mean`` pairs give the mean before and after. ``length_scale``
    multiplies every prompt and output length first (rounded, at least 1 token), keeping the
    shape of the length distribution while shrinking it to what a small machine can serve;
    clipping applies after it. ``limit`` keeps the first ``limit`` rows of the file.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be None or >= 1, got {limit}")
    if not time_scale > 0 or math.isinf(time_scale):
        raise ValueError(f"time_scale must be finite and > 0, got {time_scale}")
    if not length_scale > 0 or math.isinf(length_scale):
        raise ValueError(f"length_scale must be finite and > 0, got {length_scale}")
    for name, value in (("max_prompt_tokens", max_prompt_tokens),
                        ("max_output_tokens", max_output_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be None or >= 1, got {value}")

    stamps: list[tuple[datetime, float]] = []
    prompts: list[int] = []
    outputs: list[int] = []
    # utf-8-sig: tolerate a BOM in front of the header.
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)}")
        for row in reader:
            if limit is not None and len(stamps) >= limit:
                break
            stamps.append(_parse_timestamp(row["TIMESTAMP"]))
            prompts.append(int(row["ContextTokens"]))
            outputs.append(int(row["GeneratedTokens"]))
    if not stamps:
        raise ValueError(f"{path}: no rows")

    t0_dt, t0_frac = min(stamps)
    # Whole seconds and fractions subtracted apart: absolute epoch floats would lose the 7th digit.
    arrivals = [((dt - t0_dt).total_seconds() + (fr - t0_frac)) / time_scale for dt, fr in stamps]

    p_orig = np.asarray(prompts, dtype=np.int64)
    o_orig = np.asarray(outputs, dtype=np.int64)
    p_scaled = np.rint(p_orig * length_scale).astype(np.int64)
    o_scaled = np.rint(o_orig * length_scale).astype(np.int64)
    p = np.maximum(p_scaled, 1)
    o = np.maximum(o_scaled, 1)
    if max_prompt_tokens is not None:
        p = np.minimum(p, max_prompt_tokens)
    if max_output_tokens is not None:
        o = np.minimum(o, max_output_tokens)

    order = sorted(range(len(arrivals)), key=arrivals.__getitem__)  # stable: ties keep file order
    specs = [RequestSpec(max(arrivals[i], 0.0), int(p[i]), int(o[i])) for i in order]
    report = {
        "rows": len(specs),
        "time_scale": time_scale,
        "length_scale": length_scale,
        "span_s": specs[-1].arrival_s - specs[0].arrival_s,
        "max_prompt_tokens": max_prompt_tokens,
        "max_output_tokens": max_output_tokens,
        "prompt_clipped": int(np.count_nonzero(p_scaled > p)),
        "output_clipped": int(np.count_nonzero(o_scaled > o)),
        "prompt_raised": int(np.count_nonzero(p_scaled < p)),
        "output_raised": int(np.count_nonzero(o_scaled < o)),
        "prompt_mean_original": float(p_orig.mean()),
        "prompt_mean": float(p.mean()),
        "output_mean_original": float(o_orig.mean()),
        "output_mean": float(o.mean()),
    }
    return specs, report


def retime(specs: list[RequestSpec], rate: float) -> list[RequestSpec]:
    """The same requests with arrival times stretched so that their mean rate is ``rate``
    (requests per second over the span, ``(n-1)/span``), keeping the pattern of gaps (a
    trace's bursts stay bursts); ``rate=inf`` sends them all at 0.0."""
    _check_n_rate(len(specs), rate)
    span = specs[-1].arrival_s - specs[0].arrival_s
    if math.isinf(rate) or len(specs) == 1 or span <= 0:
        factor = 0.0
    else:
        factor = (len(specs) - 1) / span / rate
    t0 = specs[0].arrival_s
    return [replace(s, arrival_s=(s.arrival_s - t0) * factor) for s in specs]


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
    _check_n_rate(n, rate)
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
    _check_n_rate(n, rate)
    prompts = np.array([s.prompt_tokens for s in lengths])
    outputs = np.array([s.output_tokens for s in lengths])
    order = np.argsort(prompts, kind="stable")
    long_pool = order[len(order) * 3 // 4:]
    short_pool = order[: max(1, len(order) // 2)]
    short_output = max(1, int(np.median(outputs)))
    rng = np.random.default_rng([seed, 4])
    num_heavy = max(1, round(n * heavy_share))
    specs: list[RequestSpec] = []
    streams = [(HEAVY_TENANT, num_heavy, long_pool, None, 1)]
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


# Plain English prose (written for this file), one paragraph per entry. Real text rather than
# random ids, so a tokenizer sees ordinary merges and the model ordinary attention patterns.
CORPUS: tuple[str, ...] = (
    "The harbor town woke slowly on winter mornings. Fishermen checked their nets by lantern "
    "light while the bakery on the corner filled the street with the smell of fresh bread. "
    "Children walked to school in pairs, counting the boats that had already left the bay.",
    "A good library is less a building than a habit. People return to it because it is quiet, "
    "because the chairs are comfortable, and because someone once recommended a book that "
    "changed the way they thought about their own work and their neighbors.",
    "Engineers who build bridges spend most of their time thinking about things that will "
    "probably never happen: the heaviest truck, the strongest wind, the coldest night of the "
    "century. The bridge looks simple only because all of that thinking is hidden.",
    "In the spring the river rose above its banks and covered the lower fields for almost two "
    "weeks. Farmers moved their animals to higher ground, repaired the fences afterwards, and "
    "noticed that the soil was darker and richer than it had been the year before.",
    "Learning a new language as an adult is humbling. You order coffee with great care, the "
    "waiter answers quickly, and you understand only the word for milk. Yet a few months later "
    "you catch yourself dreaming in sentences you did not know you could build.",
    "The old train station was turned into a market with long wooden tables. On Saturdays it "
    "sells cheese, apples, honey and secondhand books, and on weekday evenings a small "
    "orchestra rehearses there because the high ceiling gives the music a warm echo.",
    "Good software tends to be boring in the best sense. It starts quickly, does what the "
    "documentation says, reports errors in plain words, and keeps working when the network is "
    "slow. Nobody writes articles about it, but everyone depends on it every day.",
    "Astronomers measure distances to nearby stars by watching them shift against the distant "
    "background as the Earth moves around the Sun. The angle is tiny, smaller than the width "
    "of a coin seen from several kilometers away, but careful instruments can detect it.",
    "My grandmother kept a notebook of recipes that she never followed exactly. Every page had "
    "corrections in pencil: less sugar, more lemon, bake ten minutes longer if the oven is old. "
    "The notebook was really a record of forty years of tasting and adjusting.",
    "When the power went out across the city, people came down from their apartments and "
    "talked on the front steps. Someone brought a guitar, a shop owner handed out candles, and "
    "for one evening the street felt more like a village than a part of a capital.",
)


def _corpus_text(seed: int, corpus: str | None) -> str:
    """The corpus with its paragraphs (or, for a given corpus, its words) rotated by ``seed``."""
    if corpus is not None:
        parts = corpus.split()
        if not parts:
            raise ValueError("corpus must contain at least one word")
    else:
        parts = list(CORPUS)
    k = seed % len(parts)
    return " ".join(parts[k:] + parts[:k])


def make_prompt_ids(
    tokenizer_encode: Callable[[str], list[int]],
    num_tokens: int,
    seed: int,
    corpus: str | None = None,
) -> list[int]:
    """Exactly ``num_tokens`` token ids of real English text.

    The text is the built-in corpus (or ``corpus``) rotated by ``seed`` and repeated as often
    as needed; its encoding is cut to ``num_tokens``. The ids count whatever
    ``tokenizer_encode`` returns, special tokens included.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    base = _corpus_text(seed, corpus)
    text = base
    ids = list(tokenizer_encode(text))
    while len(ids) < num_tokens:
        # Double rather than append one copy: each attempt re-encodes the whole text.
        text = text + " " + text
        grown = list(tokenizer_encode(text))
        if len(grown) <= len(ids):
            raise ValueError("tokenizer_encode returns no more tokens for longer text")
        ids = grown
    return ids[:num_tokens]


def make_prompt_text(
    tokenizer_encode: Callable[[str], list[int]],
    tokenizer_decode: Callable[[list[int]], str],
    num_tokens: int,
    seed: int,
) -> tuple[str, int]:
    """Real English text whose re-encoding has ``num_tokens`` tokens, and its actual count.

    Cutting the ids of ``make_prompt_ids`` and decoding them is not enough: with byte-level BPE
    the decode/encode round trip can merge tokens across the cut (or split a broken multi-byte
    character), so the text may re-encode to a different count. The cut point is moved by the
    difference until the count is exact; when no cut gives it exactly, the text with the closest
    count is returned and the second element says how many tokens it really has.
    """
    # A few spare ids past the target so the cut can move right as well as left.
    stream = make_prompt_ids(tokenizer_encode, num_tokens + 64, seed)
    counts: dict[int, int] = {}

    def count(k: int) -> int:
        if k not in counts:
            counts[k] = len(tokenizer_encode(tokenizer_decode(stream[:k])))
        return counts[k]

    k = num_tokens
    for _ in range(32):
        diff = num_tokens - count(k)
        if diff == 0:
            return tokenizer_decode(stream[:k]), num_tokens
        nxt = min(max(k + diff, 1), len(stream))
        if nxt in counts:
            break  # oscillating between cuts: fall back to a local scan
        k = nxt
    for k2 in range(max(1, k - 8), min(len(stream), k + 8) + 1):
        if count(k2) == num_tokens:
            return tokenizer_decode(stream[:k2]), num_tokens
    best = min(counts, key=lambda c: (abs(counts[c] - num_tokens), c))
    return tokenizer_decode(stream[:best]), counts[best]
