"""Prefix caching through the server: a shared 1,000-token system prompt, caching on and off.

Workload A: every request is the same 1,000-token system prompt followed by a short distinct
question (the RAG / chat-assistant case). Workload B: prompts with nothing in common. Each runs
against a fresh server with prefix caching on, then off; clients stream over gRPC. Reports mean
TTFT (client side) and output throughput.

    python benchmarks/prefix_caching.py --engine engines/bench/onnxruntime
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from kvflow.client import StreamingClient
from kvflow.loadgen.sender import run_load
from kvflow.reports.writers import write_report
from kvflow.text.tokenizer import EngineTokenizer
from kvflow.triton_backend.launcher import ServerConfig, TritonServer
from kvflow.workloads.specs import RequestSpec

PARAGRAPH = (
    "You are a meticulous assistant for a company that builds serving infrastructure for large "
    "language models. Answer precisely, cite the relevant component, prefer short sentences, "
    "and say so when you do not know. The system has a scheduler that batches requests, a paged "
    "key-value cache split into fixed-size blocks, a sampler, and a detokenizer that streams "
    "text. Operators care about time to first token, time per output token, and throughput. "
)
QUESTIONS = ["What is a KV block?", "Why batch requests?", "What does the sampler do?",
             "Define TTFT.", "What is preemption?", "Why stream text?", "What is a token?",
             "How big is a block?"]


def exact_tokens(tok: EngineTokenizer, text: str, n: int) -> str:
    ids = tok.encode(text * (1 + n // 50), add_special_tokens=False)[:n]
    return tok.decode(ids)


def load_stats(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Closed loop over ``prompts``; mean and median client TTFT and output throughput."""
    specs = [RequestSpec(0.0, 1, max_tokens) for _ in prompts]
    timings, elapsed = run_load(url, specs, prompts, concurrency, progress=False)
    ttfts = [t.ttft_s for t in timings if t.ttft_s is not None]
    return {"mean_ttft_s": statistics.mean(ttfts), "p50_ttft_s": statistics.median(ttfts),
            "output_tok_s": sum(t.output_tokens for t in timings) / elapsed,
            "elapsed_s": elapsed}


def serve_and_run(engine: Path, caching: bool, prompts: list[str], concurrency: int,
                  max_tokens: int) -> dict:
    cfg = ServerConfig.on_free_ports(engine, {"enable_prefix_caching": caching,
                                              "max_model_len": 2048})
    with TritonServer(cfg, log_path=Path("/tmp/kvflow-prefix-bench.log")) as server:
        with StreamingClient(server.grpc_url) as warm:  # warm-up, not cached content
            list(warm.generate("Hello", {"max_tokens": 2}))
        return load_stats(server.grpc_url, prompts, concurrency, max_tokens)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/bench/onnxruntime")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default="reports/prefix_caching.md")
    args = p.parse_args()
    engine = Path(args.engine)
    tok = EngineTokenizer(engine)
    system = exact_tokens(tok, PARAGRAPH, args.prefix_tokens)
    shared = [f"{system}\nQuestion {i}: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:"
              for i in range(args.requests)]
    distinct = [f"Request {i}. " + exact_tokens(tok, PARAGRAPH[i % 97:] + PARAGRAPH, 200)
                for i in range(args.requests)]
    rows = []
    for name, prompts in (("shared 1,000-token prefix", shared), ("no shared prefix", distinct)):
        for caching in (True, False):
            print(f"[prefix bench] {name}, caching {'on' if caching else 'off'} ...", flush=True)
            r = serve_and_run(engine, caching, prompts, args.concurrency, args.max_tokens)
            rows.append((name, caching, r))
    lines = [f"# Prefix caching through the server ({args.requests} requests, "
             f"{args.concurrency} concurrent streams, {args.max_tokens} output tokens each)", "",
             "| workload | caching | mean TTFT s | p50 TTFT s | output tok/s |",
             "|---|---|---|---|---|"]
    for name, caching, r in rows:
        lines.append(f"| {name} | {'on' if caching else 'off'} | {r['mean_ttft_s']:.3f} | "
                     f"{r['p50_ttft_s']:.3f} | {r['output_tok_s']:.1f} |")
    a_on, a_off, b_on, b_off = (r for _, _, r in rows)
    speedup = a_on["output_tok_s"] / a_off["output_tok_s"]
    lines += ["", f"Shared prefix: mean TTFT {a_off['mean_ttft_s'] / a_on['mean_ttft_s']:.1f}x "
              f"lower with caching; throughput x{speedup:.2f}.",
              f"No shared prefix: caching costs "
              f"{(1 - b_on['output_tok_s'] / b_off['output_tok_s']) * 100:+.1f}% throughput "
              "(negative: faster; within run-to-run noise).", "",
              "Reproduce: `python benchmarks/prefix_caching.py --engine ENGINE`."]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
