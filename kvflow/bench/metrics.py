"""Serving metrics from per-request token timestamps: TTFT, TPOT, ITL, E2E, throughput, goodput.

Pure Python + numpy. Definitions follow the usual serving benchmarks (vLLM's
``benchmark_serving``): percentiles use numpy's linear interpolation, ITL percentiles are over
all gaps of all requests, TPOT is over requests with at least two tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PERCENTILES", "RequestTiming", "summarize"]

PERCENTILES: tuple[int, ...] = (90, 95, 99)


@dataclass
class RequestTiming:
    """What a client saw for one request; all times in seconds on one clock.

    ``token_times_s`` holds when each streamed token arrived (ascending); ``output_tokens`` is
    the number of tokens generated. ``ok=False`` marks a failed request, left out of every
    latency statistic and of throughput.
    """

    send_s: float
    token_times_s: list[float]
    prompt_tokens: int
    output_tokens: int
    ok: bool = True

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
