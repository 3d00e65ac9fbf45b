"""The KV tiers (issue 47): a multi-turn chat whose working set is ~10x the KV pool, tiers off
and on, and a returning 3,968-token prefix across a restart, cold against restored.

Part 1, multi-turn chat (:mod:`kvflow.bench.kv_tiers_sessions`): sessions on the Azure
conversation trace's lengths, each turn re-sending the whole conversation, served round-robin
by a few closed-loop users on an in-process engine with a deliberately small pool
(``--num-kv-blocks``). Once per configuration of ``--configs``: ``off`` (the pool alone),
``host`` (``kv_offload_bytes``), ``disk`` (``kv_disk_dir`` in a fresh folder under
``OUT/work``). Reports the prefix hit rate (all, and per tier), TTFT p50/p99, output throughput
and peak RSS.

Part 2, restart: a first process computes a long prefix and shuts down, writing its blocks to
the disk tier; then each round a fresh process serves the prefix plus a question, cold (no
tiers) and restored (the same disk folder). Reports each TTFT, the ratio (target: restored <=
0.2x cold) and each process's peak RSS.

Every engine runs in its own process (this script with ``--child``), so that a peak RSS is that
configuration's alone. ``OUT/work`` is deleted at the end.

    python benchmarks/kv_tiers.py --engine engines/smollm2-135m

Writes OUT (default reports/kv_tiers)/{report.json,report.md,ttft.png}.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvflow import LLM, SamplingParams
from kvflow.bench.kv_tiers_report import restart_ratio, write_kv_tiers_report
from kvflow.bench.kv_tiers_sessions import (
    ChatSession,
    ChatWorkload,
    make_chat_workload,
    serve_chat,
    summarize,
)
from kvflow.bench.machine import PeakRss, cpu_isa
from kvflow.build.engine_config import EngineConfig
from kvflow.orchestrator.llm import plan_engine
from kvflow.text.tokenizer import EngineTokenizer
from kvflow.workloads.azure import default_trace, load_azure_trace
from kvflow.workloads.data import shared_data_file

PARAGRAPH = (
    "The archive keeps every contract the company signed since its founding, with the names "
    "of both parties, the dates, the amounts and the clauses that were negotiated. Analysts "
    "read it to answer questions about obligations, renewals and penalties. "
)
QUESTIONS = ["Which contracts renew next year?", "Who signed the largest contract?",
             "What penalties apply to late delivery?", "List the parties of the first one."]
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)
MAX_MODEL_LEN = 4096
BUSY_NOTE = ("The machine was shared: other jobs ran on its cores during the run (load average "
             "in report.json), so absolute times are inflated and noisy; compare the "
             "configurations with each other, all measured in this one run.")


# --- children: one engine each ---------------------------------------------------------------

def child_sessions(job: dict[str, Any]) -> dict[str, Any]:
    """Serve the chat workload once under ``job['options']``; the run's figures."""
    w = json.loads(Path(job["workload"]).read_text())
    workload = ChatWorkload(w["system"], [ChatSession(s["messages"], s["reply_tokens"])
                                          for s in w["sessions"]])
    load_start = os.getloadavg()[0]
    with LLM(job["engine"], **job["options"]) as llm:
        llm.generate([[1, 2, 3, 4]], ONE_TOKEN)  # the first step's one-time costs, not timed
        results = serve_chat(llm.engine, workload, job["concurrency"])
        kv = llm.engine.kv
        state = kv.tiers.state() if kv.tiers is not None else []
        summary = summarize(results, state, kv.block_size)
    summary["tier_state"] = state
    summary["turns_detail"] = [[r.session, r.turn, r.prompt_tokens, r.cached_tokens,
                                r.output_tokens, r.ttft_s] for r in results]
    summary["loadavg_1m"] = [load_start, os.getloadavg()[0]]
    return summary


def child_restart(job: dict[str, Any]) -> dict[str, Any]:
    """One restart-part process: ``first`` fills the disk tier; ``cold`` / ``restored`` time
    the prompt alone after a warm-up."""
    prompt = job["prompt"]
    with LLM(job["engine"], max_model_len=MAX_MODEL_LEN, **job["options"]) as llm:
        if job["role"] == "first":
            llm.generate([prompt], ONE_TOKEN)
            return {}
        llm.generate([[1, 2, 3, 4]], ONE_TOKEN)
        t0 = time.perf_counter()
        (out,) = llm.generate([prompt], ONE_TOKEN)
    ttft_s = out.metrics.ttft_s if out.metrics.ttft_s is not None else time.perf_counter() - t0
    return {"ttft_s": ttft_s, "cached_tokens": out.cached_tokens}


def run_child(work: Path, name: str, job: dict[str, Any]) -> dict[str, Any]:
    """Run ``job`` in a fresh process of this script; its result with its peak RSS."""
    spec, result = work / f"{name}.job.json", work / f"{name}.result.json"
    spec.write_text(json.dumps({**job, "result": str(result)}))
    print(f"[kv tiers] {name} ...", flush=True)
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(spec)])
    with PeakRss(proc.pid) as rss:
        rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"the {name} process exited with {rc}")
    out = json.loads(result.read_text())
    out["peak_rss_bytes"] = rss.peak_bytes
    return out


# --- the parent ------------------------------------------------------------------------------

def build_workload(args: argparse.Namespace, tok: EngineTokenizer, pool_tokens: int,
                   path: Path) -> ChatWorkload:
    text = shared_data_file("tinyshakespeare.txt").read_text()[:600_000]
    corpus = tok.encode(text, add_special_tokens=False)
    lengths, _ = load_azure_trace(default_trace())
    workload = make_chat_workload(corpus, lengths, round(args.working_set_ratio * pool_tokens),
                                  args.turns, args.system_tokens, args.length_scale,
                                  args.max_message_tokens, args.max_reply_tokens, args.seed)
    path.write_text(json.dumps({"system": workload.system, "sessions": [
        {"messages": s.messages, "reply_tokens": s.reply_tokens} for s in workload.sessions]}))
    return workload


def run_sessions(args: argparse.Namespace, tok: EngineTokenizer, block_size: int,
                 work: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    pool_tokens = args.num_kv_blocks * block_size
    workload = build_workload(args, tok, pool_tokens, work / "workload.json")
    tier_options = {"off": {}, "host": {"kv_offload_bytes": args.kv_offload_bytes},
                    "disk": {"kv_disk_dir": "a fresh folder under OUT/work",
                             "kv_disk_bytes": args.kv_disk_bytes}}
    config = {"sessions": len(workload.sessions), "turns": args.turns,
              "system_tokens": args.system_tokens, "length_scale": args.length_scale,
              "max_message_tokens": args.max_message_tokens,
              "max_reply_tokens": args.max_reply_tokens, "num_kv_blocks": args.num_kv_blocks,
              "pool_tokens": pool_tokens, "working_set_tokens": workload.working_set_tokens(),
              "max_prompt_tokens": workload.max_prompt_tokens(),
              "concurrency": args.concurrency, "seed": args.seed,
              "tier_options": {c: tier_options[c] for c in args.configs}}
    print(f"[kv tiers] {len(workload.sessions)} sessions, working set "
          f"{config['working_set_tokens']:,} tokens, pool {pool_tokens:,} tokens", flush=True)
    runs = {}
    for name in args.configs:
        options = {"num_kv_blocks": args.num_kv_blocks, "max_model_len": MAX_MODEL_LEN,
                   **tier_options[name]}
        if name == "disk":
            options["kv_disk_dir"] = str(work / "disk-sessions")
        runs[name] = run_child(work, f"sessions-{name}",
                               {"job": "sessions", "engine": args.engine, "options": options,
                                "workload": str(work / "workload.json"),
                                "concurrency": args.concurrency})
        shutil.rmtree(work / "disk-sessions", ignore_errors=True)
    return config, runs


def run_restart(args: argparse.Namespace, tok: EngineTokenizer, work: Path) -> dict[str, Any]:
    ids = tok.encode(PARAGRAPH * (1 + args.prefix_tokens // 30), add_special_tokens=False)
    prefix = ids[:args.prefix_tokens]
    if len(prefix) != args.prefix_tokens:
        raise ValueError(f"--prefix-tokens: the paragraph gives only {len(prefix)} tokens")
    questions = [tok.encode(f"\nQuestion: {q}\nAnswer:", add_special_tokens=False)
                 for q in QUESTIONS]
    tiers = {"kv_disk_dir": str(work / "disk-restart"), "kv_disk_bytes": args.kv_disk_bytes}
    common = {"job": "restart", "engine": args.engine}
    run_child(work, "restart-first", {**common, "role": "first", "options": tiers,
                                      "prompt": prefix + questions[0]})
    rounds = []
    for r in range(args.rounds):
        prompt = prefix + questions[1 + r % (len(questions) - 1)]
        row: dict[str, Any] = {"prompt_tokens": len(prompt)}
        for role, options in (("cold", {}), ("restored", tiers)):
            row[role] = run_child(work, f"restart-{r}-{role}",
                                  {**common, "role": role, "options": options,
                                   "prompt": prompt})
        rounds.append(row)
    return {"prefix_tokens": args.prefix_tokens, "rounds": rounds}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/smollm2-135m")
    p.add_argument("--out", default="reports/kv_tiers")
    p.add_argument("--parts", default="sessions,restart",
                   help="which parts to run: sessions, restart, or both")
    g = p.add_argument_group("multi-turn chat")
    g.add_argument("--configs", default="off,host,disk",
                   help="tier configurations, in order: off, host, disk")
    g.add_argument("--num-kv-blocks", type=int, default=256, help="the KV pool, in blocks")
    g.add_argument("--working-set-ratio", type=float, default=10.0,
                   help="sessions are added until their working set is this many pools")
    g.add_argument("--turns", type=int, default=4)
    g.add_argument("--system-tokens", type=int, default=128)
    g.add_argument("--length-scale", type=float, default=0.25,
                   help="the Azure trace's message and reply lengths times this")
    g.add_argument("--max-message-tokens", type=int, default=512)
    g.add_argument("--max-reply-tokens", type=int, default=64)
    g.add_argument("--concurrency", type=int, default=2, help="closed-loop users")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--kv-offload-bytes", type=int, default=1 << 30, help="the host tier")
    g.add_argument("--kv-disk-bytes", type=int, default=1 << 30, help="the disk tier")
    g = p.add_argument_group("restart")
    g.add_argument("--prefix-tokens", type=int, default=3968)
    g.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    args.configs = [x for x in args.configs.split(",") if x]
    for name, values, known in (("--parts", args.parts, ("sessions", "restart")),
                                ("--configs", args.configs, ("off", "host", "disk"))):
        if not values or set(values) - set(known):
            p.error(f"{name} takes a comma-separated list of {', '.join(known)}; "
                    f"got {','.join(values) or 'nothing'}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        job = json.loads(Path(args.child).read_text())
        child = child_sessions if job["job"] == "sessions" else child_restart
        Path(job["result"]).write_text(json.dumps(child(job)))
        return 0
    engine = EngineConfig.load(args.engine)
    tok = EngineTokenizer(args.engine)
    out = Path(args.out)
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    report: dict[str, Any] = {
        "machine": cpu_isa(), "busy_note": BUSY_NOTE, "loadavg_start": os.getloadavg(),
        "command": ("python benchmarks/kv_tiers.py " + shlex.join(
            sys.argv[1:] if argv is None else argv)).strip(),
        "config": {"engine": Path(args.engine).name, "kv_cache_dtype": plan_engine(
            args.engine, num_kv_blocks=args.num_kv_blocks).kv_cache_dtype}}
    try:
        if "sessions" in args.parts:
            config, runs = run_sessions(args, tok, engine.limits.block_size, work)
            report["config"].update(config)
            report["sessions"] = runs
        if "restart" in args.parts:
            report["restart"] = run_restart(args, tok, work)
            print(f"[kv tiers] restored / cold: {restart_ratio(report['restart']['rounds']):.3f}",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["loadavg_end"] = os.getloadavg()
    write_kv_tiers_report(out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
