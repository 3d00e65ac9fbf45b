"""When does speculative decoding stop paying? A simulated study at GPU scale.

Llama-3-8B on one H100 (the roofline cost model, `kvflow simulate`'s), the Azure conversation
trace's lengths and arrival pattern, retimed to a sweep of request rates. The real scheduler,
the real verification and the real draft-length cost model run in simulated time; drafts are
accepted position by position at a configured rate (``--acceptance``, default 0.7: EAGLE-class
drafting on chat). Three configurations: no speculation, a fixed draft length of
``--num-speculative-tokens``, and the dynamic draft length (kvflow's default).

Note what the roofline model credits: scoring ``k`` drafts costs their compute and the reads
of their KV, and nothing else (no kernel launch overheads); the draft proposer itself is free
(an n-gram's is; a draft model's would add its own steps).

    python benchmarks/speculative_sim.py [--rates 1,2,4,8,12,16,24] [--num-prompts 600]

Writes reports/speculative_sim/{report.json,summary.md,rates.png}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from kvflow.orchestrator.options import EngineOptions
from kvflow.reports.summary import summarize
from kvflow.reports.writers import pyplot, save_figure, write_report
from kvflow.sim.cost_model import HARDWARE, RooflineCostModel, model_spec
from kvflow.sim.simulator import simulate
from kvflow.sim.speculation import AcceptanceProposer
from kvflow.workloads.arrivals import retime
from kvflow.workloads.azure import default_trace, load_azure_trace

CONFIGS = ("off", "fixed", "dynamic")


def run(rate: float, config: str, args: argparse.Namespace) -> dict[str, Any]:
    specs, _ = load_azure_trace(default_trace(), limit=args.num_prompts,
                                max_prompt_tokens=4096, max_output_tokens=1024)
    specs = retime(specs, rate)
    model = model_spec("llama-3-8b")
    hardware = HARDWARE["H100"]
    cost = RooflineCostModel(hardware, model)
    options = EngineOptions(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=8192,
                            num_speculative_tokens=args.num_speculative_tokens,
                            speculative_draft_length="fixed" if config == "fixed" else "dynamic")
    proposer = None if config == "off" else (
        lambda: AcceptanceProposer(args.acceptance, seed=args.seed))
    t0 = time.perf_counter()
    result = simulate(specs, cost, options, model.kv_blocks_for(hardware, 16), 16,
                      proposer=proposer)
    s = summarize(result.timings, result.duration_s)
    c = result.counters
    return {"rate": rate, "config": config, "wall_s": time.perf_counter() - t0,
            "output_tok_s": s["output_token_throughput"],
            "tpot_ms": s["tpot_ms"]["mean"], "ttft_ms": s["ttft_ms"]["mean"],
            "p99_tpot_ms": s["tpot_ms"]["p99"],
            "drafts_per_step": c.spec_draft_tokens / max(c.steps, 1),
            "acceptance": c.spec_accepted_tokens / c.spec_draft_tokens
            if c.spec_draft_tokens else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="1,2,4,8,12,16,24")
    p.add_argument("--num-prompts", type=int, default=600)
    p.add_argument("--acceptance", type=float, default=0.7)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="reports/speculative_sim")
    args = p.parse_args()
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        for config in CONFIGS:
            row = run(rate, config, args)
            rows.append(row)
            print(f"rate {rate:5.1f} {config:8s} {row['output_tok_s']:8.0f} tok/s  "
                  f"TPOT {row['tpot_ms']:6.1f} ms  TTFT {row['ttft_ms']:7.1f} ms  "
                  f"drafts/step {row['drafts_per_step']:6.1f}  ({row['wall_s']:.0f} s)",
                  flush=True)
    write(args, rows)


def write(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    by = {(r["rate"], r["config"]): r for r in rows}
    rates = sorted({r["rate"] for r in rows})
    lines = ["# When speculative decoding stops paying (simulated)", "",
             f"Llama-3-8B, one H100 (roofline), {args.num_prompts} requests with the Azure "
             f"conversation trace's lengths and arrival pattern; acceptance {args.acceptance} "
             f"per draft position; at most {args.num_speculative_tokens} drafts per request "
             "and step.", "",
             "| req/s | TPOT off | TPOT fixed | TPOT dynamic | tok/s off | tok/s fixed | "
             "tok/s dynamic | drafts/step fixed | drafts/step dynamic |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        o, f, d = (by[(rate, c)] for c in CONFIGS)
        lines.append(f"| {rate:g} | {o['tpot_ms']:.1f} | {f['tpot_ms']:.1f} | "
                     f"{d['tpot_ms']:.1f} | {o['output_tok_s']:.0f} | {f['output_tok_s']:.0f} | "
                     f"{d['output_tok_s']:.0f} | {f['drafts_per_step']:.1f} | "
                     f"{d['drafts_per_step']:.1f} |")
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for c in CONFIGS:
        axes[0].plot(rates, [by[(r, c)]["tpot_ms"] for r in rates], marker="o", label=c)
        axes[1].plot(rates, [by[(r, c)]["output_tok_s"] for r in rates], marker="o", label=c)
    axes[0].set_ylabel("mean TPOT (ms)")
    axes[1].set_ylabel("output tok/s")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("Speculative decoding under load (simulated Llama-3-8B, H100)")
    lines += ["", f"![]({save_figure(fig, out / 'rates.png')})"]
    write_report(out / "summary.md", lines)
    (out / "report.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
