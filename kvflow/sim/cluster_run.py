"""``kvflow simulate --replicas N | --disaggregate P:D [--goodput]``: a cluster run's report.

One run writes the ``kvflow bench serve`` report of the whole cluster (every request as a
client sees it), with each request's instance, decode instance, KV transfer and cached
tokens, and on top: the prefix-cache hit rate per instance and overall, each instance's
requests, tokens and busy fraction with the load balance (max over mean), the transfers, and
``cluster.png``. With ``--goodput``, the rate is searched instead (:mod:`kvflow.sim.goodput`)
and ``goodput.json`` / ``summary.md`` / ``goodput.png`` give the rates tried.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.options import EngineOptions
from kvflow.reports.serve_report import tenant_line, write_serve_report
from kvflow.reports.summary import parse_slo, tenant_summary
from kvflow.reports.writers import write_report
from kvflow.sim.cluster import LINKS, ClusterSpec, Link
from kvflow.sim.cluster_report import cluster_lines, fmt, plot_cluster, plot_goodput
from kvflow.sim.cost_model import CostModel, model_spec
from kvflow.sim.goodput import find_goodput, slo_attainment
from kvflow.sim.router import ROUTERS
from kvflow.sim.run_options import mode_options, request_priorities, thin
from kvflow.sim.simulator import ClusterResult, simulate_cluster
from kvflow.workloads.specs import RequestSpec


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("a cluster of engines (each the real scheduler and KV manager)")
    g.add_argument("--replicas", type=int, default=1,
                   help="colocated engine instances behind --router")
    g.add_argument("--router", choices=sorted(ROUTERS), default="round_robin",
                   help="which replica (or prefill instance) serves a request; prefix_aware "
                        "needs --prefix-caching")
    g.add_argument("--overlap-weight", type=float, default=1.0,
                   help="prefix_aware: cost = WEIGHT x uncached prompt blocks + outstanding "
                        "blocks (Dynamo's default 1.0)")
    g.add_argument("--disaggregate", default=None, metavar="P:D",
                   help="P prefill and D decode instances; the prompt's KV moves over --link")
    g.add_argument("--link", choices=sorted(LINKS), default="nvlink",
                   help="; ".join(f"{k}: {v.name}, {v.latency_s * 1e6:g} us per transfer"
                                  for k, v in sorted(LINKS.items())))
    g.add_argument("--link-gbps", type=float, default=None,
                   help="link bandwidth per GPU in gigabits/s (overrides --link's)")
    g.add_argument("--link-latency-us", type=float, default=None,
                   help="fixed cost of one transfer in microseconds (overrides --link's)")
    g.add_argument("--goodput", action="store_true",
                   help="search the highest request rate at which --slo-attainment of the "
                        "requests meet every --slo (DistServe's goodput), instead of one run")
    g.add_argument("--slo-attainment", type=float, default=0.9,
                   help="--goodput: the share of requests that must meet the SLOs")
    g.add_argument("--goodput-iterations", type=int, default=6,
                   help="--goodput: bisections after the rate is bracketed")


def is_cluster_run(args: argparse.Namespace) -> bool:
    return args.replicas != 1 or args.disaggregate is not None or args.goodput


def parse_disaggregate(text: str) -> tuple[int, int]:
    """``2:1`` -> (2, 1), each >= 1."""
    p, sep, d = text.partition(":")
    try:
        if not sep:
            raise ValueError
        prefill, decode = int(p), int(d)
    except ValueError:
        raise ValueError(f"--disaggregate must be P:D (two integers), got {text!r}") from None
    if prefill < 1 or decode < 1:
        raise ValueError(f"--disaggregate P:D needs P >= 1 and D >= 1, got {text!r}")
    return prefill, decode


def make_link(args: argparse.Namespace) -> Link:
    base = LINKS[args.link]
    if args.link_gbps is not None and not args.link_gbps > 0:
        raise ValueError(f"--link-gbps must be > 0, got {args.link_gbps}")
    if args.link_latency_us is not None and not args.link_latency_us >= 0:
        raise ValueError(f"--link-latency-us must be >= 0, got {args.link_latency_us}")
    if args.link_gbps is None and args.link_latency_us is None:
        return base
    gbps = args.link_gbps if args.link_gbps is not None else base.bytes_per_s * 8 / 1e9
    latency_us = (args.link_latency_us if args.link_latency_us is not None
                  else base.latency_s * 1e6)
    return Link(f"{gbps:g} Gb/s, {latency_us:g} us per transfer", gbps * 1e9 / 8,
                latency_us * 1e-6)


def make_cluster(args: argparse.Namespace) -> tuple[ClusterSpec, int]:
    """The cluster the flags describe, and the GPUs it takes (instances x --tp)."""
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if not args.overlap_weight >= 0:
        raise ValueError(f"--overlap-weight must be >= 0, got {args.overlap_weight}")
    if args.router == "prefix_aware" and not args.prefix_caching:
        raise ValueError("--router prefix_aware routes by the replicas' prefix caches: add "
                         "--prefix-caching")
    if args.trace_steps:
        raise ValueError("--trace-steps records one engine; drop it with --replicas, "
                         "--disaggregate or --goodput")
    link = make_link(args)
    if args.disaggregate is None:
        return ClusterSpec(args.replicas, router=args.router,
                           overlap_weight=args.overlap_weight), args.replicas * args.tp
    if args.replicas != 1:
        raise ValueError("--disaggregate P:D sets the instances (P + D); drop --replicas")
    prefill, decode = parse_disaggregate(args.disaggregate)
    model = model_spec(args.model, args.tp, args.kv_cache_dtype)
    # Each device holds (and sends) its share of the KV heads; beyond num_kv_heads devices
    # the heads are replicated, so a device's share stops shrinking.
    per_device = model.kv_bytes_per_token / min(args.tp, model.num_kv_heads)
    return (ClusterSpec(prefill=prefill, decode=decode, router=args.router,
                        overlap_weight=args.overlap_weight, link=link,
                        kv_bytes_per_token_per_device=per_device),
            (prefill + decode) * args.tp)


def cluster_main(args: argparse.Namespace, cost: CostModel, cost_info: dict[str, Any],
                 num_blocks: int, modes: list[str], rates: list[float | None],
                 build: Any) -> int:
    """A cluster run (``build(ns)`` gives the workload: specs, prompts, info)."""
    cluster, gpus = make_cluster(args)
    if len(modes) != 1:
        raise ValueError(f"a cluster run takes one --policy mode, got {modes}")
    slo = parse_slo(args.slo)
    if args.goodput:
        if not slo:
            raise ValueError("--goodput needs --slo (e.g. ttft_ms=1000,tpot_ms=50)")
        if not 0 < args.slo_attainment <= 1:
            raise ValueError(f"--slo-attainment must be in (0, 1], got {args.slo_attainment}")
        if args.goodput_iterations < 0:
            raise ValueError(f"--goodput-iterations must be >= 0, got "
                             f"{args.goodput_iterations}")
        return goodput_main(args, cost, cost_info, num_blocks, modes[0], cluster, gpus, slo,
                            build)
    if len(rates) != 1:
        raise ValueError("a cluster run simulates one rate: give --request-rate, or "
                         "--goodput to search the rates")
    ns = copy.copy(args)
    ns.request_rate = args.request_rate if rates[0] is None else str(rates[0])
    specs, prompts, info = build(ns)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(specs), desc="simulated", unit="req")
    try:
        run_cluster(specs, prompts, info, modes[0], cost, cost_info, args, num_blocks,
                    cluster, gpus, slo, Path(args.out), bar)
    finally:
        if bar is not None:
            bar.close()
    return 0


def simulate_workload(specs: list[RequestSpec], prompts: list[list[int]] | None, mode: str,
                      cost: CostModel, args: argparse.Namespace, num_blocks: int,
                      cluster: ClusterSpec, bar: Any = None,
                      on_step: Callable[[int, LLMEngine], None] | None = None) -> ClusterResult:
    """Simulate ``specs`` on the cluster in ``mode`` under the flags (``on_step``: as
    :func:`~kvflow.sim.simulator.simulate_cluster` takes it)."""
    options = EngineOptions(**mode_options(mode, args))
    done = [0]

    def progress(n: int) -> None:
        if bar is not None:
            bar.update(n - done[0])
        done[0] = n

    return simulate_cluster(specs, cost, options, num_blocks, cluster, args.block_size,
                            prompts=prompts, series_period_s=args.series_period_s,
                            progress=progress,
                            priorities=request_priorities(specs, options.policy, args),
                            on_step=on_step)


def cluster_info(cluster: ClusterSpec, gpus: int, args: argparse.Namespace) -> dict[str, Any]:
    info: dict[str, Any] = {"roles": cluster.roles, "router": cluster.router,
                            "overlap_weight": cluster.overlap_weight, "gpus": gpus,
                            "tp": args.tp}
    if cluster.disaggregated:
        info.update(prefill=cluster.prefill, decode=cluster.decode, link=cluster.link.name,
                    link_bytes_per_s=cluster.link.bytes_per_s,
                    link_latency_s=cluster.link.latency_s,
                    kv_bytes_per_token_per_device=cluster.kv_bytes_per_token_per_device)
    else:
        info["replicas"] = cluster.replicas
    return info


def balance(values: list[float]) -> float | None:
    """Max over mean (1.0: perfectly even); None when the mean is 0."""
    mean = float(np.mean(values)) if values else 0.0
    return max(values) / mean if mean > 0 else None


def run_cluster(specs: list[RequestSpec], prompts: list[list[int]] | None,
                info: dict[str, Any], mode: str, cost: CostModel, cost_info: dict[str, Any],
                args: argparse.Namespace, num_blocks: int, cluster: ClusterSpec, gpus: int,
                slo: dict[str, float], out: Path, bar: Any = None) -> dict[str, Any]:
    """Simulate one workload on the cluster and write its report to ``out``."""
    t0 = time.perf_counter()
    result = simulate_workload(specs, prompts, mode, cost, args, num_blocks, cluster, bar)
    wall = time.perf_counter() - t0
    stats = result.instances
    queries = sum(int(s["prefix_cache_queries"] or 0) for s in stats)
    hits = sum(int(s["prefix_cache_hits"] or 0) for s in stats)
    entry = [s for s in stats if s["role"] != "decode"]
    summary = {"hit_rate": hits / queries if queries else None,
               "requests_balance": balance([float(s["requests"] or 0) for s in entry]),
               "prompt_tokens_balance": balance([float(s["prompt_tokens"] or 0) for s in entry]),
               "busy_balance": balance([float(s["busy_fraction"] or 0) for s in entry])}
    transfers = [r.transfer_s for r in result.routes if r.transfer_s is not None]
    if transfers:
        waits = [r.transfer_wait_s or 0.0 for r in result.routes if r.transfer_s is not None]
        summary.update(transfer_ms_mean=float(np.mean(transfers)) * 1e3,
                       transfer_ms_p99=float(np.percentile(transfers, 99)) * 1e3,
                       link_wait_ms_mean=float(np.mean(waits)) * 1e3,
                       transfer_gb=sum(specs[i].prompt_tokens for i, r in
                                       enumerate(result.routes) if r.transfer_s is not None)
                       * cluster.kv_bytes_per_token_per_device * args.tp / 1e9)
    if slo:
        summary["slo_attainment"] = slo_attainment(result.timings, slo.get("ttft_ms"),
                                                   slo.get("tpot_ms"))
    sim_info: dict[str, Any] = {"mode": mode, "num_kv_blocks_per_instance": num_blocks,
                "block_size": args.block_size, "steps": result.steps, "wall_time_s": wall}
    config = {**info, **cost_info, "num_prompts": len(specs), "slo": slo,
              "max_concurrency": None, "simulation": sim_info,
              "cluster": {**cluster_info(cluster, gpus, args), **summary, "instances": stats}}
    lines = cluster_lines(config["cluster"], stats, mode, wall, result.steps)
    tenants = [s.tenant for s in specs]
    if any(tenants):
        sim_info["tenants"] = tenant_summary(result.timings, tenants)
        lines.append(tenant_line(sim_info["tenants"]))
    routes = result.routes
    out.mkdir(parents=True, exist_ok=True)
    report = write_serve_report(
        out, "kvflow simulate", config, result.timings, result.duration_s,
        thin(result.series),
        request_extra={"instance": [r.instance for r in routes],
                       "decode_instance": [r.decode_instance for r in routes],
                       "transfer_s": [r.transfer_s for r in routes],
                       "transfer_wait_s": [r.transfer_wait_s for r in routes],
                       "cached_tokens": [r.cached_tokens for r in routes]},
        extra_plots=[plot_cluster(out, result)], extra_lines=lines,
        echo=not getattr(args, "quiet", False))
    return report


def goodput_main(args: argparse.Namespace, cost: CostModel, cost_info: dict[str, Any],
                 num_blocks: int, mode: str, cluster: ClusterSpec, gpus: int,
                 slo: dict[str, float], build: Any) -> int:
    """Search the goodput; write ``goodput.json``, ``summary.md`` and ``goodput.png``."""
    out = Path(args.out)
    runs: dict[float, dict[str, Any]] = {}

    def attainment_at(rate: float) -> float:
        ns = copy.copy(args)
        ns.request_rate = str(rate)
        specs, prompts, _ = build(ns)
        result = simulate_workload(specs, prompts, mode, cost, args, num_blocks, cluster)
        ttfts = [t.ttft_s for t in result.timings if t.ttft_s is not None]
        tpots = [t.tpot_s for t in result.timings if t.tpot_s is not None]
        att = slo_attainment(result.timings, slo.get("ttft_ms"), slo.get("tpot_ms"))
        runs[rate] = {"rate": rate, "attainment": att,
                      "ttft_ms_p90": float(np.percentile(ttfts, 90)) * 1e3 if ttfts else None,
                      "tpot_ms_p90": float(np.percentile(tpots, 90)) * 1e3 if tpots else None}
        if not args.no_progress:
            print(f"[goodput] {rate:.3g} req/s: {att:.1%} within the SLOs", flush=True)
        return att

    start = float(args.request_rate) if args.request_rate not in (None, "inf") else float(gpus)
    rate, _ = find_goodput(attainment_at, args.slo_attainment, start,
                           args.goodput_iterations)
    points = [runs[r] for r in sorted(runs)]
    result = {"cost": cost_info, "cluster": cluster_info(cluster, gpus, args), "mode": mode,
              "slo": slo, "attainment_target": args.slo_attainment, "workload": args.workload,
              "num_prompts": args.num_prompts, "goodput": rate,
              "goodput_per_gpu": rate / gpus if rate is not None else None, "points": points}
    out.mkdir(parents=True, exist_ok=True)
    (out / "goodput.json").write_text(json.dumps(result, indent=1, default=float))
    plot = plot_goodput(out, points, args.slo_attainment, rate)
    slos = " and ".join(f"{k.removesuffix('_ms').upper()} <= {v:g} ms" for k, v in slo.items())
    verdict = (f"**{rate:.3g} req/s, {rate / gpus:.3g} per GPU**" if rate is not None
               else "none (not even the lowest rate tried)")
    lines = [f"# kvflow simulate --goodput: {args.workload} workload, {args.num_prompts} "
             "requests", "", f"Goodput ({args.slo_attainment:.0%} of requests with {slos}) "
             f"on {gpus} GPUs: {verdict}.", "",
             "| rate req/s | within SLOs | P90 TTFT ms | P90 TPOT ms |", "|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['rate']:.3g} | {p['attainment']:.1%} | "
                     f"{fmt(p['ttft_ms_p90'])} | {fmt(p['tpot_ms_p90'], '.1f')} |")
    lines += ["", f"![goodput]({plot})"]
    write_report(out / "summary.md", lines, echo=not args.no_progress)
    return 0


