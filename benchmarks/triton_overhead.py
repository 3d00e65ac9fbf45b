"""Overhead of the Triton path: the same 64 greedy requests of 128 output tokens, offline through
``LLM.generate`` and through the server with 16 concurrent streaming gRPC clients.

    python benchmarks/triton_overhead.py --engine engines/bench/onnxruntime

Reports output-token throughput of: offline (all 64 submitted at once), offline with at most 16
running (the same concurrency the served run has), and served. Writes a markdown report.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvflow import LLM, SamplingParams
from kvflow.client import stream_generate
from kvflow.loadgen.sender import run_load
from kvflow.reports.writers import write_report
from kvflow.triton_backend.launcher import ServerConfig, TritonServer
from kvflow.workloads.specs import RequestSpec

TOPICS = ["rivers", "castles", "bicycles", "volcanoes", "owls", "libraries", "glaciers", "tea"]


def prompts(n: int) -> list[str]:
    return [f"Request {i}: write a few sentences about {TOPICS[i % len(TOPICS)]}."
            for i in range(n)]


def offline(engine: str, ps: list[str], out_tokens: int, **overrides) -> float:
    with LLM(engine, **overrides) as llm:
        params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(ps[:2], SamplingParams(max_tokens=2))  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(ps, params)
        elapsed = time.perf_counter() - t0
    assert all(len(o.token_ids) == out_tokens for o in outs)
    return len(ps) * out_tokens / elapsed


def served(engine: str, ps: list[str], out_tokens: int, concurrency: int,
           **overrides) -> float:
    cfg = ServerConfig.on_free_ports(engine, overrides)
    with TritonServer(cfg, log_path=Path("/tmp/kvflow-triton-overhead.log")) as server:
        list(stream_generate(server.grpc_url, ps[0], {"max_tokens": 2}))  # warm-up
        # Closed loop: everyone arrives at once, at most `concurrency` in flight.
        specs = [RequestSpec(0.0, 1, out_tokens) for _ in ps]
        timings, elapsed = run_load(server.grpc_url, specs, ps, concurrency, progress=False)
    assert [t.output_tokens for t in timings] == [out_tokens] * len(ps)
    return len(ps) * out_tokens / elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/bench/onnxruntime")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--out", default="reports/triton_overhead.md")
    args = p.parse_args()
    ps = prompts(args.requests)
    opts = {"max_model_len": 1024}
    print("[triton overhead] offline, all at once ...", flush=True)
    off_all = offline(args.engine, ps, args.output_tokens, **opts)
    print("[triton overhead] offline, at most 16 running ...", flush=True)
    off_16 = offline(args.engine, ps, args.output_tokens, max_num_seqs=args.concurrency, **opts)
    print("[triton overhead] served ...", flush=True)
    srv = served(args.engine, ps, args.output_tokens, args.concurrency, **opts)
    write_report(args.out, [
        f"# Triton path overhead: {args.requests} greedy requests x {args.output_tokens} "
        "output tokens", "",
        "| run | output tok/s | served / this |", "|---|---|---|",
        f"| offline `LLM.generate`, all {args.requests} submitted at once | {off_all:.1f} | "
        f"{srv / off_all:.2f} |",
        f"| offline `LLM.generate`, max_num_seqs={args.concurrency} | {off_16:.1f} | "
        f"{srv / off_16:.2f} |",
        f"| served, {args.concurrency} concurrent gRPC streaming clients | {srv:.1f} | 1.00 |",
        "", "Reproduce: `python benchmarks/triton_overhead.py --engine ENGINE`."])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
