"""Arrival processes: gamma (Poisson at burstiness 1) inter-arrival gaps, and a request
stream retimed to another mean rate. Times are seconds relative to the first request, which
arrives at 0.0; every generator takes a seed and is reproducible for it."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from kvflow.workloads.specs import RequestSpec


def check_n_rate(n: int, rate: float) -> None:
    """A workload's request count (>= 1) and rate (> 0 requests/s, inf allowed)."""
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
    check_n_rate(n, rate)
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


def retime(specs: list[RequestSpec], rate: float) -> list[RequestSpec]:
    """The same requests with arrival times stretched so that their mean rate is ``rate``
    (requests per second over the span, ``(n-1)/span``), keeping the pattern of gaps (a
    trace's bursts stay bursts); ``rate=inf`` sends them all at 0.0."""
    check_n_rate(len(specs), rate)
    span = specs[-1].arrival_s - specs[0].arrival_s
    if math.isinf(rate) or len(specs) == 1 or span <= 0:
        factor = 0.0
    else:
        factor = (len(specs) - 1) / span / rate
    t0 = specs[0].arrival_s
    return [replace(s, arrival_s=(s.arrival_s - t0) * factor) for s in specs]
