"""``kvflow simulate``: the real scheduler and KV manager in simulated time, with reports.

One run per (policy, rate): each writes the ``kvflow bench serve`` report, field for field
(``report.json``, ``summary.md``, latency CDFs, server series), plus per-request queue time,
KV usage and fragmentation and batch size over time (``kv_batch.png``). With several policies
or rates, a sweep summary and chart (``sweep.png``) sit on top, as ``kvflow bench compare``
writes them.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.speculative.proposers import Proposer
from kvflow.reports.serve_report import tenant_line, write_serve_report
from kvflow.reports.summary import parse_slo, tenant_summary
from kvflow.reports.writers import pyplot, save_figure, write_report
from kvflow.runtime.base import KV_CACHE_DTYPES
from kvflow.sim.cluster_run import add_cluster_args, cluster_main, is_cluster_run
from kvflow.sim.cost_model import (
    HARDWARE,
    MODELS,
    CostModel,
    LinearCostModel,
    RooflineCostModel,
    model_spec,
)
from kvflow.sim.run_options import mode_options, request_priorities, thin
from kvflow.sim.runner import SIM_TOKEN
from kvflow.sim.simulator import SimResult, simulate
from kvflow.sim.speculation import AcceptanceProposer, acceptance_lengths_of
from kvflow.workloads.azure import load_azure_trace
from kvflow.workloads.flags import add_workload_args, build_workload, parse_rates
from kvflow.workloads.modes import MODE_LABELS, MODES
from kvflow.workloads.specs import RequestSpec
from kvflow.workloads.synthetic import sessions_workload


def add_args(p: argparse.ArgumentParser) -> None:
    # NOTE: sessions only here: their history holds what the model generated, which only the
    # simulator knows before the run (its model always samples SIM_TOKEN).
    add_workload_args(p, {"sessions": "multi-turn chats whose prompts hold their whole "
                                      "history (trace lengths, Poisson sessions at "
                                      "--request-rate)"})
    p.set_defaults(workload="trace", num_prompts=1000, max_model_len=8192, engine=None)
    p.add_argument("--session-turns", type=int, default=4,
                   help="sessions workload: turns per session (fewer when the history would "
                        "pass 3/4 of --max-model-len)")
    p.add_argument("--think-time-s", type=float, default=20.0,
                   help="sessions workload: a turn is sent THINK x U(0.5, 1.5) s after the last")
    p.add_argument("--system-prompt-len", type=int, default=0,
                   help="sessions workload: a system prompt every session starts with")
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="H100")
    p.add_argument("--model", choices=sorted(MODELS), default="llama-3-8b")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the KV cache's element type (as kvflow serve's): the roofline's KV "
                        "bytes, read and written each step, and the KV blocks that fit; auto: "
                        "the model's dtype")
    p.add_argument("--cost", default=None,
                   help="a calibrated cost model (kvflow simulate calibrate) instead of the "
                        "roofline of --hardware/--model")
    p.add_argument("--policy", default="continuous",
                   help=f"comma-separated batching modes: {', '.join(MODES)}")
    p.add_argument("--rates", default=None,
                   help="comma-separated request rates (req/s, or inf) to sweep; default one "
                        "run at --request-rate")
    p.add_argument("--request-rate", default=None,
                   help="requests/s or inf; default: the trace's own timing, else inf")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--chunk-tokens", type=int, default=2048,
                   help="chunked modes: token budget of one step")
    p.add_argument("--num-priorities", type=int, default=2,
                   help="priority mode: requests get priorities 0..N-1 uniformly at random")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool (default: what the devices hold after the weights at 90%% "
                        "memory utilisation)")
    p.add_argument("--prefix-caching", action="store_true", help="turn prefix caching on")
    p.add_argument("--max-queue-delay-ms", type=float, default=None,
                   help="SLO admission: refuse a request whose predicted wait exceeds this")
    p.add_argument("--request-timeout-s", type=float, default=None,
                   help="every request's deadline (finish_reason timeout past it)")
    p.add_argument("--series-period-s", type=float, default=0.25)
    p.add_argument("--trace-steps", default=None, metavar="FILE",
                   help="write the step timeline (Chrome Trace Event JSON, as `kvflow serve "
                        "--trace-steps` writes) of the run; with several runs, FILE's name "
                        "in each run's folder")
    p.add_argument("--trace-max-steps", type=int, default=10_000,
                   help="steps the timeline keeps (the last ones)")
    p.add_argument("--out", default="reports/simulate")
    p.add_argument("--console", action="store_true",
                   help="watch the run in the live console: the simulation is paced to the "
                        "wall clock and its engine served at http://127.0.0.1:PORT/")
    p.add_argument("--console-speed", type=float, default=1.0,
                   help="with --console: simulated seconds per wall second")
    p.add_argument("--console-port", type=int, default=9000, help="with --console: its port")
    p.add_argument("--console-exit", action="store_true",
                   help="with --console: exit when the run ends (default: keep showing its "
                        "final state until Ctrl-C)")
    p.add_argument("--speculative-acceptance", type=float, default=None, metavar="RATE",
                   help="speculative decoding: each draft position accepted with this "
                        "probability (the scheduler, verification and draft-length code are "
                        "the engine's own)")
    p.add_argument("--speculative-replay", default=None, metavar="TRACE",
                   help="speculative decoding: replay the acceptance lengths of a served "
                        "run's step timeline (its --trace-steps file)")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="speculative decoding: the most drafts per request and step")
    p.add_argument("--speculative-draft-length", choices=("dynamic", "fixed"),
                   default="dynamic", help="speculative decoding: the cost model's draft "
                                           "length, or always the most")
    add_cluster_args(p)


def build_sim_workload(args: argparse.Namespace) -> tuple[list[RequestSpec],
                                                          list[list[int]] | None, dict[str, Any]]:
    """The workload the arguments name: its requests, their token ids (None: the
    simulator's own) and how the report describes it."""
    if args.workload != "sessions":
        specs, info = build_workload(args)
        return specs, None, info
    if args.request_rate is None:
        raise ValueError("--request-rate is required for the sessions workload")
    try:
        rate = float(args.request_rate)
    except ValueError:
        raise ValueError(f"--request-rate must be a number or inf, got "
                         f"{args.request_rate!r}") from None
    budget = args.max_model_len
    max_prompt = budget * 3 // 4
    lengths, _ = load_azure_trace(args.trace, max_prompt_tokens=max_prompt,
                                  max_output_tokens=budget - max_prompt,
                                  length_scale=args.length_scale)
    w = sessions_workload(lengths, args.num_prompts, rate, args.seed, args.session_turns,
                          args.think_time_s, args.system_prompt_len, max_prompt, SIM_TOKEN)
    info = {"workload": "sessions", "request_rate": rate, "seed": args.seed,
            "trace": str(args.trace), "length_scale": args.length_scale,
            "session_turns": args.session_turns, "think_time_s": args.think_time_s,
            "system_prompt_len": args.system_prompt_len, "sessions": len(set(w.sessions)),
            "note": f"{len(set(w.sessions))} sessions of up to {args.session_turns} turns, "
                    "each turn's prompt its whole history and a new message; message and "
                    f"output lengths from trace rows multiplied by {args.length_scale:g}, "
                    f"prompts up to {max_prompt} tokens, outputs up to "
                    f"{budget - max_prompt}; mean prompt "
                    f"{np.mean([s.prompt_tokens for s in w.specs]):.0f} tokens"}
    return w.specs, w.prompts, info


def make_cost(args: argparse.Namespace) -> tuple[CostModel, dict[str, Any]]:
    """The cost model the arguments name, and how the report describes it."""
    if args.cost:
        if args.kv_cache_dtype != "auto":
            raise ValueError("--kv-cache-dtype sets the roofline model's KV bytes; a calibrated "
                             "--cost was measured at its engine's own (drop one)")
        cost = LinearCostModel.load(args.cost)
        return cost, {"cost_model": "calibrated", "cost_file": str(args.cost),
                      "coefficients": cost.coefficients, "engine": cost.meta.get("engine")}
    model = model_spec(args.model, args.tp, args.kv_cache_dtype)
    return RooflineCostModel(HARDWARE[args.hardware], model), {
        "cost_model": "roofline", "hardware": HARDWARE[args.hardware].name,
        "model": model.name, "tp": args.tp, "kv_cache_dtype": args.kv_cache_dtype,
        "kv_bytes_per_token": model.kv_bytes_per_token}


def default_num_blocks(args: argparse.Namespace) -> int:
    if args.num_kv_blocks is not None:
        if args.num_kv_blocks < 2:
            raise ValueError(f"--num-kv-blocks must be >= 2, got {args.num_kv_blocks}")
        return args.num_kv_blocks
    if args.cost:
        raise ValueError("--num-kv-blocks is required with --cost (the KV pool of the "
                         "calibrated engine); `kvflow simulate validate` sets it itself")
    model = model_spec(args.model, args.tp, args.kv_cache_dtype)
    return model.kv_blocks_for(HARDWARE[args.hardware], args.block_size)


def _plot_kv_batch(out: Path, result: SimResult) -> str:
    plt = pyplot()

    t = [r["t_s"] for r in result.series]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    axes[0].plot(t, [r["kvflow_kv_cache_usage_ratio"] for r in result.series],
                 label="KV blocks used")
    axes[0].plot(t, [r["kvflow_kv_cache_fragmentation_ratio"] for r in result.series],
                 label="fragmentation (unfilled slots / used slots)")
    axes[0].set_ylim(0, 1.02)
    axes[0].set_ylabel("fraction")
    axes[0].legend(fontsize=7)
    axes[0].set_title("KV cache")
    axes[1].plot(t, [r["batch_seqs"] for r in result.series], label="sequences in step")
    axes[1].plot(t, [r["kvflow_num_requests_waiting"] for r in result.series],
                 label="waiting requests")
    ax2 = axes[1].twinx()
    ax2.plot(t, [r["batch_tokens"] for r in result.series], color="grey", alpha=0.5,
             linewidth=0.7)
    ax2.set_ylabel("tokens in step (grey)")
    axes[1].legend(fontsize=7, loc="upper left")
    axes[1].set_title("Batch over time")
    for ax in axes[:2]:
        ax.set_xlabel("simulated time (s)")
        ax.grid(alpha=0.3)
    queue = np.sort([q for q in result.queue_s if q is not None])
    if len(queue):
        axes[2].plot(queue, np.arange(1, len(queue) + 1) / len(queue))
        axes[2].set_xscale("symlog", linthresh=1e-3)
    axes[2].set_xlabel("queue time (s)")
    axes[2].set_ylabel("fraction of requests")
    axes[2].set_title("Per-request queue time (CDF)")
    axes[2].grid(alpha=0.3)
    return save_figure(fig, out / "kv_batch.png")


def speculation_of(args: argparse.Namespace) -> Callable[[], Proposer] | None:
    """The simulated proposer the flags ask for (None: no speculative decoding)."""
    rate = getattr(args, "speculative_acceptance", None)
    trace = getattr(args, "speculative_replay", None)
    if rate is None and trace is None:
        return None
    replay = acceptance_lengths_of(trace) if trace is not None else ()
    return lambda: AcceptanceProposer(rate if rate is not None else 0.0, replay, args.seed)


def run_one(specs: list[RequestSpec], mode: str, cost: CostModel, args: argparse.Namespace,
            num_blocks: int, config: dict[str, Any], out: Path, bar: Any,
            prompts: list[list[int]] | None = None, echo: bool = True,
            trace_steps: Path | None = None) -> dict[str, Any]:
    """Simulate one (mode, workload) and write its report to ``out`` (with the server's
    final metrics as ``metrics.prom``, and the step timeline to ``trace_steps``)."""
    options = mode_options(mode, args, trace_steps)
    sched = EngineOptions(**options)
    priorities = request_priorities(specs, sched.policy, args)
    done = [0]

    def progress(n: int) -> None:
        if bar is not None:
            bar.update(n - done[0])
        done[0] = n

    t0 = time.perf_counter()
    console = getattr(args, "console_replay", None)
    result = simulate(specs, cost, sched, num_blocks, args.block_size, prompts=prompts,
                      series_period_s=args.series_period_s, progress=progress,
                      priorities=priorities, proposer=speculation_of(args),
                      on_step=console.on_step if console is not None else None)
    wall = time.perf_counter() - t0
    series = thin(result.series)
    frag = [r["kvflow_kv_cache_fragmentation_ratio"] for r in result.series]
    usage = [r["kvflow_kv_cache_usage_ratio"] for r in result.series]
    preempted, steps = result.counters.preemptions, result.counters.steps
    sim_info = {"mode": mode, "scheduler": options, "num_kv_blocks": num_blocks,
                "block_size": args.block_size, "steps": steps,
                "preemptions": preempted, "wall_time_s": wall,
                "kv_usage_mean": float(np.mean(usage)), "kv_usage_max": float(np.max(usage)),
                "kv_fragmentation_mean": float(np.mean(frag))}
    queue = [q for q in result.queue_s if q is not None]
    lines = ["", f"Simulated {MODE_LABELS[mode]} ({config['cost_model']} cost model) in "
             f"{wall:.1f} s of wall time: {steps} steps, {preempted} preemptions, "
             f"{num_blocks} KV blocks of {args.block_size} tokens; mean KV usage "
             f"{sim_info['kv_usage_mean']:.0%} (max {sim_info['kv_usage_max']:.0%}), mean "
             f"fragmentation {sim_info['kv_fragmentation_mean']:.0%}; queue time mean "
             f"{(np.mean(queue) if queue else 0) * 1e3:.1f} ms, p99 "
             f"{(np.percentile(queue, 99) if queue else 0) * 1e3:.1f} ms."]
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.prom").write_text(result.metrics.exposition({"model": "simulated"}))
    if trace_steps is not None:
        lines.append(f"Step timeline: {trace_steps} (open it in ui.perfetto.dev, or run "
                     f"`kvflow trace summarize {trace_steps}`).")
    extra = [_plot_kv_batch(out, result)]
    tenants = [s.tenant for s in specs]
    if any(tenants):
        sim_info["tenants"] = tenant_summary(result.timings, tenants)
        lines.append(tenant_line(sim_info["tenants"]))
    if priorities is not None:
        for level in sorted(set(priorities)):
            ttfts = [t.ttft_s for t, p in zip(result.timings, priorities, strict=True)
                     if p == level and t.ttft_s is not None]
            if ttfts:
                lines.append(f"Priority {level}: {len(ttfts)} requests, TTFT mean "
                             f"{np.mean(ttfts) * 1e3:.1f} ms, p99 "
                             f"{np.percentile(ttfts, 99) * 1e3:.1f} ms.")
    report = write_serve_report(out, "kvflow simulate", {**config, "simulation": sim_info},
                                result.timings, result.duration_s, series,
                                request_extra={"queue_s": result.queue_s,
                                               **({"priority": priorities}
                                                  if priorities else {})},
                                extra_plots=extra, extra_lines=lines, echo=echo)
    return report


def simulate_main(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.policy.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"--policy: unknown mode(s) {unknown}; known: {list(MODES)}")
    for name in ("max_num_seqs", "chunk_tokens", "block_size", "tp"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                             f"{getattr(args, name)}")
    slo = parse_slo(args.slo)
    cost, cost_info = make_cost(args)
    num_blocks = default_num_blocks(args)
    rates: list[float | None] = (list(parse_rates(args.rates)) if args.rates
                                 else [None])
    if is_cluster_run(args):
        if args.console:
            raise ValueError("--console shows one engine: not with --replicas or "
                             "--disaggregate")
        return cluster_main(args, cost, cost_info, num_blocks, modes, rates, build_sim_workload)
    out = Path(args.out)
    workloads = []
    for rate in rates:
        ns = copy.copy(args)
        ns.request_rate = args.request_rate if rate is None else str(rate)
        specs, prompts, info = build_sim_workload(ns)
        workloads.append((rate, specs, prompts, info))

    if args.console:
        from kvflow.console.replay import ConsoleReplay

        args.console_replay = ConsoleReplay(args.console_speed, port=args.console_port)
        print(f"console: {args.console_replay.url} (the run paced at x{args.console_speed})",
              flush=True)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(len(w[1]) for w in workloads) * len(modes), desc="simulated",
                   unit="req")
    single = len(modes) == 1 and len(rates) == 1
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        for mode in modes:
            for rate, specs, prompts, info in workloads:
                sub = out if single else out / mode / f"rate_{rate if rate else 'trace'}"
                config = {**info, **cost_info, "num_prompts": len(specs), "slo": slo,
                          "max_concurrency": None}
                trace = None if not args.trace_steps else (
                    Path(args.trace_steps) if single else sub / Path(args.trace_steps).name)
                report = run_one(specs, mode, cost, args, num_blocks, config, sub, bar,
                                 prompts=prompts, echo=single, trace_steps=trace)
                results[mode].append({"rate": info["request_rate"],
                                      "summary": report["summary"],
                                      "simulation": report["config"]["simulation"]})
    finally:
        if bar is not None:
            bar.close()
    if not single:
        write_sweep(out, results, cost_info, slo, args)
    if args.console:
        linger(args.console_replay, args.console_exit)
    return 0


def linger(console: Any, exit_now: bool) -> None:
    """Keep the console showing the run's final state until Ctrl-C (or not: ``exit_now``)."""
    try:
        if not exit_now:
            print(f"console: the run is over; its final state stays at {console.url} until "
                  "Ctrl-C", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        console.close()


def write_sweep(out: Path, results: dict[str, list[dict[str, Any]]], cost_info: dict[str, Any],
                slo: dict[str, float], args: argparse.Namespace) -> None:
    """The sweep's summary table and ``sweep.png`` (latency vs throughput, per mode)."""
    from kvflow.reports.sweep import fmt_value, max_sustained_rate, plot_sweep

    what = (f"{cost_info['model']} (tp={cost_info['tp']}) on {cost_info['hardware']}"
            if cost_info["cost_model"] == "roofline" else f"calibrated {cost_info['cost_file']}")
    lines = [f"# kvflow simulate: {args.workload} workload, {what}", "",
             "| mode | offered req/s | achieved req/s | output tok/s | mean TTFT ms | "
             "P99 TTFT ms | mean TPOT ms | P99 E2E ms | mean KV usage | mean fragmentation | "
             "preemptions |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, points in results.items():
        for p in points:
            s, sim = p["summary"], p["simulation"]
            lines.append(
                f"| {mode} | {p['rate']:.3g} | {s['request_throughput']:.2f} | "
                f"{s['output_token_throughput']:.0f} | {fmt_value(s['ttft_ms']['mean'])} | "
                f"{fmt_value(s['ttft_ms']['p99'])} | {fmt_value(s['tpot_ms']['mean'], '.1f')} | "
                f"{fmt_value(s['e2e_ms']['p99'])} | {sim['kv_usage_mean']:.0%} | "
                f"{sim['kv_fragmentation_mean']:.0%} | {sim['preemptions']} |")
    if "ttft_ms" in slo:
        lines += ["", f"Highest rate with P99 TTFT <= {slo['ttft_ms']:g} ms:"]
        for mode, points in results.items():
            rate = max_sustained_rate(points, slo["ttft_ms"])
            verdict = f"{rate:.3g} req/s" if rate else "none of the swept rates"
            lines.append(f"- {MODE_LABELS[mode]}: {verdict}")
    plot = plot_sweep(out, results, slo.get("ttft_ms", math.nan), None, filename="sweep.png")
    lines += ["", f"![sweep]({plot})", "", "Each run's own report: `MODE/rate_R/summary.md`."]
    (out / "sweep.json").write_text(json.dumps({"cost": cost_info, "slo": slo,
                                                "results": results}, indent=1, default=float))
    write_report(out / "summary.md", lines)
