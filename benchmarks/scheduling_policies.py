"""What each scheduling policy does to mean and tail latency, and to fairness between tenants.

The multi-tenant workload (``--workload tenants``): one heavy tenant sends long prompts at a
high rate, four light tenants send short chats, all on the Azure trace's lengths.

* ``--part sim`` (default): the real scheduler in simulated time at GPU scale (Llama-3-8B on
  one H100, the roofline cost model of docs/simulator.md), past full load: fcfs, sjf,
  priority (light tenants first) and fair (VTC), each with and without SLO admission, all
  with chunked prefill.
* ``--part served``: the same comparison for fcfs, sjf and fair on this machine, one real
  tritonserver per policy, at a scale two CPU cores can hold.

Each part writes ``summary.md``, ``results.json`` and a plot of mean against P99 per policy
under ``--out``, and names the policy that wins and the one that loses each column.

    python benchmarks/scheduling_policies.py --part sim
    python benchmarks/scheduling_policies.py --part served --engine engines/smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from kvflow.reports.summary import summarize, tenant_summary
from kvflow.reports.writers import pyplot, save_figure, write_report
from kvflow.workloads.azure import default_trace, load_azure_trace
from kvflow.workloads.specs import RequestSpec
from kvflow.workloads.synthetic import tenants_workload

# (column, key in a row, lower is better)
COLUMNS = [("mean TTFT ms", "ttft_mean", True), ("P99 TTFT ms", "ttft_p99", True),
           ("mean E2E ms", "e2e_mean", True), ("P99 E2E ms", "e2e_p99", True),
           ("light P99 TTFT ms", "light_ttft_p99", True), ("Jain's index", "jain", False),
           ("longest wait ms", "longest_wait", True),
           ("rejected or timed out", "not_served", True)]


def tenant_specs(n: int, rate: float, max_model_len: int, length_scale: float,
                 seed: int) -> list[RequestSpec]:
    max_prompt = max_model_len * 3 // 4
    lengths, _ = load_azure_trace(default_trace(), max_prompt_tokens=max_prompt,
                                  max_output_tokens=max_model_len - max_prompt,
                                  length_scale=length_scale)
    return tenants_workload(lengths, n, rate, seed)


def row_of(name: str, timings: list, specs: list[RequestSpec], duration_s: float,
           extra: dict[str, Any] | None = None) -> dict[str, Any]:
    s = summarize(timings, duration_s)
    t = tenant_summary(timings, [sp.tenant for sp in specs])
    return {"policy": name, "ttft_mean": s["ttft_ms"]["mean"], "ttft_p99": s["ttft_ms"]["p99"],
            "e2e_mean": s["e2e_ms"]["mean"], "e2e_p99": s["e2e_ms"]["p99"],
            "light_ttft_p99": t["light_ttft_ms"]["p99"], "jain": t["jain_index"],
            "longest_wait": t["longest_wait_ms"], "not_served": t["not_served_fraction"],
            "throughput_req_s": s["request_throughput"],
            "fair_share_ratio": t["fair_share_ratio"], **(extra or {})}


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """For each column, the policy that wins it and the one that loses it."""
    lines = []
    for label, key, lower in COLUMNS:
        vals = [(r[key], r["policy"]) for r in rows if r[key] is not None]
        if len({v for v, _ in vals}) <= 1:
            lines.append(f"- {label}: a tie ({vals[0][0]:.3g})" if vals else f"- {label}: -")
            continue
        best_v = min(v for v, _ in vals) if lower else max(v for v, _ in vals)
        worst_v = max(v for v, _ in vals) if lower else min(v for v, _ in vals)
        best = ", ".join(n for v, n in vals if v == best_v)
        worst = ", ".join(n for v, n in vals if v == worst_v)
        lines.append(f"- {label}: **{best}** wins ({best_v:.3g}), **{worst}** loses "
                     f"({worst_v:.3g})")
    return lines


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = "| policy | " + " | ".join(c for c, _, _ in COLUMNS) + " | req/s |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for r in rows:
        cells = []
        for _, key, _ in COLUMNS:
            v = r[key]
            cells.append("-" if v is None else f"{v:.1%}" if key == "not_served"
                         else f"{v:.3f}" if key == "jain" else f"{v:.0f}")
        lines.append(f"| {r['policy']} | " + " | ".join(cells)
                     + f" | {r['throughput_req_s']:.2f} |")
    return lines


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> str:
    """Mean against P99, TTFT and E2E, one point per policy."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (what, mean_key, p99_key) in zip(axes[:2], (("TTFT", "ttft_mean", "ttft_p99"),
                                                        ("E2E", "e2e_mean", "e2e_p99")),
                                             strict=True):
        points: dict[tuple[float, float], list[str]] = {}  # policies that coincide: one label
        for r in rows:
            if r[mean_key] is not None:
                xy = (round(r[mean_key] / 1e3, 2), round(r[p99_key] / 1e3, 2))
                points.setdefault(xy, []).append(r["policy"])
        for (x, y), names in points.items():
            ax.scatter(x, y, s=40)
            ax.annotate(" = ".join(names), (x, y), fontsize=8, xytext=(4, 4),
                        textcoords="offset points")
        ax.set_xlabel(f"mean {what} (s)")
        ax.set_ylabel(f"P99 {what} (s)")
        ax.set_title(f"{what}: mean vs P99 (lower left is better)")
        ax.grid(alpha=0.3)
    names = [r["policy"] for r in rows]
    axes[2].barh(names, [r["jain"] for r in rows], color="tab:green", alpha=0.7,
                 label="Jain's index")
    light = [(r["light_ttft_p99"] or 0) / 1e3 for r in rows]
    top = max(light) or 1.0
    axes[2].barh(names, [v / top for v in light], color="tab:red", alpha=0.4, height=0.4,
                 label=f"light tenants' P99 TTFT (/ {top:.2f} s)")
    axes[2].set_xlim(0, 1.05)
    axes[2].invert_yaxis()
    axes[2].legend(fontsize=7, loc="lower right")
    axes[2].set_title("Fairness")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def run_sim(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    from dataclasses import replace

    from kvflow.orchestrator.options import EngineOptions
    from kvflow.sim.cost_model import HARDWARE, MODELS, RooflineCostModel
    from kvflow.sim.simulator import simulate
    from kvflow.workloads.modes import mode_scheduler_options

    model = replace(MODELS["llama-3-8b"], tp=1)
    cost = RooflineCostModel(HARDWARE["H100"], model)
    num_blocks = model.kv_blocks_for(HARDWARE["H100"], 16)
    specs = tenant_specs(args.num_prompts, args.rate, 8192, 1.0, args.seed)
    rows = []
    for mode in ("chunked", "sjf", "priority", "fair"):
        for slo in (None, args.max_queue_delay_ms):
            options = mode_scheduler_options(mode, 256, 8192, 2048)
            options["max_queue_delay_ms"] = slo
            name = ("fcfs" if mode == "chunked" else mode) + (" + SLO" if slo else "")
            t0 = time.perf_counter()
            result = simulate(specs, cost, EngineOptions(**options), num_blocks)
            wall = time.perf_counter() - t0
            rows.append(row_of(name, result.timings, specs, result.duration_s,
                               {"wall_s": wall, "steps": len(result.steps)}))
            print(f"{name}: {wall:.1f} s", flush=True)
    return rows


def run_served(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    from kvflow.loadgen.sender import run_load
    from kvflow.triton_backend.launcher import ServerConfig, TritonServer
    from kvflow.workloads.prompts import make_prompts

    specs = tenant_specs(args.num_prompts, args.rate, args.max_model_len, args.length_scale,
                         args.seed)
    texts = make_prompts(specs, args.engine, args.seed)
    rows = []
    for policy in ("fcfs", "sjf", "fair"):
        cfg = ServerConfig.on_free_ports(args.engine, {
            "policy": policy, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.chunk_tokens, "enable_chunked_prefill": True,
            "max_model_len": args.max_model_len, "enable_prefix_caching": False},
            ready_timeout_s=600)
        with TritonServer(cfg, log_path=out / f"tritonserver-{policy}.log") as server:
            run_load(server.grpc_url, specs[:4], texts[:4], None, progress=False)  # warm up
            timings, duration = run_load(server.grpc_url, specs, texts, None,
                                         desc=policy)
        rows.append(row_of(policy, timings, specs, duration))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["sim", "served"], default="sim")
    p.add_argument("--out", default=None, help="default reports/scheduling/PART")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="default 1000 (sim), 40 (served)")
    p.add_argument("--rate", type=float, default=None,
                   help="requests/s; default 24 (sim: ~1.5x the H100's capacity for this "
                        "workload), 0.45 (served: ~1.1x this machine's capacity)")
    p.add_argument("--max-queue-delay-ms", type=float, default=1000.0,
                   help="sim: SLO admission's bound")
    p.add_argument("--engine", default="engines/smollm2-135m", help="served: the engine")
    p.add_argument("--max-model-len", type=int, default=1024, help="served")
    p.add_argument("--length-scale", type=float, default=0.25, help="served: trace lengths x")
    p.add_argument("--max-num-seqs", type=int, default=8, help="served")
    p.add_argument("--chunk-tokens", type=int, default=256, help="served")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--docs-img", default="docs/img", help="where the plot is copied")
    args = p.parse_args()
    sim = args.part == "sim"
    args.num_prompts = args.num_prompts or (1000 if sim else 40)
    args.rate = args.rate or (24.0 if sim else 0.45)
    out = Path(args.out or f"reports/scheduling/{args.part}")
    out.mkdir(parents=True, exist_ok=True)
    rows = run_sim(args, out) if sim else run_served(args, out)
    where = ("Llama-3-8B on one H100 (simulated, roofline cost model)" if sim
             else f"{args.engine} served by tritonserver on this machine")
    title = (f"Scheduling policies, tenants workload: {args.num_prompts} requests at "
             f"{args.rate:g} req/s, {where}")
    png = plot(rows, out / "policies.png", title)
    if args.docs_img:
        Path(args.docs_img).mkdir(parents=True, exist_ok=True)
        shutil.copy(out / "policies.png", Path(args.docs_img) / f"scheduling_{args.part}.png")
    lines = [f"# {title}", "", *table(rows), "", "Who wins and who loses each column:", "",
             *verdicts(rows), "", f"![policies]({png})"]
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows},
                                                 indent=1, default=float))
    write_report(out / "summary.md", lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
