"""What the OpenAI frontend costs over Triton gRPC: one server, one load, both front doors.

    python benchmarks/openai_overhead.py --engine engines/smollm2-135m

One tritonserver and one ``kvflow openai`` frontend. The same closed-loop load (every request
greedy, exactly ``--output-tokens`` long, at most ``--concurrency`` in flight) is sent through
Triton's gRPC streaming endpoint and through ``/v1/completions`` (SSE), alternately, for
``--rounds`` rounds each, so that drift in the machine's speed falls on both alike. Reports
output tok/s and mean TTFT for each, and the frontend's cost in throughput; writes
``report.json``, ``summary.md`` and ``openai_overhead.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from kvflow.loadgen.clients import OpenAIClient, TritonGrpcClient
from kvflow.loadgen.sender import run_load
from kvflow.openai_api import FrontendConfig, FrontendProcess
from kvflow.reports.summary import summarize
from kvflow.reports.writers import pyplot, save_figure, write_report
from kvflow.triton_backend.launcher import ServerConfig, TritonServer
from kvflow.utils.procs import free_port
from kvflow.workloads.prompts import make_prompts
from kvflow.workloads.synthetic import random_workload


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/smollm2-135m")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--input-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="reports/openai_overhead")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    specs = random_workload(args.requests, args.input_tokens, args.output_tokens,
                            float("inf"), 1.0, 0)
    prompts = make_prompts(specs, args.engine, 0)
    cfg = ServerConfig.on_free_ports(args.engine, {})
    runs: dict[str, list[dict]] = {"triton-grpc": [], "openai-completions": []}
    with (TritonServer(cfg, log_path=out / "tritonserver.log") as server,
          FrontendProcess(FrontendConfig((server.grpc_url,), port=free_port()),
                          log_path=out / "frontend.log") as frontend):
        clients = [TritonGrpcClient(server.grpc_url), OpenAIClient(frontend.url)]
        for client in clients:  # warm-up: first requests, connections
            run_load(client, specs[:4], prompts[:4], 4, progress=False)
        for r in range(args.rounds):
            for client in clients:
                timings, duration = run_load(client, specs, prompts, args.concurrency,
                                             progress=False)
                s = summarize(timings, duration)
                assert s["completed"] == len(specs), f"{client.name}: {s['failed']} failed"
                runs[client.name].append({
                    "round": r, "output_tok_s": s["output_token_throughput"],
                    "mean_ttft_ms": s["ttft_ms"]["mean"], "mean_tpot_ms": s["tpot_ms"]["mean"],
                    "duration_s": duration})
                print(f"round {r} {client.name:20s} {s['output_token_throughput']:7.1f} tok/s "
                      f" mean TTFT {s['ttft_ms']['mean']:7.1f} ms", flush=True)

    mean = {name: {k: statistics.mean(run[k] for run in rs)
                   for k in ("output_tok_s", "mean_ttft_ms", "mean_tpot_ms")}
            for name, rs in runs.items()}
    grpc, oai = mean["triton-grpc"], mean["openai-completions"]
    cost = 1.0 - oai["output_tok_s"] / grpc["output_tok_s"]
    report = {"config": vars(args), "runs": runs, "mean": mean,
              "throughput_cost": cost, "target": 0.10}
    (out / "report.json").write_text(json.dumps(report, indent=1))

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    names = list(mean)
    for ax, key, label in ((axes[0], "output_tok_s", "output tok/s"),
                           (axes[1], "mean_ttft_ms", "mean TTFT (ms)")):
        ax.bar(names, [mean[n][key] for n in names], color=["#4c72b0", "#dd8452"])
        for n_i, n in enumerate(names):
            ax.scatter([n_i] * len(runs[n]), [run[key] for run in runs[n]], color="k", s=12,
                       zorder=3)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Triton gRPC vs the OpenAI frontend: {args.requests} requests, concurrency "
                 f"{args.concurrency}, {args.output_tokens} output tokens")
    plot = save_figure(fig, out / "openai_overhead.png")

    lines = [f"# OpenAI frontend overhead ({args.requests} requests x {args.output_tokens} "
             f"output tokens, {args.input_tokens}-token prompts, concurrency "
             f"{args.concurrency}, {args.rounds} alternating rounds each)", "",
             "| front door | output tok/s | mean TTFT (ms) | mean TPOT (ms) |",
             "|---|---|---|---|"]
    for name in names:
        m = mean[name]
        lines.append(f"| {name} | {m['output_tok_s']:.1f} | {m['mean_ttft_ms']:.1f} | "
                     f"{m['mean_tpot_ms']:.1f} |")
    lines += ["", f"Throughput cost of the OpenAI frontend: {cost * 100:.1f}% (target <= 10%).",
              "", f"![]({plot})"]
    write_report(out / "summary.md", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
