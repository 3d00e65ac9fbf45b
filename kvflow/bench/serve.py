"""``kvflow bench serve``: drive a running server with a workload and report what users feel.

Requests are sent over tritonclient gRPC streaming, or with ``--backend openai`` to the OpenAI
API, at their workload arrival times (bounded by ``--max-concurrency``); each request's send
time and token arrival times are recorded on the client. Meanwhile the server's metrics
endpoint is scraped for the running batch, the waiting queue and KV usage. The report (JSON,
markdown, PNG plots) goes to ``--out``; it names every failed request's error, and the command
exits 1 when any request failed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvflow.loadgen.clients import OpenAIClient
from kvflow.loadgen.sender import MetricsScraper, load_client, run_load
from kvflow.reports.serve_report import failure_line, tenant_line, write_serve_report
from kvflow.reports.summary import parse_slo, tenant_summary
from kvflow.workloads.flags import add_workload_args, build_workload
from kvflow.workloads.prompts import make_prompts


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["triton", "openai"], default="triton",
                   help="the front door: Triton gRPC streaming, or the OpenAI API")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="--backend openai: /v1/completions or /v1/chat/completions (chat wraps "
                        "each prompt in the chat template, so its prompts are longer)")
    p.add_argument("--url", default=None,
                   help="the server: gRPC host:port (default localhost:8001), or for "
                        "--backend openai its base URL (default http://localhost:9000)")
    p.add_argument("--metrics-url", default=None,
                   help="Prometheus endpoint (default: http://HOST:8002/metrics)")
    add_workload_args(p)
    p.add_argument("--request-rate", default=None,
                   help="requests/s, or inf (all at once); default inf, or for the trace its "
                        "own timing (divided by --time-scale); given for the trace, the "
                        "arrivals are stretched to this mean rate keeping their pattern")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--out", default="reports/bench_serve")


def bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the report dict (also written to ``args.out``)."""
    slo = parse_slo(args.slo)
    specs, info = build_workload(args)
    prompts = make_prompts(specs, args.engine, args.seed)
    client = load_client(args)
    url = client.url
    host = url.split("://")[-1].rsplit(":", 1)[0]
    metrics_url = args.metrics_url or f"http://{host}:8002/metrics"
    with MetricsScraper(metrics_url) as scraper:
        timings, duration = run_load(client, specs, prompts, args.max_concurrency,
                                     progress=not args.no_progress)
    config = {**info, "url": url, "backend": client.name,
              "max_concurrency": args.max_concurrency, "num_prompts": len(specs), "slo": slo}
    if isinstance(client, OpenAIClient):
        config["stale_connection_retries"] = client.stale_retries
    lines = []
    if any(s.tenant for s in specs):
        config["tenants"] = tenant_summary(timings, [s.tenant for s in specs])
        lines.append(tenant_line(config["tenants"]))
    return write_serve_report(Path(args.out), "kvflow bench serve", config, timings, duration,
                              scraper.samples, extra_lines=lines)


def main(args: argparse.Namespace) -> int:
    """``kvflow bench serve``: 1 when any request failed (the report says why), else 0."""
    report = bench_serve(args)
    errors = report["errors"]
    if not errors:
        return 0
    line = failure_line(errors, len(report["requests"]), report["summary"]["failed_by_kind"])
    print(f"kvflow bench serve: {line}; first:", file=sys.stderr)
    for e in errors[:3]:
        print(f"  request {e['index']}: {e['kind']}: {e['error']}", file=sys.stderr)
    return 1
