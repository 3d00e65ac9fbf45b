"""``kvflow bench compare``: static vs continuous batching vs chunked prefill, served for real.

One engine is served by a real tritonserver three times, once per batching mode, and the same
workload is replayed against each at every request rate of a sweep (lowest first). The modes:

- ``static``: the ``static`` policy, a batch runs to completion before the next is formed;
- ``continuous``: in-flight batching (``fcfs``), each prompt prefilled whole in one step;
- ``chunked``: in-flight batching with chunked prefill under a token budget per step.

All three share ``max_num_seqs`` and ``max_model_len`` and run with prefix caching off, so that
only the batching differs. For each mode the report gives the highest swept rate whose P99 TTFT
meets the SLO (with no failed request), throughput and P99 TTFT/E2E at each rate, and one chart
of latency against throughput. HF transformers' ``generate`` in static batches on the same
prompts and lengths is measured as the naive baseline.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path
from typing import Any

from kvflow.loadgen.sender import MetricsScraper, run_load
from kvflow.reports.summary import parse_slo, summarize
from kvflow.reports.sweep import fmt_value, max_sustained_rate, plot_sweep
from kvflow.reports.writers import write_report
from kvflow.workloads.flags import add_workload_args, build_workload, parse_rates
from kvflow.workloads.modes import MODE_LABELS, MODES, mode_scheduler_options, parse_modes
from kvflow.workloads.prompts import make_prompts
from kvflow.workloads.specs import RequestSpec

SLO_FACTORS = (0.5, 0.75, 1.0, 1.5, 2.5)  # the SLO sensitivity: the TTFT SLO times each


def add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    p.set_defaults(engine="engines/smollm2-135m", workload="trace", num_prompts=64,
                   slo="ttft_ms=2000")
    p.add_argument("--rates", default="0.25,0.5,1,2,inf",
                   help="comma-separated request rates (req/s); inf sends everything at once")
    p.add_argument("--modes", default="static,continuous,chunked",
                   help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument("--max-num-seqs", type=int, default=32,
                   help="most running requests, and the static batch size, in every mode")
    p.add_argument("--chunk-tokens", type=int, default=256,
                   help="chunked mode: token budget of one step (max_num_batched_tokens)")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="KV cache of each served engine (default: the engine's default)")
    p.add_argument("--hf-batch-size", type=int, default=16,
                   help="HF baseline: requests per static generate batch")
    p.add_argument("--hf-model", default=None,
                   help="checkpoint for the HF baseline (default: the engine's source)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--out", default="reports/bench_compare")
    p.add_argument("--rereport", action="store_true",
                   help="no serving: rewrite OUT/summary.md and the chart from OUT/compare.json "
                        "under --slo")


def mode_engine_args(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """The scheduler options a mode serves the engine with."""
    out = mode_scheduler_options(mode, args.max_num_seqs, args.max_model_len, args.chunk_tokens)
    if args.kv_cache_bytes is not None:
        out["kv_cache_bytes"] = args.kv_cache_bytes
    return out


def _workload_at(args: argparse.Namespace, rate: float) -> tuple[list[RequestSpec], dict]:
    ns = copy.copy(args)
    ns.request_rate = str(rate)
    return build_workload(ns)


def run_mode(mode: str, args: argparse.Namespace, workloads: dict[float, list[RequestSpec]],
             texts: list[str], slo: dict[str, float], out: Path) -> list[dict[str, Any]]:
    """Serve the engine in ``mode`` and replay every rate's workload against it."""
    from kvflow.client import stream_generate
    from kvflow.triton_backend.launcher import ServerConfig, TritonServer

    cfg = ServerConfig.on_free_ports(args.engine, mode_engine_args(mode, args))
    points = []
    print(f"[bench compare] {MODE_LABELS[mode]}: starting tritonserver ...", flush=True)
    with TritonServer(cfg, log_path=out / f"tritonserver-{mode}.log") as server:
        list(stream_generate(server.grpc_url, texts[0], {"max_tokens": 2}))  # warm-up
        for rate, specs in workloads.items():
            with MetricsScraper(server.metrics_url) as scraper:
                timings, duration = run_load(server.grpc_url, specs, texts, None,
                                             progress=not args.no_progress,
                                             desc=f"{mode} @ {rate:g} req/s")
            summary = summarize(timings, duration, slo.get("ttft_ms"), slo.get("tpot_ms"))
            points.append({"rate": rate, "summary": summary, "server_series": scraper.samples})
            print(f"[bench compare] {mode} @ {rate:g} req/s: "
                  f"{summary['output_token_throughput']:.1f} output tok/s, P99 TTFT "
                  f"{fmt_value(summary['ttft_ms']['p99'])} ms, {summary['failed']} failed",
                  flush=True)
    return points


def hf_model_of(engine_dir: str | Path) -> str:
    """The checkpoint HF transformers loads for the baseline: the default model's GGUF when the
    engine was built from it (same name and SHA-256), else ``--hf-model`` must say."""
    from kvflow.build.engine_config import EngineConfig, checkpoint_source
    from kvflow.model.loader import default_model_path

    source = EngineConfig.load(engine_dir).source
    default = default_model_path()
    if source.get("name") == default.name and source == checkpoint_source(default):
        return str(default)
    raise ValueError(f"the engine was built from {source.get('name', 'an unknown checkpoint')}, "
                     "not the default model: pass --hf-model PATH for the HF baseline")


def hf_static_generate(model: str, engine_dir: str, texts: list[str],
                       specs: list[RequestSpec], batch_size: int,
                       progress: bool) -> dict[str, Any]:
    """HF transformers ``generate`` in static batches of ``batch_size`` (arrival order), greedy,
    each batch left-padded and generating its longest output for every member (EOS ignored):
    the naive way to serve. Throughput counts only the tokens each request asked for."""
    import torch

    from kvflow.model.hf_reference import load_hf_reference
    from kvflow.text.tokenizer import EngineTokenizer

    tok = EngineTokenizer(engine_dir)
    hf = load_hf_reference(model)
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    outs = [s.output_tokens for s in specs]

    def generate(batch: list[list[int]], new_tokens: int) -> None:
        width = max(len(x) for x in batch)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch])
        hf.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(ids), desc=f"HF generate, batches of {batch_size}", unit="req")
    with torch.inference_mode():
        generate([ids[0][:8]], 2)  # warm-up
        generated = 0
        t0 = time.perf_counter()
        for start in range(0, len(ids), batch_size):
            batch = ids[start:start + batch_size]
            new_tokens = max(outs[start:start + batch_size])
            generate(batch, new_tokens)
            generated += new_tokens * len(batch)
            if bar is not None:
                bar.update(len(batch))
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    useful = sum(outs)
    return {"model": model, "batch_size": batch_size, "duration_s": duration,
            "requests": len(ids), "output_tokens": useful, "generated_tokens": generated,
            "request_throughput": len(ids) / duration,
            "output_token_throughput": useful / duration,
            "total_token_throughput": (useful + sum(len(x) for x in ids)) / duration}


def bench_compare(args: argparse.Namespace) -> dict[str, Any]:
    """Run the comparison; returns the report (also written to ``args.out``)."""
    rates = parse_rates(args.rates)
    modes = parse_modes(args.modes)
    slo = parse_slo(args.slo)
    if "ttft_ms" not in slo:
        raise ValueError("--slo: bench compare needs a ttft_ms SLO (e.g. ttft_ms=2000)")
    for name in ("max_num_seqs", "chunk_tokens", "hf_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                             f"{getattr(args, name)}")
    from kvflow.orchestrator.llm import plan_engine

    for mode in modes:  # every mode's options against the engine's limits, before serving
        plan_engine(args.engine, **mode_engine_args(mode, args))
    hf_model = None if args.no_hf else (args.hf_model or hf_model_of(args.engine))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workloads: dict[float, list[RequestSpec]] = {}
    info: dict[str, Any] = {}
    for rate in rates:
        workloads[rate], info = _workload_at(args, rate)
    first = workloads[rates[0]]
    texts = make_prompts(first, args.engine, args.seed)

    results = {mode: run_mode(mode, args, workloads, texts, slo, out) for mode in modes}

    hf = None
    if hf_model is not None:
        print(f"[bench compare] HF transformers generate baseline ({hf_model}) ...", flush=True)
        hf = hf_static_generate(hf_model, args.engine, texts, first, args.hf_batch_size,
                                not args.no_progress)

    config = {**{k: v for k, v in info.items() if k != "request_rate"},
              "engine": str(args.engine), "rates": rates, "modes": modes, "slo": slo,
              "num_prompts": len(first), "max_num_seqs": args.max_num_seqs,
              "chunk_tokens": args.chunk_tokens, "max_model_len": args.max_model_len,
              "engine_args": {m: mode_engine_args(m, args) for m in modes}}
    return finish_report(out, config, results, hf)


def sustained_rates(results: dict[str, list[dict[str, Any]]],
                    slo_ttft_ms: float) -> tuple[dict[str, float | None],
                                                 dict[str, float | None] | None]:
    """Each mode's highest rate under the SLO, and its ratio to static's (None when static
    sustains nothing, or a rate is inf: everything at once met the SLO, no finite ratio)."""
    sustained = {m: max_sustained_rate(points, slo_ttft_ms) for m, points in results.items()}
    base = sustained.get("static")
    if not base or not math.isfinite(base):
        return sustained, None
    return sustained, {m: (r / base if r and math.isfinite(r) else None)
                       for m, r in sustained.items()}


def finish_report(out: Path, config: dict[str, Any], results: dict[str, list[dict[str, Any]]],
                  hf: dict[str, Any] | None) -> dict[str, Any]:
    """Derive the comparison from the measured points and write compare.json, the chart and
    summary.md (also how ``--rereport`` rewrites them under another SLO)."""
    slo = config["slo"]
    sustained, vs_static = sustained_rates(results, slo["ttft_ms"])
    best_tput = {m: max(p["summary"]["output_token_throughput"] for p in points)
                 for m, points in results.items()}
    report: dict[str, Any] = {
        "config": config,
        "max_sustained_rate": sustained,
        "best_output_token_throughput": best_tput,
        "results": results,
        "hf_baseline": hf,
        # The same sweep judged under tighter and looser SLOs: how much the verdict hangs on it.
        "slo_sensitivity": {f"{f * slo['ttft_ms']:g}": sustained_rates(results,
                                                                      f * slo["ttft_ms"])[0]
                            for f in SLO_FACTORS},
    }
    if vs_static is not None:
        report["sustained_rate_vs_static"] = vs_static
    if hf is not None:
        report["throughput_vs_hf"] = {m: best_tput[m] / hf["output_token_throughput"]
                                      for m in results}
    report["plots"] = [plot_sweep(out, results, slo["ttft_ms"], hf)]
    (out / "compare.json").write_text(json.dumps(report, indent=1, default=float))
    write_report(out / "summary.md", summary_lines(report))
    return report


def rereport(args: argparse.Namespace) -> dict[str, Any]:
    """Rewrite an existing comparison's summary and chart under ``--slo`` (no serving)."""
    out = Path(args.out)
    try:
        old = json.loads((out / "compare.json").read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"--rereport: no {out / 'compare.json'}; run bench compare "
                                "with this --out first") from None
    slo = parse_slo(args.slo)
    if "ttft_ms" not in slo:
        raise ValueError("--slo: bench compare needs a ttft_ms SLO (e.g. ttft_ms=2000)")
    results = {m: [{**p, "rate": float(p["rate"])} for p in points]
               for m, points in old["results"].items()}
    return finish_report(out, {**old["config"], "slo": slo}, results, old["hf_baseline"])


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The markdown summary of a comparison report."""
    cfg = report["config"]
    slo = cfg["slo"]
    lines = [f"# kvflow bench compare: {cfg['workload']} workload, {cfg['num_prompts']} "
             f"requests per run", "",
             f"Engine `{cfg['engine']}`; max_num_seqs {cfg['max_num_seqs']} (also the static "
             f"batch size), max_model_len {cfg['max_model_len']}, chunked-prefill budget "
             f"{cfg['chunk_tokens']} tokens/step, prefix caching off. SLO: P99 TTFT <= "
             f"{slo['ttft_ms']:g} ms" + (f", TPOT <= {slo['tpot_ms']:g} ms (goodput)"
                                        if "tpot_ms" in slo else "") + "."]
    if "note" in cfg:
        lines += ["", f"Trace: {cfg['note']}."]
    lines += ["", "| mode | highest rate meeting the SLO (req/s) | vs static | best output "
              "tok/s |" + (" vs HF generate |" if report["hf_baseline"] else ""),
              "|---|---|---|---|" + ("---|" if report["hf_baseline"] else "")]
    vs_static = report.get("sustained_rate_vs_static", {})
    vs_hf = report.get("throughput_vs_hf", {})
    for mode in cfg["modes"]:
        rate = report["max_sustained_rate"][mode]
        ratio = vs_static.get(mode)
        row = (f"| {MODE_LABELS[mode]} | {fmt_value(rate, 'g') if rate else 'none swept'} | "
               f"{fmt_value(ratio, '.2f') + 'x' if ratio else '-'} | "
               f"{report['best_output_token_throughput'][mode]:.1f} |")
        if report["hf_baseline"]:
            row += f" {vs_hf[mode]:.2f}x |"
        lines.append(row)
    sens = report.get("slo_sensitivity")
    if sens:
        lines += ["", "The same sweep under other P99 TTFT SLOs (highest rate met, req/s):", "",
                  "| SLO (ms) | " + " | ".join(cfg["modes"]) + " |",
                  "|---|" + "---|" * len(cfg["modes"])]
        for slo_ms, rates in sens.items():
            lines.append(f"| {slo_ms} | " + " | ".join(
                fmt_value(rates[m], "g") if rates[m] else "none" for m in cfg["modes"]) + " |")
    hf = report["hf_baseline"]
    if hf:
        lines += ["", f"HF transformers `generate`, static batches of {hf['batch_size']} in "
                  f"arrival order on the same prompts: {hf['output_token_throughput']:.1f} "
                  f"output tok/s ({hf['generated_tokens']} tokens generated for "
                  f"{hf['output_tokens']} requested: the rest is padding to each batch's "
                  f"longest output), {hf['duration_s']:.1f} s."]
    lines += ["", "| mode | offered req/s | achieved req/s | output tok/s | P99 TTFT ms | "
              "P99 E2E ms | mean TPOT ms | goodput req/s | failed |",
              "|---|---|---|---|---|---|---|---|---|"]
    for mode in cfg["modes"]:
        for p in report["results"][mode]:
            s = p["summary"]
            lines.append(
                f"| {mode} | {p['rate']:g} | {s['request_throughput']:.2f} | "
                f"{s['output_token_throughput']:.1f} | {fmt_value(s['ttft_ms']['p99'])} | "
                f"{fmt_value(s['e2e_ms']['p99'])} | {fmt_value(s['tpot_ms']['mean'], '.1f')} | "
                f"{s['goodput']:.2f} | {s['failed']} |")
    lines += ["", "![latency vs throughput](compare.png)"]
    return lines


def main(args: argparse.Namespace) -> int:
    if args.rereport:
        rereport(args)
    else:
        bench_compare(args)
    return 0
