"""The report of one serving run (``report.json``, ``summary.md``, latency CDFs and server
series plots): what ``bench serve`` writes for a real server and ``simulate`` for a simulated
one, field for field."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from kvflow.reports.summary import RequestTiming, summarize
from kvflow.reports.writers import pyplot, save_figure, write_report

SHOWN_ERRORS = 10  # failed requests listed in summary.md (report.json lists every one)


def _plots(out: Path, timings: list[RequestTiming], series: list[dict[str, float]]) -> list[str]:
    plt = pyplot()
    import numpy as np

    files = []
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (name, values) in zip(axes, (
            ("TTFT (ms)", [t.ttft_s * 1e3 for t in timings if t.ok and t.ttft_s is not None]),
            ("TPOT (ms)", [t.tpot_s * 1e3 for t in timings if t.ok and t.tpot_s is not None]),
            ("E2E latency (ms)", [t.e2e_s * 1e3 for t in timings if t.ok and t.e2e_s is not None]),
    ), strict=True):
        if values:
            xs = np.sort(values)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    fig.suptitle("Latency CDFs")
    files.append(save_figure(fig, out / "latency_cdf.png"))

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (key, label) in zip(axes, (("kvflow_num_requests_running", "running batch"),
                                       ("kvflow_num_requests_waiting", "waiting requests"),
                                       ("kvflow_kv_cache_usage_ratio", "KV cache usage")),
                                strict=True):
        pts = [(s["t_s"], s[key]) for s in series if key in s]
        if pts:
            ax.plot(*zip(*pts, strict=True), drawstyle="steps-post", marker=".")
        ax.set_xlabel("time (s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle("Server state over time (scraped from /metrics)")
    files.append(save_figure(fig, out / "server_series.png"))
    return files


def tenant_line(ts: dict[str, Any]) -> str:
    """One summary line of :func:`~kvflow.reports.summary.tenant_summary`."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f} ms"

    light = ts["light_ttft_ms"]
    return (f"\nTenants: Jain's index of service against fair shares {ts['jain_index']:.3f}; "
            f"light tenants' TTFT mean {ms(light['mean'])}, p99 {ms(light['p99'])}; longest "
            f"wait {ms(ts['longest_wait_ms'])}; {ts['not_served_fraction']:.1%} rejected or "
            "timed out.")


def write_serve_report(out: Path, title: str, config: dict[str, Any],
                       timings: list[RequestTiming], duration_s: float,
                       series: list[dict[str, float]],
                       request_extra: dict[str, list[Any]] | None = None,
                       extra_plots: list[str] | None = None,
                       extra_lines: list[str] | None = None,
                       echo: bool = True) -> dict[str, Any]:
    """The ``bench serve`` report (``report.json``, ``summary.md``, latency CDFs and server
    series plots) of one run; ``kvflow simulate`` writes the same, field for field, adding
    per-request columns (``request_extra``), plots and summary lines of its own."""
    slo = config.get("slo", {})
    summary = summarize(timings, duration_s, slo.get("ttft_ms"), slo.get("tpot_ms"))
    out.mkdir(parents=True, exist_ok=True)
    errors = failures(timings)
    summary["failed_by_kind"] = dict(Counter(e["kind"] for e in errors).most_common())
    requests = [{"send_s": t.send_s, "ttft_s": t.ttft_s, "tpot_s": t.tpot_s,
                 "e2e_s": t.e2e_s, "prompt_tokens": t.prompt_tokens,
                 "output_tokens": t.output_tokens, "ok": t.ok} for t in timings]
    for key, values in (request_extra or {}).items():
        for row, value in zip(requests, values, strict=True):
            row[key] = value
    report = {"config": config, "summary": summary, "requests": requests, "errors": errors,
              "server_series": series}
    report["plots"] = _plots(out, timings, series) + list(extra_plots or [])
    (out / "report.json").write_text(json.dumps(report, indent=1, default=float))
    rate = config.get("request_rate")
    lines = [f"# {title}: {config['workload']} workload, {len(timings)} requests", "",
             f"Request rate {rate if rate is not None else '-'}, max concurrency "
             f"{config.get('max_concurrency') or 'unbounded'}, duration {duration_s:.1f} s.",
             "", "| metric | value |", "|---|---|"]
    for key in ("completed", "failed", "request_throughput", "output_token_throughput",
                "total_token_throughput", "goodput"):
        value = summary[key]
        lines.append(f"| {key} | {value:.3f} |" if isinstance(value, float)
                     else f"| {key} | {value} |")
    lines += ["", "| latency (ms) | mean | median | p90 | p95 | p99 |", "|---|---|---|---|---|---|"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[key]
        cells = [("-" if stats[s] is None else f"{stats[s]:.1f}")
                 for s in ("mean", "median", "p90", "p95", "p99")]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    if errors:
        lines += ["", failure_line(errors, len(timings), summary["failed_by_kind"]) + ":", ""]
        lines += [f"- request {e['index']}: {e['kind']}: {e['error']}"
                  for e in errors[:SHOWN_ERRORS]]
        if len(errors) > SHOWN_ERRORS:
            lines.append(f"- and {len(errors) - SHOWN_ERRORS} more (report.json, `errors`)")
    if "note" in config:
        lines += ["", f"Trace lengths: {config['note']}."]
    lines += list(extra_lines or [])
    lines += ["", "Plots: " + ", ".join(f"![]({p})" for p in report["plots"])]
    write_report(out / "summary.md", lines, echo=echo)
    return report


def failures(timings: list[RequestTiming]) -> list[dict[str, Any]]:
    """Each failed request: its index in the workload, its error's kind and message (both
    ``unknown`` where the client recorded none, as for the simulator's rejections)."""
    return [{"index": i, "kind": t.error_kind or "unknown", "error": t.error or "unknown"}
            for i, t in enumerate(timings) if not t.ok]


def failure_line(errors: list[dict[str, Any]], num_requests: int,
                 by_kind: dict[str, int]) -> str:
    """``5 of 16 requests failed (BrokenPipeError: 5)``."""
    kinds = ", ".join(f"{kind}: {count}" for kind, count in by_kind.items())
    return f"{len(errors)} of {num_requests} requests failed ({kinds})"
