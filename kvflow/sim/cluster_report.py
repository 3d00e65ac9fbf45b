"""A simulated cluster's part of the report: the summary lines of its instances, its transfers
and its SLO attainment, ``cluster.png`` and ``goodput.png``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvflow.reports.writers import pyplot, save_figure
from kvflow.sim.simulator import ClusterResult
from kvflow.workloads.modes import MODE_LABELS


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def cluster_lines(c: dict[str, Any], stats: list[dict[str, Any]], mode: str, wall: float,
                  steps: int) -> list[str]:
    """The cluster's part of ``summary.md``."""
    shape = (f"{c['prefill']} prefill + {c['decode']} decode instances, KV over "
             f"{c['link']}" if "prefill" in c else f"{c['replicas']} replicas")
    over = "prefill instances" if "prefill" in c else "replicas"
    lines = ["", f"Cluster: {shape}, router {c['router']} (overlap weight "
             f"{c['overlap_weight']:g}), {c['gpus']} GPUs (tp={c['tp']}); "
             f"{MODE_LABELS[mode]}. Simulated in {wall:.1f} s of wall time ({steps} engine "
             f"steps).", "",
             f"Prefix-cache hit rate {pct(c['hit_rate'])} (hit tokens / prompt tokens looked "
             f"up); load balance, max / mean over the {over}: "
             f"requests {c['requests_balance'] or 0:.2f}, prompt tokens "
             f"{c['prompt_tokens_balance'] or 0:.2f}, busy time {c['busy_balance'] or 0:.2f}."]
    if "transfer_ms_mean" in c:
        lines.append(f"KV transfers: {c['transfer_gb']:.1f} GB, {c['transfer_ms_mean']:.2f} ms "
                     f"mean (p99 {c['transfer_ms_p99']:.2f} ms) on the link after "
                     f"{c['link_wait_ms_mean']:.2f} ms mean waiting for it.")
    if "slo_attainment" in c:
        lines.append(f"SLO attainment (TTFT and TPOT together): {c['slo_attainment']:.1%}.")
    lines += ["", "| instance | role | requests | prompt tokens | tokens prefilled | output "
              "tokens | busy | hit rate | preemptions |", "|---|---|---|---|---|---|---|---|---|"]
    for s in stats:
        lines.append(f"| {s['instance']} | {s['role']} | {s['requests']} | "
                     f"{s['prompt_tokens']} | {s['prefill_tokens']} | {s['output_tokens']} | "
                     f"{s['busy_fraction']:.0%} | {pct(s['hit_rate'])} | "
                     f"{s['preemptions']} |")
    return lines


def plot_cluster(out: Path, result: ClusterResult) -> str:
    """``cluster.png``: each instance's requests and busy fraction, its hit rate, and its KV
    usage over time."""
    plt = pyplot()
    stats = result.instances
    names = [f"{s['instance']} ({str(s['role'])[0]})" for s in stats]
    x = np.arange(len(stats))
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    axes[0].bar(x - 0.2, [s["requests"] for s in stats], 0.4, label="requests")
    ax2 = axes[0].twinx()
    ax2.bar(x + 0.2, [s["busy_fraction"] for s in stats], 0.4, color="tab:orange",
            label="busy fraction")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("busy fraction (orange)")
    axes[0].set_ylabel("requests (blue)")
    axes[0].set_title("Load per instance")
    axes[1].bar(x, [s["hit_rate"] or 0.0 for s in stats], color="tab:green")
    axes[1].set_ylim(0, 1.0)
    axes[1].set_ylabel("prefix-cache hit rate")
    axes[1].set_title("Hit tokens / prompt tokens")
    for ax in axes[:2]:
        ax.set_xticks(x, names)
        ax.set_xlabel("instance (r replica, p prefill, d decode)")
    t = [r["t_s"] for r in result.series]
    for name, s in zip(names, stats, strict=True):
        axes[2].plot(t, [r.get(f"kv_usage_{s['instance']}", np.nan) for r in result.series],
                     label=name, linewidth=0.8)
    axes[2].set_ylim(0, 1.02)
    axes[2].set_xlabel("simulated time (s)")
    axes[2].set_ylabel("KV blocks used")
    axes[2].set_title("KV usage per instance")
    axes[2].legend(fontsize=7, ncol=2)
    for ax in axes:
        ax.grid(alpha=0.3)
    return save_figure(fig, out / "cluster.png")


def fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def plot_goodput(out: Path, points: list[dict[str, Any]], target: float,
                 rate: float | None) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot([p["rate"] for p in points], [p["attainment"] for p in points], marker="o")
    ax.axhline(target, color="grey", linestyle="--", linewidth=0.8, label="target")
    if rate is not None:
        ax.axvline(rate, color="tab:green", linewidth=0.8, label=f"goodput {rate:.3g} req/s")
    ax.set_xscale("log")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("requests within the SLOs")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, out / "goodput.png")
