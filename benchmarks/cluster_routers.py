"""Routers on the sessions workload: 4 Llama-3-8B replicas on H100s, 2,000 chat turns.

    .venv/bin/python benchmarks/cluster_routers.py   # ~5 min here; runs already written are kept

Each run is one `kvflow simulate` command (printed); their reports go to
`reports/cluster/sessions_NAME/`. Prints the table of docs/simulator.md and writes
`docs/img/sim_cluster_routers.png`: hit rate, the share of later turns on their session's
previous replica, and TTFT percentiles per router.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from kvflow.cli import make_parser
from kvflow.reports.writers import pyplot, save_figure
from kvflow.workloads.azure import load_azure_trace
from kvflow.workloads.synthetic import sessions_workload

COMMON = ["simulate", "--replicas", "4", "--prefix-caching", "--workload", "sessions",
          "--request-rate", "8", "--num-prompts", "2000", "--system-prompt-len", "256",
          "--policy", "chunked", "--slo", "ttft_ms=1000,tpot_ms=50", "--no-progress"]
RUNS = {"round_robin": ["--router", "round_robin"],
        "least_loaded": ["--router", "least_loaded"],
        "prefix_aware_w0": ["--router", "prefix_aware", "--overlap-weight", "0"],
        "prefix_aware": ["--router", "prefix_aware"],
        "prefix_aware_w4": ["--router", "prefix_aware", "--overlap-weight", "4"]}


def main() -> None:
    rows = []
    args = make_parser().parse_args(COMMON)
    lengths, _ = load_azure_trace(args.trace, max_prompt_tokens=6144, max_output_tokens=2048)
    w = sessions_workload(lengths, 2000, 8.0, 0, 4, 20.0, 256, 6144)
    for name, flags in RUNS.items():
        out = Path("reports/cluster") / f"sessions_{name}"
        argv = [*COMMON, *flags, "--out", str(out)]
        print("kvflow " + shlex.join(argv), flush=True)
        if not (out / "report.json").is_file():
            ns = make_parser().parse_args(argv)
            ns.func(ns)
        report = json.loads((out / "report.json").read_text())
        instance = [r["instance"] for r in report["requests"]]
        home: dict[int, int] = {}
        same = later = 0
        for i, session in enumerate(w.sessions):
            if session in home:
                later += 1
                same += instance[i] == home[session]
            home[session] = instance[i]
        c, s = report["config"]["cluster"], report["summary"]
        rows.append({"name": name, "hit_rate": c["hit_rate"], "sticky": same / later,
                     "ttft": s["ttft_ms"], "tpot": s["tpot_ms"],
                     "balance": c["requests_balance"], "busy_balance": c["busy_balance"]})
    for r in rows:
        t, p = r["ttft"], r["tpot"]
        print(f"| {r['name']} | {r['hit_rate']:.1%} | {r['sticky']:.0%} | {t['median']:.0f} | "
              f"{t['p90']:.0f} | {t['p99']:.0f} | {p['median']:.1f} | {p['p90']:.1f} | "
              f"{p['p99']:.1f} | {r['balance']:.2f} | {r['busy_balance']:.2f} |")
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    names = [r["name"].replace("prefix_aware_w", "prefix_aware\nweight ") for r in rows]
    x = range(len(rows))
    axes[0].bar([i - 0.2 for i in x], [r["hit_rate"] for r in rows], 0.4,
                label="prefix-cache hit rate")
    axes[0].bar([i + 0.2 for i in x], [r["sticky"] for r in rows], 0.4,
                label="later turns on their session's replica")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    axes[0].set_title("Cache reuse per router")
    for key, marker in (("median", "o"), ("p90", "s"), ("p99", "^")):
        axes[1].plot(list(x), [r["ttft"][key] for r in rows], marker=marker, label=key)
    axes[1].set_ylabel("TTFT (ms)")
    axes[1].set_title("TTFT per router")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(list(x), names, fontsize=8)
        ax.grid(alpha=0.3)
    save_figure(fig, Path("docs/img/sim_cluster_routers.png"))


if __name__ == "__main__":
    main()
