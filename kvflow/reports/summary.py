"""Serving metrics from per-request token timestamps: TTFT, TPOT, ITL, E2E, throughput, goodput.

Pure Python + numpy. Definitions follow the usual serving benchmarks (vLLM's
``benchmark_serving``): percentiles use numpy's linear interpolation, ITL percentiles are over
all gaps of all requests, TPOT is over requests with at least two tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PERCENTILES", "RequestTiming", "parse_slo", "summarize", "tenant_summary"]

PERCENTILES: tuple[int, ...] = (90, 95, 99)


@dataclass
class RequestTiming:
    """What a client saw for one request; all times in seconds on one clock.

    ``token_times_s`` holds when each streamed token arrived (ascending); ``output_tokens`` is
    the number of tokens generated. ``ok=False`` marks a failed request, left out of every
    latency statistic and of throughput; ``error`` says why when the client knows, and
    ``error_kind`` names the error for counting (``HTTP 400``, ``BrokenPipeError``).
    """

    send_s: float
    token_times_s: list[float]
    prompt_tokens: int
    output_tokens: int
    ok: bool = True
    error: str | None = None
    error_kind: str | None = None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token (None without tokens)."""
        return self.token_times_s[0] - self.send_s if self.token_times_s else None

    @property
    def e2e_s(self) -> float | None:
        """Send to last token (None without tokens)."""
        return self.token_times_s[-1] - self.send_s if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (last - first) / (n - 1), for n >= 2."""
        n = len(self.token_times_s)
        if n < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (n - 1)

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive tokens."""
        t = self.token_times_s
        return [b - a for a, b in zip(t[:-1], t[1:], strict=True)]


def _stats_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, median and PERCENTILES of ``values_s``, in milliseconds (None when empty)."""
    keys = ["mean", "median", *(f"p{p}" for p in PERCENTILES)]
    if len(values_s) == 0:
        return dict.fromkeys(keys)
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    out: dict[str, float | None] = {"mean": float(a.mean()), "median": float(np.median(a))}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(a, p, method="linear"))
    return out


def summarize(
    timings: list[RequestTiming],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict:
    """Aggregate metrics of one benchmark run lasting ``duration_s`` seconds.

    Returns ``completed``/``failed`` counts; ``request_throughput``, ``output_token_throughput``
    and ``total_token_throughput`` (prompt + output tokens) per second over ok requests;
    ``goodput``: ok requests per second that meet every SLO given (TTFT <= ``slo_ttft_ms``,
    TPOT <= ``slo_tpot_ms``; a request with one token has no TPOT and so cannot miss that SLO;
    a request without tokens misses a TTFT SLO), with ``good`` its count; and for ``ttft_ms``,
    ``tpot_ms``, ``itl_ms``, ``e2e_ms`` a dict of mean, median, p90, p95, p99 (None when no
    request contributes). A zero duration gives zero rates.
    """
    if duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s}")
    for name, slo in (("slo_ttft_ms", slo_ttft_ms), ("slo_tpot_ms", slo_tpot_ms)):
        if slo is not None and not slo > 0:
            raise ValueError(f"{name} must be None or > 0, got {slo}")

    ok = [t for t in timings if t.ok]
    ttfts = [v for t in ok if (v := t.ttft_s) is not None]
    tpots = [v for t in ok if (v := t.tpot_s) is not None]
    e2es = [v for t in ok if (v := t.e2e_s) is not None]
    itls = [g for t in ok for g in t.itls_s]

    good = 0
    for t in ok:
        ttft = t.ttft_s
        tpot = t.tpot_s
        if slo_ttft_ms is not None and (ttft is None or ttft * 1000.0 > slo_ttft_ms):
            continue
        if slo_tpot_ms is not None and tpot is not None and tpot * 1000.0 > slo_tpot_ms:
            continue
        good += 1

    def rate(x: float) -> float:
        return x / duration_s if duration_s > 0 else 0.0

    out_tokens = sum(t.output_tokens for t in ok)
    in_tokens = sum(t.prompt_tokens for t in ok)
    return {
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": rate(len(ok)),
        "output_token_throughput": rate(out_tokens),
        "total_token_throughput": rate(in_tokens + out_tokens),
        "good": good,
        "goodput": rate(good),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "ttft_ms": _stats_ms(ttfts),
        "tpot_ms": _stats_ms(tpots),
        "itl_ms": _stats_ms(itls),
        "e2e_ms": _stats_ms(e2es),
    }


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft_ms=500,tpot_ms=50`` -> {"ttft_ms": 500.0, "tpot_ms": 50.0}."""
    out: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in ("ttft_ms", "tpot_ms"):
            raise ValueError(f"--slo: unknown key {key!r} (known: ttft_ms, tpot_ms)")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {key} must be a number, got {value!r}") from None
    return out


def max_min_shares(demands: dict[str, float], capacity: float) -> dict[str, float]:
    """The max-min fair split of ``capacity`` over ``demands`` (water-filling): a tenant that
    asks less than an equal share gets all it asks, the rest split what remains."""
    shares: dict[str, float] = {}
    left, names = capacity, sorted(demands, key=demands.__getitem__)
    for k, name in enumerate(names):
        equal = left / (len(names) - k)
        shares[name] = min(demands[name], equal)
        left -= shares[name]
    return shares


def windowed_fairness(timings: Sequence[RequestTiming], tenants: Sequence[str | None],
                      num_windows: int = 10) -> tuple[float, dict[str, float]]:
    """Jain's index of the tenants' service against their max-min fair shares, per window.

    The contended span, from the first send to the last, is cut into ``num_windows``
    windows. In each, a tenant's *demand* is the work it has in the system (the prompt and
    output tokens of its requests sent by the window's end, less what it was served before
    the window) and its *service* the tokens it was served in the window (a prompt counts
    when its first token comes). Each tenant's ratio is its service over its max-min fair
    share of the window's service (:func:`max_min_shares`); Jain's index of the ratios of
    the tenants with demand is averaged over the windows. Returns that mean and each
    tenant's mean ratio.
    """

    arrive: dict[str, list[tuple[float, float]]] = {}
    serve: dict[str, list[tuple[float, float]]] = {}
    for t, tenant in zip(timings, tenants, strict=True):
        name = tenant or ""
        arrive.setdefault(name, []).append((t.send_s, t.prompt_tokens + t.output_tokens))
        events = serve.setdefault(name, [])
        if t.token_times_s:
            events.append((t.token_times_s[0], t.prompt_tokens))
            events.extend((x, 1.0) for x in t.token_times_s)

    def cumulative(events: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
        events.sort()
        times = np.array([e[0] for e in events])
        return times, np.concatenate([[0.0], np.cumsum([e[1] for e in events])])

    def upto(curve: tuple[np.ndarray, np.ndarray], x: float) -> float:
        times, sums = curve
        return float(sums[np.searchsorted(times, x, side="left")])

    arrived = {k: cumulative(v) for k, v in arrive.items()}
    served = {k: cumulative(v) for k, v in serve.items()}
    sends = [t.send_s for t in timings]
    edges = (np.linspace(min(sends), max(sends), num_windows + 1) if sends
             else np.empty(0))
    indexes, ratio_sums = [], dict.fromkeys(arrived, 0.0)
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        demand = {k: upto(arrived[k], b) - upto(served[k], a) for k in arrived}
        got = {k: upto(served[k], b) - upto(served[k], a) for k in arrived}
        demand = {k: v for k, v in demand.items() if v > 0}
        total = sum(got[k] for k in demand)
        if not demand or total <= 0:
            continue
        shares = max_min_shares(demand, total)
        ratios = {k: got[k] / shares[k] for k in demand}
        indexes.append(jain_index(list(ratios.values())))
        for k in arrived:
            ratio_sums[k] += ratios.get(k, 1.0)
    n = max(1, len(indexes))
    return (float(np.mean(indexes)) if indexes else 1.0,
            {k: v / n for k, v in ratio_sums.items()})


def tenant_summary(timings: Sequence[RequestTiming], tenants: Sequence[str | None],
                   heavy: str = "heavy") -> dict:
    """Per-tenant service of one run (``tenants[i]`` is request ``i``'s tenant).

    ``jain_index`` and ``fair_share_ratio``: :func:`windowed_fairness` (1 = every tenant got
    its max-min fair share of the service in every window; fcfs serving a heavy tenant's
    backlog ahead of light tenants falls below). ``light_ttft_ms``: TTFT statistics of every
    tenant but ``heavy``. ``longest_wait_ms``: the longest TTFT of any request.
    ``not_served_fraction``: requests rejected or timed out (not ok).
    """
    if len(timings) != len(tenants):
        raise ValueError(f"got {len(tenants)} tenants for {len(timings)} requests")
    jain, ratios = windowed_fairness(timings, tenants)
    light = [v for t, tenant in zip(timings, tenants, strict=True)
             if tenant != heavy and t.ok and (v := t.ttft_s) is not None]
    waits = [v for t in timings if t.ok and (v := t.ttft_s) is not None]
    return {
        "fair_share_ratio": ratios,
        "jain_index": jain,
        "light_ttft_ms": _stats_ms(light),
        "longest_wait_ms": max(waits) * 1000.0 if waits else None,
        "not_served_fraction": (sum(1 for t in timings if not t.ok) / len(timings)
                                if timings else 0.0),
    }


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index of ``values`` (e.g. the tenants' service rates): 1 when all are
    equal, 1/n when one has everything."""
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares > 0 else 1.0
