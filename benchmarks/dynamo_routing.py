"""KV-aware routing against round robin on a real Dynamo cluster of kvflow workers (issue 21).

One run: etcd, NATS, two `kvflow dynamo-worker` processes on the default model, and Dynamo's
frontend twice over the same workers, once with the KV router and once with round robin. The
same shared-prefix workload (a few long system prompts, each with many questions, Poisson
arrivals) goes through each frontend in turn, with prefixes of its own so that neither run
finds the other's cache. Per router: the prefix-hit rate (cached prompt tokens over prompt
tokens, from each response's ``usage.prompt_tokens_details.cached_tokens``, checked against
the workers' ``kvflow_prefix_cache_hits_total``), TTFT, throughput and each worker's share.

    .venv/bin/python benchmarks/dynamo_routing.py --out reports/dynamo_routing

Writes ``report.json``, ``summary.md`` and ``routing.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvflow.dynamo.launcher import Cluster  # noqa: E402
from kvflow.loadgen.clients import OpenAIClient  # noqa: E402
from kvflow.loadgen.sender import run_load  # noqa: E402
from kvflow.reports.writers import pyplot, save_figure  # noqa: E402
from kvflow.workloads.prompts import make_prompts  # noqa: E402
from kvflow.workloads.specs import RequestSpec  # noqa: E402
from kvflow.workloads.synthetic import shared_prefix_workload  # noqa: E402


class CountingClient(OpenAIClient):
    """Counts streamed tokens chunk by chunk (Dynamo sends one token a chunk) and keeps each
    request's final usage, cached tokens included."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.usages: list[dict[str, Any]] = []
        self._seen: dict[int, int] = {}

    def request_body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        body = super().request_body(prompt, max_tokens)
        body["stream_options"] = {"include_usage": True}
        return body

    def token_counts(self, event: dict[str, Any]) -> tuple[int, int] | None:
        key = threading.get_ident()  # one stream per thread in run_load
        if event.get("usage"):
            self.usages.append(event["usage"])
            self._seen.pop(key, None)
            return None
        choices = event.get("choices") or []
        if choices and choices[0].get("text"):
            self._seen[key] = self._seen.get(key, 0) + 1
            return self._seen[key], 0
        return None


def worker_counter(cluster: Cluster, name: str) -> list[float]:
    out = []
    for i in range(cluster.workers):
        total = 0.0
        for line in cluster.worker_metrics(i).splitlines():
            if line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        out.append(total)
    return out


def run_mode(cluster: Cluster, mode: str, specs: list[RequestSpec], texts: list[str],
             concurrency: int) -> dict[str, Any]:
    client = CountingClient(cluster.frontend_urls[mode], model=cluster.model_name)
    hits0 = worker_counter(cluster, "kvflow_prefix_cache_hits_total")
    served0 = worker_counter(cluster, "kvflow_request_success_total")
    timings, duration = run_load(client, specs, texts, concurrency, desc=mode)
    hits1 = worker_counter(cluster, "kvflow_prefix_cache_hits_total")
    served1 = worker_counter(cluster, "kvflow_request_success_total")
    ok = [t for t in timings if t.ok]
    prompt = sum(u["prompt_tokens"] for u in client.usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                 for u in client.usages)
    ttft = np.array([t.ttft_s for t in ok if t.ttft_s is not None]) * 1e3
    out_tokens = sum(t.output_tokens for t in ok)
    return {"mode": mode, "requests": len(specs), "completed": len(ok),
            "duration_s": duration, "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "worker_hit_tokens": [b - a for a, b in zip(hits0, hits1, strict=True)],
            "worker_requests": [b - a for a, b in zip(served0, served1, strict=True)],
            "ttft_ms": {"mean": float(ttft.mean()), "p50": float(np.percentile(ttft, 50)),
                        "p90": float(np.percentile(ttft, 90)),
                        "p99": float(np.percentile(ttft, 99))},
            "request_throughput": len(ok) / duration,
            "output_token_throughput": out_tokens / duration,
            "ttfts_ms": ttft.tolist()}


def plot(out: Path, results: list[dict[str, Any]]) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = [r["mode"] for r in results]
    axes[0].bar(names, [100 * r["hit_rate"] for r in results], color=["tab:green", "tab:gray"])
    axes[0].set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    axes[0].set_ylim(0, 100)
    for r in results:
        xs = np.sort(r["ttfts_ms"])
        axes[1].plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=r["mode"])
    axes[1].set_xlabel("TTFT (ms)")
    axes[1].set_ylabel("fraction of requests")
    axes[1].set_title("TTFT CDF")
    axes[1].legend()
    width = 0.35
    for j, r in enumerate(results):
        x = np.arange(len(r["worker_requests"])) + (j - 0.5) * width
        axes[2].bar(x, r["worker_requests"], width, label=r["mode"])
    axes[2].set_xticks(range(len(results[0]["worker_requests"])),
                       [f"worker {i}" for i in range(len(results[0]["worker_requests"]))])
    axes[2].set_ylabel("requests served")
    axes[2].legend(loc="lower center")
    fig.suptitle("Dynamo frontend over 2 kvflow workers: KV router vs round robin, "
                 "same shared-prefix workload")
    fig.tight_layout()
    return save_figure(fig, out / "routing.png")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default=str(REPO / "engines" / "smollm2-135m"))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=0.5)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--worker-kv-blocks", type=int, default=160,
                   help="each worker's KV pool: 160 blocks of 16 tokens hold 5 of the 8 "
                        "prefixes, so the cluster's two caches hold them all only if each "
                        "prefix stays on one worker")
    p.add_argument("--modes", default="kv,round-robin")
    p.add_argument("--overlap-credit", type=float, default=None,
                   help="the KV router's --router-kv-overlap-score-credit (Dynamo's default "
                        "1.0: a cached block saves what one block of load costs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "reports" / "dynamo_routing"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    base = shared_prefix_workload(args.num_prompts, args.prefix_len, 16, args.output_len,
                                  args.request_rate, args.seed, args.num_prefixes)
    results = []
    with Cluster(args.engine, workers=2, frontends={m: 0 for m in modes},
                 model_name="smollm2",
                 frontend_args=([] if args.overlap_credit is None else
                                ["--router-kv-overlap-score-credit", str(args.overlap_credit)]),
                 worker_args=["--max-num-seqs", "16", "--num-kv-blocks",
                                              str(args.worker_kv_blocks)]) as cluster:
        for j, mode in enumerate(modes):
            # The same arrivals and lengths; prefixes of this mode's own.
            specs = [RequestSpec(s.arrival_s, s.prompt_tokens, s.output_tokens,
                                 (s.prefix_group or 0) + 100 * j) for s in base]
            texts = make_prompts(specs, args.engine, args.seed + 1000 * j)
            t0 = time.time()
            results.append(run_mode(cluster, mode, specs, texts, args.max_concurrency))
            print(f"[{mode}] {time.time() - t0:.0f}s: hit rate "
                  f"{results[-1]['hit_rate']:.1%}, mean TTFT "
                  f"{results[-1]['ttft_ms']['mean']:.0f} ms", flush=True)
    png = plot(out, results)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    (out / "report.json").write_text(json.dumps({"config": config, "results": results},
                                                indent=1))
    lines = ["# KV-aware routing vs round robin on Dynamo (2 kvflow workers)", "",
             f"{args.num_prompts} requests, {args.num_prefixes} shared prefixes of "
             f"{args.prefix_len} tokens + 16-token questions, {args.output_len} output tokens, "
             f"Poisson {args.request_rate} req/s, at most {args.max_concurrency} in flight; "
             f"default model (4-bit, ONNX Runtime on CPU), one worker per core, each with "
             f"{args.worker_kv_blocks} KV blocks of 16 tokens.", "",
             "| router | hit rate | mean TTFT (ms) | p90 TTFT (ms) | req/s | output tok/s "
             "| requests per worker |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['hit_rate']:.1%} | {r['ttft_ms']['mean']:.0f} | "
                     f"{r['ttft_ms']['p90']:.0f} | {r['request_throughput']:.2f} | "
                     f"{r['output_token_throughput']:.1f} | "
                     f"{' / '.join(str(int(x)) for x in r['worker_requests'])} |")
    lines += ["", f"![]({Path(png).name})"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
