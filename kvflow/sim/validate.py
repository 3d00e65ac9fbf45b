"""``kvflow simulate validate``: the simulator against the real server on the same workload.

The engine is served by a real tritonserver and driven with ``kvflow bench serve``'s load
generator; then the simulator replays the very same requests (same token ids, arrival times
and output lengths) with the engine's calibrated cost model, the same scheduler config and the
same KV pool. Printed and written: the relative error of mean and P99 TTFT, mean TPOT and
output throughput, and both runs' full reports.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvflow.loadgen.sender import MetricsScraper, run_load
from kvflow.observability.trace_summary import summarize
from kvflow.reports.serve_report import write_serve_report
from kvflow.reports.summary import RequestTiming, parse_slo
from kvflow.reports.writers import write_report
from kvflow.sim.calibrate import COST_MODEL_FILE
from kvflow.sim.cost_model import LinearCostModel
from kvflow.sim.simulator import run_in_real_time, simulate, timing_of
from kvflow.workloads.flags import add_workload_args, build_workload
from kvflow.workloads.modes import MODE_LABELS, MODES, mode_scheduler_options
from kvflow.workloads.prompts import make_prompts
from kvflow.workloads.specs import RequestSpec

COMPARED = (("mean TTFT", ("ttft_ms", "mean")), ("P99 TTFT", ("ttft_ms", "p99")),
            ("mean TPOT", ("tpot_ms", "mean")), ("mean E2E", ("e2e_ms", "mean")),
            ("output throughput", ("output_token_throughput", None)))
TARGETED = ("mean TTFT", "mean TPOT", "output throughput")  # the 10% target


def add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    p.set_defaults(num_prompts=48, max_model_len=1024, input_len=256, output_len=64,
                   range_ratio=0.5)
    p.add_argument("--request-rate", default="1",
                   help="requests/s (the trace: stretched to this mean rate)")
    p.add_argument("--cost", default=None,
                   help=f"calibrated cost model (default: ENGINE/{COST_MODEL_FILE})")
    p.add_argument("--policy", choices=list(MODES), default="chunked")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--out", default="reports/simulate_validate")


def relative_errors(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, dict[str, float]]:
    """(sim - real) / real for each compared metric of two ``summarize`` results."""
    out = {}
    for name, (key, stat) in COMPARED:
        r = real[key] if stat is None else real[key][stat]
        s = sim[key] if stat is None else sim[key][stat]
        if r is None or s is None:
            continue
        out[name] = {"real": r, "sim": s, "rel_error": (s - r) / r if r else float("nan")}
    return out


def replay_offline(engine_dir: str, options: dict[str, Any], specs: list[RequestSpec],
                   prompts: list[list[int]]) -> tuple[list[RequestTiming], float]:
    """The same requests through the engine alone (no Triton, no client), in real time:
    what separates the cost model's error from the serving path's."""
    from kvflow.orchestrator.llm import create_engine
    from kvflow.orchestrator.sampling.params import SamplingParams

    engine = create_engine(engine_dir, **options)
    try:
        engine.add_request(prompts[0][:8], SamplingParams(max_tokens=2))  # warm-up
        while engine.has_unfinished_requests():
            engine.step()

        def add(i: int, arrival: float) -> None:
            engine.add_request(prompts[i], SamplingParams(
                max_tokens=specs[i].output_tokens, temperature=0.0, ignore_eos=True),
                request_id=str(i), arrival_time=arrival)

        outputs, duration = run_in_real_time(engine, [s.arrival_s for s in specs], add)
        done = {int(out.request_id): timing_of(out) for out in outputs}
        return [done[k] for k in range(len(specs))], duration
    finally:
        engine.runner.close()


def validate_main(args: argparse.Namespace) -> int:
    from kvflow.client import stream_generate
    from kvflow.orchestrator.llm import plan_engine
    from kvflow.text.tokenizer import EngineTokenizer
    from kvflow.triton_backend.launcher import ServerConfig, TritonServer

    cost_path = Path(args.cost or Path(args.engine) / COST_MODEL_FILE)
    cost = LinearCostModel.load(cost_path)
    slo = parse_slo(args.slo)
    specs, info = build_workload(args)
    texts = make_prompts(specs, args.engine, args.seed)
    tok = EngineTokenizer(args.engine)
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]  # as the server does
    options = mode_scheduler_options(args.policy, args.max_num_seqs, args.max_model_len,
                                     args.chunk_tokens)
    plan = plan_engine(args.engine, **options)  # the served engine's exact configuration
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {**info, "engine": str(args.engine), "policy": args.policy,
              "scheduler": options, "num_kv_blocks": plan.num_blocks,
              "num_prompts": len(specs), "slo": slo, "max_concurrency": None}

    print(f"[validate] serving {args.engine} ({MODE_LABELS[args.policy]}) ...", flush=True)
    # Both runs write their step timeline, to be opened side by side (Perfetto).
    real_trace, sim_trace = out / "real" / "steps.json", out / "sim" / "steps.json"
    real_trace.unlink(missing_ok=True)
    cfg = ServerConfig.on_free_ports(args.engine, {**options, "trace_steps": str(real_trace)})
    with TritonServer(cfg, log_path=out / "tritonserver.log") as server:
        list(stream_generate(server.grpc_url, texts[0], {"max_tokens": 2}))  # warm-up
        with MetricsScraper(server.metrics_url) as scraper:
            timings, duration = run_load(server.grpc_url, specs, texts, None,
                                         progress=not args.no_progress, desc="real server")
        write_trace_now(server, real_trace)
    real = write_serve_report(out / "real", "kvflow bench serve", config, timings, duration,
                              scraper.samples, echo=False)

    print("[validate] the same requests through the engine alone, in real time ...", flush=True)
    offline_timings, offline_s = replay_offline(args.engine, options, specs, prompts)
    offline = write_serve_report(out / "engine_alone", "engine alone (real time)", config,
                                 offline_timings, offline_s, [], echo=False)

    print("[validate] simulating the same requests ...", flush=True)
    result = simulate(specs, cost, replace(plan.scheduler, trace_steps=str(sim_trace)),
                      plan.num_blocks, plan.engine.limits.block_size, prompts=prompts)
    sim = write_serve_report(out / "sim", "kvflow simulate", {**config, "cost_file":
                                                             str(cost_path)},
                             result.timings, result.duration_s, result.series,
                             request_extra={"queue_s": result.queue_s}, echo=False)
    errors = relative_errors(real["summary"], sim["summary"])
    engine_errors = relative_errors(offline["summary"], sim["summary"])
    worst = max(abs(errors[k]["rel_error"]) for k in TARGETED if k in errors)
    (out / "validate.json").write_text(json.dumps({"config": config, "errors": errors,
                                                   "errors_vs_engine_alone": engine_errors,
                                                   "worst_targeted_abs_error": worst},
                                                  indent=1, default=float))
    lines = [f"# kvflow simulate validate: {info['workload']} workload, {len(specs)} "
             f"requests at {info['request_rate']:.3g} req/s", "",
             f"Engine `{args.engine}`, {MODE_LABELS[args.policy]}, {plan.num_blocks} KV "
             f"blocks; cost model `{cost_path}`.", "",
             "| metric | real server | simulator | error vs server | engine alone, real "
             "time | error vs engine alone |", "|---|---|---|---|---|---|"]
    for name, e in errors.items():
        unit = " tok/s" if name == "output throughput" else " ms"
        alone = engine_errors.get(name)
        lines.append(f"| {name} | {e['real']:.1f}{unit} | {e['sim']:.1f}{unit} | "
                     f"{e['rel_error']:+.1%} | "
                     + (f"{alone['real']:.1f}{unit} | {alone['rel_error']:+.1%} |"
                        if alone else "- | - |"))
    lines += ["", f"Largest error on mean TTFT, mean TPOT and throughput against the server: "
              f"{worst:.1%} (target 10%). The engine-alone column replays the same requests "
              "through the engine without Triton or a client: the simulator's error against "
              "it is the cost model's, the rest is the serving path's. Full reports: "
              "`real/`, `engine_alone/`, `sim/`.", "",
              "Step timelines: `real/steps.json` and `sim/steps.json` (open both in "
              "ui.perfetto.dev; the warm-up request is the real one's first).", ""]
    traces = [(name, path) for name, path in (("Real server", real_trace),
                                              ("Simulator", sim_trace)) if path.exists()]
    if traces:
        plot = plot_timelines(out / "timelines.png", traces)
        lines += [f"![the two step timelines]({Path(plot).name})", ""]
    for name, path in traces:
        lines += [f"### {name}: `kvflow trace summarize {path}`", "",
                  summarize(path, top=5), ""]
    write_report(out / "summary.md", lines)
    return 0


def plot_timelines(path: Path, traces: list[tuple[str, Path]]) -> str:
    """The step timelines one above the other: each step a bar as long as it lasted,
    coloured by kind, and the running requests under them."""
    from kvflow.observability.trace_summary import load
    from kvflow.reports.writers import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(len(traces), 1, figsize=(13, 2.4 * len(traces)), sharex=True,
                             squeeze=False)
    colours = {"prefill": "C3", "mixed": "C1", "decode": "C0"}
    for ax, (name, trace) in zip(axes[:, 0], traces, strict=True):
        events = load(trace)["traceEvents"]
        steps = [e for e in events if e.get("cat") == "step"]
        for kind, colour in colours.items():
            bars = [(e["ts"] / 1e6, e["dur"] / 1e6) for e in steps if e["name"] == kind]
            ax.broken_barh(bars, (1, 1), color=colour, label=f"{kind} step")
        running = [(e["ts"] / 1e6, e["args"]["running"]) for e in events
                   if e["ph"] == "C" and e["name"] == "requests"]
        if running:
            top = max(r for _, r in running) or 1
            ax.plot([t for t, _ in running], [r / top for _, r in running], color="grey",
                    linewidth=0.8, drawstyle="steps-post", label=f"running (max {top})")
        ax.set_yticks([])
        ax.set_ylim(0, 2.1)
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7, loc="upper right", ncol=4)
    axes[-1, 0].set_xlabel("seconds from the first step")
    fig.suptitle("Step timelines of one workload, served and simulated")
    return save_figure(fig, path)


def write_trace_now(server: Any, path: Path, timeout_s: float = 60.0) -> None:
    """Have the server write its step timeline (SIGUSR1) and wait until the file is there."""
    deadline = time.monotonic() + timeout_s
    while server.write_trace() == 0 and time.monotonic() < deadline:
        time.sleep(0.2)  # the model's watch is not live yet
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
