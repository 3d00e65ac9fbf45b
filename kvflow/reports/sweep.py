"""A sweep over request rates, one curve per batching mode (``bench compare`` and ``simulate``
sweeps): the highest rate that meets a TTFT SLO, and the latency-throughput chart."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvflow.reports.writers import pyplot, save_figure
from kvflow.workloads.modes import MODE_LABELS


def max_sustained_rate(points: list[dict[str, Any]], slo_ttft_ms: float) -> float | None:
    """The highest rate such that it and every lower swept rate completed every request with
    P99 TTFT within ``slo_ttft_ms`` (None: not even the lowest)."""
    best = None
    for point in sorted(points, key=lambda p: p["rate"]):
        s = point["summary"]
        p99 = s["ttft_ms"]["p99"]
        if s["failed"] or p99 is None or p99 > slo_ttft_ms:
            break
        best = point["rate"]
    return best


def fmt_value(value: float | None, spec: str = ".0f") -> str:
    """``value`` formatted, or "-" for a statistic no request contributed to."""
    return "-" if value is None else format(value, spec)


def plot_sweep(out: Path, results: dict[str, list[dict[str, Any]]], slo_ttft_ms: float,
               hf: dict[str, Any] | None, filename: str = "compare.png") -> str:
    """P99 TTFT and E2E against throughput, and P99 TTFT against the offered rate, one curve
    per mode (``bench compare`` and ``simulate`` sweeps); returns the file name."""
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for mode, points in results.items():
        tput = [p["summary"]["output_token_throughput"] for p in points]
        ttft = [(p["summary"]["ttft_ms"]["p99"] or math.nan) / 1e3 for p in points]
        e2e = [(p["summary"]["e2e_ms"]["p99"] or math.nan) / 1e3 for p in points]
        for ax, ys in ((axes[0], ttft), (axes[1], e2e)):
            (line,) = ax.plot(tput, ys, marker="o", label=MODE_LABELS[mode])
            for x, y, p in zip(tput, ys, points, strict=True):
                ax.annotate(f"{p['rate']:g}", (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=line.get_color())
        finite = [(p["rate"], t) for p, t in zip(points, ttft, strict=True)
                  if math.isfinite(p["rate"])]
        if finite:
            axes[2].plot(*zip(*finite, strict=True), marker="o", label=MODE_LABELS[mode])
    for ax, title in ((axes[0], "P99 TTFT vs output throughput"),
                      (axes[1], "P99 E2E latency vs output throughput")):
        ax.set_xlabel("output tokens/s (labels: offered req/s)")
        ax.set_ylabel("seconds")
        ax.set_yscale("log")
        ax.set_title(title)
        if hf is not None:
            ax.axvline(hf["output_token_throughput"], color="grey", linestyle=":",
                       label=f"HF generate, static batches of {hf['batch_size']}")
    if math.isfinite(slo_ttft_ms):
        for ax in (axes[0], axes[2]):
            ax.axhline(slo_ttft_ms / 1e3, color="red", linestyle="--", linewidth=1,
                       label="TTFT SLO")
    axes[2].set_xlabel("offered request rate (req/s)")
    axes[2].set_ylabel("P99 TTFT (s)")
    axes[2].set_yscale("log")
    axes[2].set_title("P99 TTFT vs request rate")
    from matplotlib.ticker import FormatStrFormatter

    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    return save_figure(fig, out / filename)
