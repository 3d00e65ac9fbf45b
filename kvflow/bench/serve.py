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
import json
import queue
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from kvflow.bench.clients import LoadClient, OpenAIClient, TritonGrpcClient
from kvflow.bench.metrics import RequestTiming, summarize, tenant_summary
from kvflow.bench.report import pyplot, save_figure, write_report
from kvflow.bench.workloads import (
    RequestSpec,
    load_azure_trace,
    make_prompt_ids,
    random_workload,
    retime,
    shared_prefix_workload,
    tenants_workload,
)


def default_trace() -> Path:
    """The Azure conversation trace: ``../shared/data`` beside the checkout (where the team's
    machines keep it), else ``/work/shared/data``; the first candidate when neither exists,
    so that the error names where it was looked for."""
    name = "AzureLLMInferenceTrace_conv.csv"
    candidates = [Path(__file__).resolve().parents[3] / "shared" / "data" / name,
                  Path("/work/shared/data") / name]
    return next((c for c in candidates if c.is_file()), candidates[0])


DEFAULT_TRACE = default_trace()
SHOWN_ERRORS = 10  # failed requests listed in summary.md (report.json lists every one)
SERIES = ("kvflow_num_requests_running", "kvflow_num_requests_waiting",
          "kvflow_kv_cache_usage_ratio")


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft_ms=500,tpot_ms=50`` -> {"ttft_ms": 500.0, "tpot_ms": 50.0}."""
    out: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in ("ttft_ms", "tpot_ms"):
            raise ValueError(f"--slo: unknown key {key!r} (known: ttft_ms, tpot_ms)")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {key} must be a number, got {value!r}") from None
    return out


def add_workload_args(p: argparse.ArgumentParser,
                      extra_workloads: dict[str, str] | None = None) -> None:
    """The workload options ``bench serve``, ``bench compare`` and ``simulate`` share;
    ``extra_workloads`` (name -> help) adds workloads of the caller's own."""
    extra = extra_workloads or {}
    p.add_argument("--engine", default="engines/smollm2-135m",
                   help="engine folder whose tokenizer cuts prompts to exact lengths")
    p.add_argument("--workload", choices=["random", "trace", "prefix", "tenants", *extra],
                   default="random",
                   help="; ".join(["tenants: one heavy tenant (long prompts, a high rate) and "
                                   "several light ones (short chats), on the trace's lengths",
                                   *(f"{k}: {v}" for k, v in extra.items())]))
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Azure LLM trace CSV")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="trace: arrival times divided by this (2 = twice as fast)")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="trace: prompt and output lengths multiplied by this before clipping")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=512, help="prefix workload: shared tokens")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="trace: prompts clipped to 3/4 of this and outputs to 1/4, so every "
                        "request fits (the report says how many were clipped)")
    p.add_argument("--num-light-tenants", type=int, default=4,
                   help="tenants workload: light tenants")
    p.add_argument("--heavy-share", type=float, default=0.5,
                   help="tenants workload: the heavy tenant's share of the requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", default=None, help="e.g. ttft_ms=2000,tpot_ms=200")
    p.add_argument("--no-progress", action="store_true")


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


def _parse_rate(text: str | None) -> float:
    try:
        rate = float("inf" if text is None else text)
    except ValueError:
        raise ValueError(f"--request-rate must be a number or inf, got {text!r}") from None
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {text!r}")
    return rate


def build_workload(args: argparse.Namespace) -> tuple[list[RequestSpec], dict[str, Any]]:
    rate = _parse_rate(args.request_rate)
    info: dict[str, Any] = {"workload": args.workload, "request_rate": rate, "seed": args.seed}
    if args.workload == "tenants":
        if args.request_rate is None:
            raise ValueError("--request-rate is required for the tenants workload")
        budget = args.max_model_len
        max_prompt = budget * 3 // 4
        lengths, clip = load_azure_trace(args.trace, max_prompt_tokens=max_prompt,
                                         max_output_tokens=budget - max_prompt,
                                         length_scale=args.length_scale)
        specs = tenants_workload(lengths, args.num_prompts, rate, args.seed,
                                 args.num_light_tenants, args.heavy_share)
        info.update(trace=str(args.trace), length_scale=args.length_scale,
                    num_light_tenants=args.num_light_tenants, heavy_share=args.heavy_share,
                    note=f"lengths from the whole trace, multiplied by {args.length_scale:g}, "
                         f"prompts clipped to {max_prompt} and outputs to "
                         f"{budget - max_prompt} tokens; the heavy tenant's prompts from its "
                         "longest quarter, the light tenants' from its shortest half")
    elif args.workload == "trace":
        budget = args.max_model_len
        max_prompt = budget * 3 // 4
        specs, clip = load_azure_trace(args.trace, limit=args.num_prompts,
                                       time_scale=args.time_scale,
                                       max_prompt_tokens=max_prompt,
                                       max_output_tokens=budget - max_prompt,
                                       length_scale=args.length_scale)
        if args.request_rate is not None:
            specs = retime(specs, rate)
        info.update(trace=str(args.trace), time_scale=args.time_scale, clipping=clip,
                    length_scale=args.length_scale,
                    note=f"the first {len(specs)} rows; lengths multiplied by "
                         f"{args.length_scale:g}, then prompts clipped to {max_prompt} and "
                         f"outputs to {budget - max_prompt} tokens so that every request fits "
                         f"max_model_len {budget} ({clip['prompt_clipped']} prompts and "
                         f"{clip['output_clipped']} outputs clipped)")
        if args.request_rate is None:
            info["request_rate"] = (len(specs) - 1) / max(specs[-1].arrival_s, 1e-9)
    elif args.workload == "prefix":
        specs = shared_prefix_workload(args.num_prompts, args.prefix_len, 16, args.output_len,
                                       rate, args.seed)
        info.update(prefix_len=args.prefix_len)
    else:
        specs = random_workload(args.num_prompts, args.input_len, args.output_len, rate,
                                args.burstiness, args.seed, args.range_ratio)
        info.update(input_len=args.input_len, output_len=args.output_len,
                    burstiness=args.burstiness, range_ratio=args.range_ratio)
    return specs, info


def make_prompts(specs: list[RequestSpec], engine_dir: str, seed: int) -> list[str]:
    """Real-text prompts of exactly each request's token count (shared groups share a prefix)."""
    from kvflow.text.tokenizer import EngineTokenizer

    tok = EngineTokenizer(engine_dir)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    prompts = []
    for i, s in enumerate(specs):
        if s.prefix_group is None:
            prompts.append(make_prompt_ids(encode, s.prompt_tokens, seed + i))
        else:
            question = 16
            prefix = make_prompt_ids(encode, s.prompt_tokens - question, 10_000 + s.prefix_group)
            prompts.append(prefix + make_prompt_ids(encode, question, seed + i))
    return [tok.decode(p, skip_special_tokens=False) for p in prompts]


class MetricsScraper(threading.Thread):
    """Samples the server's running batch, waiting queue and KV usage every ``period_s``;
    a context manager that scrapes while its block runs."""

    def __init__(self, url: str, period_s: float = 0.25) -> None:
        super().__init__(name="kvflow-bench-scraper", daemon=True)
        self.url, self.period_s = url, period_s
        self.samples: list[dict[str, float]] = []
        self._halt = threading.Event()
        self.t0 = time.perf_counter()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                text = urllib.request.urlopen(self.url, timeout=2).read().decode()
                row = {"t_s": time.perf_counter() - self.t0}
                for line in text.splitlines():
                    name = line.split("{")[0].split(" ")[0]
                    if name in SERIES:
                        row[name] = float(line.rsplit(" ", 1)[1])
                self.samples.append(row)
            except OSError:
                pass
            self._halt.wait(self.period_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def __enter__(self) -> MetricsScraper:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_load(url: str | LoadClient, specs: list[RequestSpec], texts: list[str],
             max_concurrency: int | None,
             progress: bool = True,
             desc: str = "requests") -> tuple[list[RequestTiming], float]:
    """Send request ``i`` (prompt ``texts[i]``, greedy, exactly ``specs[i].output_tokens``) at its
    arrival time, at most ``max_concurrency`` in flight, each client connection reused; returns
    client-side timings (in request order; a failed request's with its error) and the
    duration. All arrivals at 0 with a concurrency bound is a closed loop. ``url``: a Triton
    gRPC ``host:port``, or any :class:`LoadClient`."""
    client = TritonGrpcClient(url) if isinstance(url, str) else url
    limit = threading.BoundedSemaphore(max_concurrency or len(specs))
    clients: queue.SimpleQueue[Any] = queue.SimpleQueue()
    timings: list[RequestTiming | None] = [None] * len(specs)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(specs), desc=desc, unit="req")

    def one(i: int, spec: RequestSpec) -> None:
        send = time.perf_counter()
        times: list[float] = []
        prompt_tokens, error, kind, conn = spec.prompt_tokens, None, None, None
        try:
            try:
                conn = clients.get_nowait()
            except queue.Empty:
                conn = client.connect()
            seen = 0
            for num_output, num_prompt in client.stream(conn, texts[i], spec.output_tokens,
                                                        tenant=spec.tenant):
                now = time.perf_counter()
                times.extend([now] * (num_output - seen))
                seen, prompt_tokens = num_output, num_prompt
            clients.put(conn)
        except Exception as e:  # noqa: BLE001  a failed request is counted, not fatal
            kind = getattr(e, "kind", type(e).__name__)
            error = " ".join(str(e).split()) or kind  # one line, for summary.md
            if conn is not None:
                client.close(conn)
        finally:
            limit.release()
        timings[i] = RequestTiming(send, times, prompt_tokens, len(times), error is None,
                                   error, kind)
        if bar is not None:
            bar.update(1)

    threads = []
    t0 = time.perf_counter()
    for i, spec in enumerate(specs):
        delay = t0 + spec.arrival_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        limit.acquire()
        t = threading.Thread(target=one, args=(i, spec), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    while True:
        try:
            client.close(clients.get_nowait())
        except queue.Empty:
            break
    return [t for t in timings if t is not None], duration


def _plots(out: Path, timings: list[RequestTiming], series: list[dict[str, float]]) -> list[str]:
    plt = pyplot()
    import numpy as np

    files = []
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (name, values) in zip(axes, (
            ("TTFT (ms)", [t.ttft_s * 1e3 for t in timings if t.ok and t.ttft_s is not None]),
            ("TPOT (ms)", [t.tpot_s * 1e3 for t in timings if t.ok and t.tpot_s is not None]),
            ("E2E latency (ms)", [t.e2e_s * 1e3 for t in timings if t.ok and t.e2e_s is not None]),
    ), strict=True):
        if values:
            xs = np.sort(values)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    fig.suptitle("Latency CDFs")
    files.append(save_figure(fig, out / "latency_cdf.png"))

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (key, label) in zip(axes, (("kvflow_num_requests_running", "running batch"),
                                       ("kvflow_num_requests_waiting", "waiting requests"),
                                       ("kvflow_kv_cache_usage_ratio", "KV cache usage")),
                                strict=True):
        pts = [(s["t_s"], s[key]) for s in series if key in s]
        if pts:
            ax.plot(*zip(*pts, strict=True), drawstyle="steps-post", marker=".")
        ax.set_xlabel("time (s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle("Server state over time (scraped from /metrics)")
    files.append(save_figure(fig, out / "server_series.png"))
    return files


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


def tenant_line(ts: dict[str, Any]) -> str:
    """One summary line of :func:`~kvflow.bench.metrics.tenant_summary`."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f} ms"

    light = ts["light_ttft_ms"]
    return (f"\nTenants: Jain's index of service against fair shares {ts['jain_index']:.3f}; "
            f"light tenants' TTFT mean {ms(light['mean'])}, p99 {ms(light['p99'])}; longest "
            f"wait {ms(ts['longest_wait_ms'])}; {ts['not_served_fraction']:.1%} rejected or "
            "timed out.")


def load_client(args: argparse.Namespace) -> LoadClient:
    """The client of ``--backend`` (and ``--endpoint``) at ``--url``."""
    if getattr(args, "backend", "triton") == "openai":
        return OpenAIClient(args.url or "http://localhost:9000", chat=args.endpoint == "chat")
    return TritonGrpcClient(args.url or "localhost:8001")


def write_serve_report(out: Path, title: str, config: dict[str, Any],
                       timings: list[RequestTiming], duration_s: float,
                       series: list[dict[str, float]],
                       request_extra: dict[str, list[Any]] | None = None,
                       extra_plots: list[str] | None = None,
                       extra_lines: list[str] | None = None,
                       echo: bool = True) -> dict[str, Any]:
    """The ``bench serve`` report (``report.json``, ``summary.md``, latency CDFs and server
    series plots) of one run; ``kvflow simulate`` writes the same, field for field, adding
    per-request columns (``request_extra``), plots and summary lines of its own."""
    slo = config.get("slo", {})
    summary = summarize(timings, duration_s, slo.get("ttft_ms"), slo.get("tpot_ms"))
    out.mkdir(parents=True, exist_ok=True)
    errors = failures(timings)
    summary["failed_by_kind"] = dict(Counter(e["kind"] for e in errors).most_common())
    requests = [{"send_s": t.send_s, "ttft_s": t.ttft_s, "tpot_s": t.tpot_s,
                 "e2e_s": t.e2e_s, "prompt_tokens": t.prompt_tokens,
                 "output_tokens": t.output_tokens, "ok": t.ok} for t in timings]
    for key, values in (request_extra or {}).items():
        for row, value in zip(requests, values, strict=True):
            row[key] = value
    report = {"config": config, "summary": summary, "requests": requests, "errors": errors,
              "server_series": series}
    report["plots"] = _plots(out, timings, series) + list(extra_plots or [])
    (out / "report.json").write_text(json.dumps(report, indent=1, default=float))
    rate = config.get("request_rate")
    lines = [f"# {title}: {config['workload']} workload, {len(timings)} requests", "",
             f"Request rate {rate if rate is not None else '-'}, max concurrency "
             f"{config.get('max_concurrency') or 'unbounded'}, duration {duration_s:.1f} s.",
             "", "| metric | value |", "|---|---|"]
    for key in ("completed", "failed", "request_throughput", "output_token_throughput",
                "total_token_throughput", "goodput"):
        value = summary[key]
        lines.append(f"| {key} | {value:.3f} |" if isinstance(value, float)
                     else f"| {key} | {value} |")
    lines += ["", "| latency (ms) | mean | median | p90 | p95 | p99 |", "|---|---|---|---|---|---|"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[key]
        cells = [("-" if stats[s] is None else f"{stats[s]:.1f}")
                 for s in ("mean", "median", "p90", "p95", "p99")]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    if errors:
        lines += ["", failure_line(errors, len(timings), summary["failed_by_kind"]) + ":", ""]
        lines += [f"- request {e['index']}: {e['kind']}: {e['error']}"
                  for e in errors[:SHOWN_ERRORS]]
        if len(errors) > SHOWN_ERRORS:
            lines.append(f"- and {len(errors) - SHOWN_ERRORS} more (report.json, `errors`)")
    if "note" in config:
        lines += ["", f"Trace lengths: {config['note']}."]
    lines += list(extra_lines or [])
    lines += ["", "Plots: " + ", ".join(f"![]({p})" for p in report["plots"])]
    write_report(out / "summary.md", lines, echo=echo)
    return report


def failures(timings: list[RequestTiming]) -> list[dict[str, Any]]:
    """Each failed request: its index in the workload, its error's kind and message (both
    ``unknown`` where the client recorded none, as for the simulator's rejections)."""
    return [{"index": i, "kind": t.error_kind or "unknown", "error": t.error or "unknown"}
            for i, t in enumerate(timings) if not t.ok]


def failure_line(errors: list[dict[str, Any]], num_requests: int,
                 by_kind: dict[str, int]) -> str:
    """``5 of 16 requests failed (BrokenPipeError: 5)``."""
    kinds = ", ".join(f"{kind}: {count}" for kind, count in by_kind.items())
    return f"{len(errors)} of {num_requests} requests failed ({kinds})"


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
