"""kvflow against its peers on one model, SmolLM2-135M-Instruct, in one run.

    python benchmarks/peers.py --engine q4=engines/smollm2-135m \\
        --engine q4-int8=engines/smollm2-135m,quantized_matmul=int8

Every system runs the same weights (the shipped Q4_1 GGUF, or its F32 dequantization) on
``--threads`` CPU threads:

* kvflow ``LLM.generate`` on each ``--engine NAME=DIR[,KEY=VALUE...]`` (prefix caching off;
  the KEY=VALUE engine options are that engine's own, on top of ``--kvflow-option``'s);
* HF transformers ``generate`` in fp32 on the GGUF (left-padded batch, greedy);
* llama.cpp ``llama-batched-bench`` on the Q4_1 and the F32 GGUF;

each on B prompts of ``--input-tokens`` tokens, ``--output-tokens`` greedy tokens each (EOS
ignored), B in ``--batches``. kvflow and HF run in worker processes of their own (one per
system, alive for the whole run, warmed up on each batch shape before it is timed). Each figure
is the end-to-end wall time, best of ``--rounds``; the rounds alternate over the systems so
that drift in the machine's speed falls on all alike. Then a served comparison: ``kvflow
serve`` (tritonserver + the OpenAI frontend) on each engine against ``llama-server -np
CONCURRENCY`` on both GGUFs, driven by kvflow's own load generator through the same HTTP
client (``/v1/completions``, SSE), at ``--served-concurrency``, alternating rounds. Every
server is stopped on exit, on Ctrl-C and on SIGTERM.

llama.cpp is built once (about 10 minutes on 2 cores) under ``--llamacpp-dir`` and reused; the
F32 GGUF is made from the Q4_1 file without any download. Its tools run with
``--no-repack`` (:data:`kvflow.bench.peers.NO_REPACK`). Writes ``report.json``, ``summary.md``
(with a table of issue 32's targets: each ratio, its bound, met or not), ``peers_tok_s.png``
and ``served_latency.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.bench.peers import (
    LlamaCppBuild,
    LlamaServer,
    LlamaServerClient,
    Target,
    batched_bench,
    ensure_build,
    ensure_f32_gguf,
    parse_engine_options,
    parse_engine_specs,
    targets_table,
)
from kvflow.reports.writers import memory_bandwidth_gb_s, pyplot, save_figure, write_report

HF_NAME = "hf-fp32"
WARMUP_TOKENS = 2


# --- the worker processes: one system each, driven over stdin/stdout ---------------------------

def _kvflow_generate(engine_dir: str, options: dict[str, Any]) -> Any:
    from kvflow.orchestrator.llm import LLM
    from kvflow.orchestrator.sampling.params import SamplingParams

    llm = LLM(engine_dir, **{"enable_prefix_caching": False, **options})

    def generate(prompts: list[list[int]], n: int) -> dict[str, Any]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params)
        bad = [o.num_output_tokens for o in outs if o.num_output_tokens != n or o.error]
        if bad:
            raise RuntimeError(f"kvflow generated {bad[:4]} tokens, not {n}")
        first = outs[0].metrics
        decode_s = (first.last_token_time or 0.0) - (first.first_token_time or 0.0)
        return {"first_output": outs[0].token_ids,
                "decode_tok_s": (n - 1) / decode_s if len(outs) == 1 and decode_s > 0 else None}

    return generate


def _hf_generate(gguf: str, threads: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    path = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id
    pad = model.config.eos_token_id if pad is None else pad

    def generate(prompts: list[list[int]], n: int) -> dict[str, Any]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=pad)
        if out.shape[1] != width + n:
            raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, not {n}")
        return {"first_output": out[0, width:].tolist(), "decode_tok_s": None}

    return generate


def worker_main(kind: str, target: str, threads: int, options: dict[str, Any]) -> int:
    """Load one system, say READY, then for each job line (JSON: prompts, output_tokens) warm
    up on the same batch and answer one ``RESULT {json}`` line with the timed run."""
    generate = (_kvflow_generate(target, options) if kind == "kvflow"
                else _hf_generate(target, threads))
    print("READY", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        generate(job["prompts"], WARMUP_TOKENS)
        t0 = time.perf_counter()
        result = generate(job["prompts"], job["output_tokens"])
        result["e2e_s"] = time.perf_counter() - t0
        print("RESULT " + json.dumps(result), flush=True)
    return 0


class Worker:
    """The parent's handle on a worker process (stdin: jobs, stdout: READY / RESULT lines;
    anything else it prints is passed on to stderr)."""

    def __init__(self, name: str, kind: str, target: str, threads: int,
                 options: dict[str, Any]) -> None:
        self.name = name
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, __file__, "--worker", kind, "--worker-target", target,
               "--threads", str(threads), "--worker-options", json.dumps(options)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        try:
            self._read("READY")
        except BaseException:
            self.close(at_once=True)
            raise

    def _read(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
            print(f"[{self.name}] {line}", end="", file=sys.stderr)
        raise RuntimeError(f"worker {self.name} exited with {self.proc.wait()}")

    def run(self, prompts: list[list[int]], output_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts,
                                          "output_tokens": output_tokens}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._read("RESULT "))

    def close(self, at_once: bool = False) -> None:
        """End of input, then wait; ``at_once`` (an error, Ctrl-C, SIGTERM): kill."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(0 if at_once else 30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(at_once=exc_type is not None)


# --- measurements ------------------------------------------------------------------------------

def make_offline_prompts(engine_dir: str, n: int, num_tokens: int) -> list[list[int]]:
    """``n`` real-text prompts of exactly ``num_tokens`` token ids (as ``kvflow bench serve``
    makes them)."""
    from kvflow.text.tokenizer import EngineTokenizer
    from kvflow.workloads.prompts import make_prompt_ids

    tok = EngineTokenizer(engine_dir)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    return [make_prompt_ids(encode, num_tokens, i) for i in range(n)]


def run_offline(args: argparse.Namespace, engines: dict[str, str], build: LlamaCppBuild | None,
                ggufs: dict[str, Path], out: Path) -> dict[str, Any]:
    """Every offline system at every batch size, ``--rounds`` alternating rounds."""
    prompts = make_offline_prompts(next(iter(engines.values())), max(args.batches),
                                   args.input_tokens)
    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        workers: list[Worker] = []
        if not args.skip_kvflow:
            for name, engine_dir in engines.items():
                print(f"[peers] loading kvflow engine {name} ({engine_dir})", flush=True)
                workers.append(stack.enter_context(Worker(
                    f"kvflow-{name}", "kvflow", engine_dir, args.threads,
                    {**args.kvflow_options, **args.engine_options[name]})))
        if not args.skip_hf:
            print("[peers] loading HF transformers (fp32, from the GGUF)", flush=True)
            workers.append(stack.enter_context(Worker(HF_NAME, "hf", args.gguf, args.threads,
                                                      {})))
        for r in range(args.rounds):
            for w in workers:
                for b in args.batches:
                    res = w.run(prompts[:b], args.output_tokens)
                    entry = results.setdefault(w.name, {}).setdefault(str(b), {"e2e_s": []})
                    entry["e2e_s"].append(res["e2e_s"])
                    entry["first_output"] = res["first_output"]
                    if res["decode_tok_s"] is not None:
                        entry.setdefault("decode_tok_s", []).append(res["decode_tok_s"])
                    print(f"round {r} {w.name:18s} B={b:3d} {res['e2e_s']:7.2f} s "
                          f"{b * args.output_tokens / res['e2e_s']:8.1f} tok/s", flush=True)
            if build is not None:
                for label, gguf in ggufs.items():
                    name = f"llama.cpp-{label}"
                    rows = batched_bench(build, gguf, args.input_tokens, args.output_tokens,
                                         args.batches, args.threads,
                                         out / f"batched_bench_{label}_r{r}.log")
                    for row in rows:
                        entry = results.setdefault(name, {}).setdefault(
                            str(row["batch"]), {"e2e_s": [], "rows": []})
                        entry["e2e_s"].append(row["t_s"])
                        entry["rows"].append(row)
                        print(f"round {r} {name:18s} B={row['batch']:3d} {row['t_s']:7.2f} s "
                              f"{row['batch'] * args.output_tokens / row['t_s']:8.1f} tok/s  "
                              f"(S_TG {row['s_tg_tok_s']:.1f})", flush=True)
    for per_b in results.values():
        for b, entry in per_b.items():
            entry["best_e2e_s"] = min(entry["e2e_s"])
            entry["output_tok_s"] = int(b) * args.output_tokens / entry["best_e2e_s"]
            if "rows" in entry:
                entry["decode_tok_s"] = [row["s_tg_tok_s"] for row in entry["rows"]]
    return results


def run_served(args: argparse.Namespace, engines: dict[str, str], build: LlamaCppBuild | None,
               ggufs: dict[str, Path], out: Path) -> dict[str, Any]:
    """kvflow serve against llama-server on one closed-loop load, alternating rounds."""
    from kvflow.loadgen.clients import OpenAIClient
    from kvflow.loadgen.sender import run_load
    from kvflow.openai_api import FrontendConfig, FrontendProcess
    from kvflow.reports.summary import summarize
    from kvflow.triton_backend.launcher import ServerConfig, TritonServer
    from kvflow.utils.procs import free_port
    from kvflow.workloads.prompts import make_prompts
    from kvflow.workloads.synthetic import random_workload

    n, conc = args.served_requests, args.served_concurrency
    specs = random_workload(n, args.input_tokens, args.output_tokens, float("inf"), 1.0, 0)
    texts = make_prompts(specs, next(iter(engines.values())), 0)
    ctx_per_slot = -(-(args.input_tokens + args.output_tokens + 64) // 256) * 256
    runs: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        clients = []
        if not args.skip_kvflow:
            for name, engine_dir in engines.items():
                print(f"[peers] starting kvflow serve on {name} ({engine_dir})", flush=True)
                cfg = ServerConfig.on_free_ports(engine_dir, {"enable_prefix_caching": False,
                                                              **args.kvflow_options,
                                                              **args.engine_options[name]})
                server = stack.enter_context(
                    TritonServer(cfg, log_path=out / f"tritonserver_{name}.log"))
                frontend = stack.enter_context(FrontendProcess(
                    FrontendConfig((server.grpc_url,), port=free_port()),
                    log_path=out / f"frontend_{name}.log"))
                client = OpenAIClient(frontend.url)
                client.name = f"kvflow-{name}"
                clients.append(client)
        if build is not None:
            for label, gguf in ggufs.items():
                print(f"[peers] starting llama-server on {gguf.name}", flush=True)
                llama_server = stack.enter_context(LlamaServer(
                    build, gguf, conc, ctx_per_slot, args.threads,
                    log_path=out / f"llama_server_{label}.log"))
                client = LlamaServerClient(llama_server.url)
                client.name = f"llama-server-{label}"
                clients.append(client)
        for client in clients:  # warm-up: first requests, connections
            run_load(client, specs[:conc], texts[:conc], conc, progress=False)
        for r in range(args.rounds):
            for client in clients:
                timings, duration = run_load(client, specs, texts, conc, progress=False)
                s = summarize(timings, duration)
                if s["failed"]:
                    raise RuntimeError(f"{client.name}: {s['failed']} of {n} requests failed")
                ok = [t for t in timings if t.ok]
                runs.setdefault(client.name, []).append({
                    "round": r, "summary": s,
                    "ttft_ms": [t.ttft_s * 1e3 for t in ok if t.ttft_s is not None],
                    "itl_ms": [g * 1e3 for t in ok for g in t.itls_s],
                    "mean_prompt_tokens": float(np.mean([t.prompt_tokens for t in ok]))})
                print(f"round {r} {client.name:24s} {s['output_token_throughput']:7.1f} tok/s  "
                      f"mean TTFT {s['ttft_ms']['mean']:7.1f} ms  mean ITL "
                      f"{s['itl_ms']['mean']:6.1f} ms", flush=True)
    return {name: max(rs, key=lambda run: run["summary"]["output_token_throughput"]) | {
        "rounds_tok_s": [run["summary"]["output_token_throughput"] for run in rs]}
        for name, rs in runs.items()}


# --- the report --------------------------------------------------------------------------------

def plot_offline(offline: dict[str, Any], batches: list[int], out: Path) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, per_b in offline.items():
        bs = [b for b in batches if str(b) in per_b]
        ax.plot(bs, [per_b[str(b)]["output_tok_s"] for b in bs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch (prompts at once)")
    ax.set_ylabel("output tok/s (end to end)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Offline generation, best of the rounds")
    return save_figure(fig, out / "peers_tok_s.png")


def plot_served(served: dict[str, Any], out: Path) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    names = list(served)
    for ax, key, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "itl_ms", "ITL (ms)")):
        ax.boxplot([served[n][key] for n in names], showfliers=False, showmeans=True)
        ax.set_xticks(range(1, len(names) + 1), names, rotation=20, fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Served: latency distributions of the best round (whiskers 1.5 IQR, "
                 "triangle: mean)")
    return save_figure(fig, out / "served_latency.png")


def _ratio_lines(values: dict[str, dict[str, float]], columns: list[str],
                 labels: list[str]) -> list[str]:
    """A table of kvflow tok/s over llama.cpp tok/s, one row per (kvflow, llama.cpp) pair."""
    kv = [n for n in values if n.startswith("kvflow-")]
    lc = [n for n in values if n.startswith("llama")]
    if not kv or not lc:
        return []
    lines = ["| kvflow | / llama.cpp | " + " | ".join(labels) + " |",
             "|---|---|" + "---|" * len(columns)]
    for a in kv:
        for b in lc:
            cells = [f"{values[a][c] / values[b][c]:.2f}" if c in values[a] and c in values[b]
                     else "-" for c in columns]
            lines.append(f"| {a} | {b} | " + " | ".join(cells) + " |")
    return lines


def greedy_agreement(offline: dict[str, Any], batch: str) -> str:
    """How many leading greedy tokens of prompt 0 each system shares with HF transformers."""
    ref = offline.get(HF_NAME, {}).get(batch, {}).get("first_output")
    if not ref:
        return ""
    parts = []
    for name, per_b in offline.items():
        got = per_b.get(batch, {}).get("first_output")
        if name != HF_NAME and got:
            same = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b),
                        min(len(got), len(ref)))
            parts.append(f"{name} {same}/{len(ref)}")
    return ", ".join(parts)


def targets(report: dict[str, Any]) -> list[Target]:
    """Issue 32's targets that this run measured, one row per kvflow engine: single-stream
    decode and end to end at B=1 against llama.cpp Q4_1, end to end at the largest batch
    against HF fp32, served throughput and mean ITL against llama-server Q4_1 and F32."""
    cfg, offline, served = report["config"], report["offline"], report["served"]
    io = f"{cfg['input_tokens']}/{cfg['output_tokens']} tokens"
    b_max = str(max(cfg["batches"]))
    conc = cfg["served_concurrency"]
    rows: list[Target] = []
    for name in [n for n in offline if n.startswith("kvflow-")]:
        mine, q4 = offline[name], offline.get("llama.cpp-q4_1", {})
        if "1" in mine and "1" in q4:
            if mine["1"].get("decode_tok_s") and q4["1"].get("decode_tok_s"):
                rows.append(Target(f"{name}: single-stream decode tok/s / llama.cpp Q4_1 "
                                   "S_TG (B=1)", max(mine["1"]["decode_tok_s"])
                                   / max(q4["1"]["decode_tok_s"]), 1.0))
            rows.append(Target(f"{name}: end to end B=1, {io}, tok/s / llama.cpp Q4_1",
                               mine["1"]["output_tok_s"] / q4["1"]["output_tok_s"], 1.2))
        hf = offline.get(HF_NAME, {})
        if b_max in mine and b_max in hf:
            rows.append(Target(f"{name}: end to end B={b_max}, {io}, tok/s / HF fp32",
                               mine[b_max]["output_tok_s"] / hf[b_max]["output_tok_s"], 2.0))
    for name in [n for n in served if n.startswith("kvflow-")]:
        s = served[name]["summary"]
        for label, bound in (("q4_1", 1.5), ("f32", 1.2)):
            peer = served.get(f"llama-server-{label}")
            if peer is None:
                continue
            p = peer["summary"]
            rows.append(Target(f"{name}: served c={conc}, output tok/s / llama-server "
                               f"{label.upper()}", s["output_token_throughput"]
                               / p["output_token_throughput"], bound))
            rows.append(Target(f"{name}: served c={conc}, mean ITL / llama-server "
                               f"{label.upper()}'s", s["itl_ms"]["mean"] / p["itl_ms"]["mean"],
                               1.0, at_most=True))
    return rows


def summary_lines(report: dict[str, Any], plots: list[str]) -> list[str]:
    cfg, offline, served = report["config"], report["offline"], report["served"]
    batches = [str(b) for b in cfg["batches"]]
    lines = [f"# kvflow and its peers: SmolLM2-135M-Instruct, {cfg['threads']} CPU threads",
             "", f"Machine: {report['machine']['cpu']} ({report['machine']['cpus']} CPUs); "
             f"memory bandwidth (numpy copy of 512 MB, read + write, one thread, best of 5): "
             f"**{report['memory_bandwidth_gb_s']:.1f} GB/s**.",
             f"llama.cpp: {report['llama_cpp'].get('version') or 'not run'}.", ""]
    goals = [Target(**{k: v for k, v in t.items() if k != "met"}) for t in report["targets"]]
    if goals:
        lines += ["## Targets (issue 32)", "", *targets_table(goals), "",
                  "Ratios are kvflow's over the peer's, from the best round of each. Issue 32 "
                  "sets the end-to-end HF target at B=32 and the served ones at c=8.", ""]
    if offline:
        lines += [f"## Offline: B prompts x {cfg['input_tokens']} tokens, {cfg['output_tokens']} "
                  f"greedy tokens each (EOS ignored), best of {cfg['rounds']} alternating rounds",
                  "", "End-to-end seconds:", "",
                  "| system | " + " | ".join(f"B={b}" for b in batches) + " |",
                  "|---|" + "---|" * len(batches)]
        for name, per_b in offline.items():
            lines.append(f"| {name} | " + " | ".join(
                f"{per_b[b]['best_e2e_s']:.2f}" if b in per_b else "-" for b in batches) + " |")
        lines += ["", "Output tok/s (B x output tokens / end-to-end seconds):", "",
                  "| system | " + " | ".join(f"B={b}" for b in batches) + " |",
                  "|---|" + "---|" * len(batches)]
        tok_s = {name: {b: e["output_tok_s"] for b, e in per_b.items()}
                 for name, per_b in offline.items()}
        for name, per_b in tok_s.items():
            lines.append(f"| {name} | " + " | ".join(
                f"{per_b[b]:.1f}" if b in per_b else "-" for b in batches) + " |")
        ratios = _ratio_lines(tok_s, batches, [f"B={b}" for b in batches])
        if ratios:
            lines += ["", "kvflow / llama.cpp, output tok/s:", "", *ratios]
        single = {name: max(per_b["1"]["decode_tok_s"]) for name, per_b in offline.items()
                  if "1" in per_b and per_b["1"].get("decode_tok_s")}
        if single:
            lines += ["", "Single-stream decode tok/s (B=1, after the first token; llama.cpp: "
                      "S_TG of llama-batched-bench): " + ", ".join(
                          f"{n} {v:.1f}" for n, v in single.items())]
        agreement = greedy_agreement(offline, batches[0])
        if agreement:
            lines += ["", f"Greedy tokens of prompt 0 (B={batches[0]}) equal to HF's, from the "
                      f"first: {agreement}."]
        lines += ["", "llama.cpp's figures are `llama-batched-bench`'s T (prefill of random "
                  "tokens + decode, no sampling, no tokenizer); kvflow's and HF's are "
                  "`generate` calls with greedy sampling and detokenization.", ""]
    if served:
        s0 = next(iter(served.values()))["summary"]
        lines += [f"## Served: {s0['completed']} requests, {cfg['input_tokens']}-token prompts, "
                  f"{cfg['output_tokens']} output tokens, concurrency "
                  f"{cfg['served_concurrency']}, best of {cfg['rounds']} alternating rounds", "",
                  "| system | output tok/s | TTFT mean / p50 / p90 (ms) | ITL mean / p50 / p90 "
                  "(ms) | prompt tokens seen |", "|---|---|---|---|---|"]
        for name, run in served.items():
            s = run["summary"]
            t, i = s["ttft_ms"], s["itl_ms"]
            lines.append(f"| {name} | {s['output_token_throughput']:.1f} | {t['mean']:.0f} / "
                         f"{t['median']:.0f} / {t['p90']:.0f} | {i['mean']:.1f} / "
                         f"{i['median']:.1f} / {i['p90']:.1f} | "
                         f"{run['mean_prompt_tokens']:.1f} |")
        ratios = _ratio_lines({n: {"tok/s": r["summary"]["output_token_throughput"]}
                               for n, r in served.items()}, ["tok/s"], ["tok/s"])
        if ratios:
            lines += ["", "kvflow / llama-server, output tok/s:", "", *ratios]
        lines += ["", "Both through one client (`kvflow.loadgen.sender.run_load`, "
                  "`/v1/completions`, SSE, greedy, `ignore_eos`). llama-server: `-np "
                  f"{cfg['served_concurrency']} --no-cache-prompt --cache-reuse 0 --cache-ram 0`"
                  " and `\"cache_prompt\": false` in every request; its token counts come from "
                  "`timings_per_token`. kvflow: prefix caching off.", ""]
    lines += [f"![]({p})" for p in plots]
    return lines


def on_sigterm(signum: int, _frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C: every ``with`` block stops its server or worker."""
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    from kvflow.model.loader import default_model_path

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", action="append", metavar="NAME=DIR",
                   help="a kvflow engine folder, optionally with engine options of its own: "
                   "NAME=DIR[,KEY=VALUE...] (repeatable; default q4=engines/smollm2-135m, "
                   "the default 4-bit engine)")
    p.add_argument("--kvflow-option", action="append", metavar="KEY=VALUE",
                   help="an engine option for kvflow, offline and served (repeatable)")
    p.add_argument("--gguf", default=str(default_model_path()), help="the Q4_1 GGUF")
    p.add_argument("--batches", default="1,8,32", help="offline batch sizes")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--served-requests", type=int, default=32)
    p.add_argument("--served-concurrency", type=int, default=8)
    p.add_argument("--llamacpp-dir", default="reports/peers/llama.cpp",
                   help="where llama.cpp is built once and reused")
    p.add_argument("--f32-gguf", default="reports/peers/SmolLM2-135M-Instruct.F32.gguf")
    p.add_argument("--skip-kvflow", action="store_true", help="no kvflow, offline or served")
    p.add_argument("--skip-hf", action="store_true", help="no HF transformers")
    p.add_argument("--skip-llamacpp", action="store_true",
                   help="no llama.cpp (neither batched-bench nor llama-server)")
    p.add_argument("--skip-offline", action="store_true", help="only the served comparison")
    p.add_argument("--skip-served", action="store_true", help="only the offline comparison")
    p.add_argument("--out", default="reports/peers")
    p.add_argument("--worker", choices=["kvflow", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--worker-target", help=argparse.SUPPRESS)
    p.add_argument("--worker-options", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker_main(args.worker, args.worker_target, args.threads,
                           json.loads(args.worker_options))

    signal.signal(signal.SIGTERM, on_sigterm)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.kvflow_options = parse_engine_options(args.kvflow_option, "--kvflow-option")
    engines, args.engine_options = parse_engine_specs(args.engine, "q4=engines/smollm2-135m")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    build, ggufs, version = None, {}, ""
    if not args.skip_llamacpp:
        build = ensure_build(args.llamacpp_dir, jobs=2)
        version = build.version()
        ggufs = {"q4_1": Path(args.gguf),
                 "f32": ensure_f32_gguf(build, args.gguf, args.f32_gguf)}
    bandwidth = memory_bandwidth_gb_s()
    print(f"[peers] memory bandwidth (numpy copy, read + write): {bandwidth:.1f} GB/s",
          flush=True)
    try:
        offline = {} if args.skip_offline else run_offline(args, engines, build, ggufs, out)
        served = {} if args.skip_served else run_served(args, engines, build, ggufs, out)
    except KeyboardInterrupt:
        print("[peers] interrupted: every server and worker was stopped", file=sys.stderr)
        return 130

    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    report = {"config": {k: v for k, v in vars(args).items() if not k.startswith("worker")}
              | {"engines": engines},
              "machine": {"cpu": cpu, "cpus": os.cpu_count()},
              "memory_bandwidth_gb_s": bandwidth,
              "llama_cpp": {"version": version, "bin": str(build.build_dir / "bin") if build
                            else None, "ggufs": {k: str(v) for k, v in ggufs.items()}},
              "offline": offline, "served": served}
    report["targets"] = [t.as_dict() for t in targets(report)]
    (out / "report.json").write_text(json.dumps(report, indent=1))
    plots = []
    if offline:
        plots.append(plot_offline(offline, args.batches, out))
    if served:
        plots.append(plot_served(served, out))
    write_report(out / "summary.md", summary_lines(report, plots))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
