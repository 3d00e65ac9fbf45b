"""Goodput as DistServe defines it: the highest request rate at which a target share of the
requests meets both the TTFT and the TPOT SLO; per GPU, that rate over the GPUs serving it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvflow.reports.summary import RequestTiming


def slo_attainment(timings: Sequence[RequestTiming], ttft_ms: float | None,
                   tpot_ms: float | None) -> float:
    """The share of requests meeting every SLO given: TTFT <= ``ttft_ms`` and TPOT <=
    ``tpot_ms`` (a request with one token has no TPOT and cannot miss that one; a failed
    request, or one without tokens, misses both)."""
    if not timings:
        raise ValueError("no requests to measure SLO attainment on")
    good = 0
    for t in timings:
        ttft, tpot = t.ttft_s, t.tpot_s
        if not t.ok or ttft is None:
            continue
        if ttft_ms is not None and ttft * 1e3 > ttft_ms:
            continue
        if tpot_ms is not None and tpot is not None and tpot * 1e3 > tpot_ms:
            continue
        good += 1
    return good / len(timings)


def find_goodput(attainment_at: Callable[[float], float], target: float = 0.9,
                 start_rate: float = 1.0, iterations: int = 6,
                 max_steps: int = 16) -> tuple[float | None, dict[float, float]]:
    """The highest rate (req/s) whose attainment is >= ``target``, and every rate tried with
    its attainment.

    From ``start_rate``, the rate doubles while it attains (or halves until it does), which
    brackets the answer between a rate that attains and one that does not; ``iterations``
    bisections narrow the bracket, and its attaining end is returned. None: not even
    ``start_rate / 2**max_steps`` attains. Attainment is assumed to fall as the rate rises;
    a sampled run is not exactly monotone, so the answer is a bracket's lower end, not a
    guarantee for every lower rate.
    """
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target}")
    if not start_rate > 0:
        raise ValueError(f"start_rate must be > 0, got {start_rate}")
    tried: dict[float, float] = {}

    def attains(rate: float) -> bool:
        if rate not in tried:
            tried[rate] = attainment_at(rate)
        return tried[rate] >= target

    rate, lo, hi = start_rate, None, None
    if attains(rate):
        lo = rate
        for _ in range(max_steps):
            rate *= 2
            if not attains(rate):
                hi = rate
                break
            lo = rate
        else:
            return lo, tried  # attains at every rate tried: the workload never saturates
    else:
        hi = rate
        for _ in range(max_steps):
            rate /= 2
            if attains(rate):
                lo = rate
                break
            hi = rate
        else:
            return None, tried
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if attains(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried
