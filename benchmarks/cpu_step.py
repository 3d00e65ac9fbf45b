"""The CPU engine against its roofline and against llama.cpp on long prompts.

    python benchmarks/cpu_step.py --engine q4=engines/smollm2-135m \\
        --engine q4-int8=engines/smollm2-135m,quantized_matmul=int8 --out reports/cpu_step

Two measurements, for each ``--engine NAME=DIR[,KEY=VALUE...]`` (the KEY=VALUE pairs are
engine options, as ``LLM(engine_dir, **options)`` takes them):

* **The decode step against its roofline.** For each batch size and context length of
  ``--cases``, a decode step (every sequence adds one token) is timed on the engine's runner,
  built as ``LLM`` builds it. The roofline is the bytes a step must read, the weights the MatMuls
  read (the quantized codes, scales and minima, or the fp32 weights where the runner multiplies
  by weights dequantized at load; the embedding table is a Gather of a few rows) plus the K/V of
  every context position of every layer (at the runner's KV dtype), over the machine's measured
  memory bandwidth (a NumPy copy of 512 MB, best of 5). Where the runner calls the host
  PagedAttention kernel between ORT sessions, the time in it is shown apart, and ``--attention
  numpy`` times the NumPy kernel in its place.
* **Prefill by prompt length.** The time to the first token of one prompt of N tokens (N in
  ``--prefill-lengths``), through ``LLM.generate`` with ``max_tokens=1``: chunked prefill at the
  engine's ``max_num_batched_tokens``, prefix caching off. Beside it, llama.cpp's prompt time
  for the same length on the same Q4_1 weights (``llama-batched-bench -npp N -ntg 1 -npl 1``,
  ``--no-repack``), in ``--rounds`` rounds that alternate kvflow and llama.cpp; best of the
  rounds.

Writes ``report.json``, ``summary.md`` (with a table of issue 32's targets: the prefill ratio
at the longest prompt, the decode step at batch 32 and context 768 against its roofline),
``cpu_step.png`` and ``prefill_by_length.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from kvflow.bench.peers import (
    Target,
    batched_bench,
    ensure_build,
    parse_engine_specs,
    targets_table,
)
from kvflow.build.engine_config import EngineConfig
from kvflow.plugins import paged_attention_host, paged_attention_native
from kvflow.reports.writers import memory_bandwidth_gb_s, pyplot, save_figure, write_report
from kvflow.runtime import ort_runner
from kvflow.runtime.base import StepInput

# The modules whose ``paged_attention_native`` a segmented ORT runner calls between sessions.
HOST_KERNEL_CALLERS = ("kvflow.runtime.ort_runner", "kvflow.runtime.ort_sessions")
HOST_KERNEL = "paged_attention_native"

DEFAULT_ENGINE = "q4=engines/smollm2-135m"
ROOFLINE_CASE = (32, 768)  # issue 32's decode step: batch 32, context 768, <= 2x its roofline
PREFILL_BOUND = 1.1  # issue 32: the longest prompt's time to first token / llama.cpp's, at most
ROOFLINE_BOUND = 2.0


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def matmul_weight_bytes(engine_dir: Path, dequantized: bool = False) -> int:
    """Bytes of the initializers the step's MatMuls read (not the embedding table);
    ``dequantized``: as ORT holds them in fp32 mode (codes folded into fp32 weights)."""
    graph = onnx.load(str(engine_dir / "model.onnx"), load_external_data=False).graph
    gathered = {n.input[0] for n in graph.node if n.op_type == "Gather"}
    read_by_matmul = {i for n in graph.node if n.op_type != "Gather" for i in n.input}
    total = 0
    for t in graph.initializer:
        if t.name in gathered and t.name not in read_by_matmul:
            continue
        size = int(np.prod(t.dims)) if t.dims else 1
        if dequantized and t.name.endswith((".scale", ".zero_point")):
            continue
        if dequantized and t.name.endswith(".q"):
            total += size * 4
            continue
        bits = {onnx.TensorProto.UINT4: 4, onnx.TensorProto.INT4: 4, onnx.TensorProto.INT8: 8,
                onnx.TensorProto.UINT8: 8, onnx.TensorProto.INT64: 64}.get(t.data_type, 32)
        total += size * bits // 8
    return total


def decode_step(batch: int, context: int, block_size: int) -> StepInput:
    """A decode step of ``batch`` sequences at ``context`` tokens each (blocks from 1 up)."""
    blocks = -(-context // block_size)
    tables = (1 + np.arange(batch * blocks, dtype=np.int32)).reshape(batch, blocks)
    pos = context - 1
    return StepInput(
        input_ids=np.full(batch, 100, np.int64), positions=np.full(batch, pos, np.int64),
        slot_mapping=(tables[:, pos // block_size].astype(np.int64) * block_size
                      + pos % block_size),
        block_tables=tables, seq_lens=np.full(batch, context, np.int32),
        query_start_loc=np.arange(batch + 1, dtype=np.int32),
        logits_indices=np.arange(batch, dtype=np.int64))


class _Timed:
    """Wraps the host attention function a segmented runner calls, to split the step's time."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def kv_bytes_fp32_per_block(engine: EngineConfig) -> int:
    """One fp32 KV block, every layer's K and V (runners that do not say their own)."""
    m = engine.model
    return 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * 4 * \
        engine.limits.block_size


def dequantized_weights(engine: EngineConfig, mode: str, tokens: int) -> bool:
    """Whether the runner multiplies a step of ``tokens`` tokens by fp32 weights dequantized at
    load (``quantized_matmul`` ``mode`` fp32, or auto above its threshold) rather than by the
    4-bit codes."""
    if engine.quantization is None:
        return True
    threshold = getattr(ort_runner, "AUTO_INT8_MAX_TOKENS", 16)
    return mode == "fp32" or (mode == "auto" and tokens > threshold)


def time_decode(engine_dir: Path, options: dict[str, Any], cases: list[tuple[int, int]],
                attention: str, repeats: int) -> tuple[list[dict[str, Any]], float, str]:
    """Each decode case on the runner ``LLM`` would build: best and median step, the time in
    the host attention kernel (None when the runner never calls it); the KV bytes per token of
    the runner's pool, and its ``quantized_matmul`` mode."""
    from kvflow.orchestrator.llm import create_engine, plan_engine

    engine = EngineConfig.load(engine_dir)
    bs = engine.limits.block_size
    need = max(b * -(-c // bs) for b, c in cases) + 1
    opts = {"enable_prefix_caching": False, **options, "num_kv_blocks": need}
    plan = plan_engine(engine_dir, **opts)
    mode = getattr(plan.scheduler, "quantized_matmul", "fp32")
    impl = (paged_attention_host.paged_attention_host if attention == "numpy"
            else paged_attention_native.paged_attention_native)
    timed = _Timed(impl)
    # NOTE: the benchmark's own probe on the segmented runner's host kernel (a one-session
    # runner runs attention inside ORT and never calls it: no split is shown then).
    callers = []
    for module_name in HOST_KERNEL_CALLERS:
        with contextlib.suppress(ImportError):
            module = importlib.import_module(module_name)
            if hasattr(module, HOST_KERNEL):
                callers.append((module, getattr(module, HOST_KERNEL)))
                setattr(module, HOST_KERNEL, timed)
    runner = create_engine(engine_dir, **opts).runner
    runner_attention = str(getattr(runner, "attention", "segmented"))
    kv_dtype = str(getattr(runner, "kv_cache_dtype", "fp32"))
    kv_per_token = getattr(runner, "kv_bytes_per_block", kv_bytes_fp32_per_block(engine)) / bs
    rows = []
    try:
        for batch, context in cases:
            step = decode_step(batch, context, bs)
            for _ in range(2):
                runner.execute_argmax(step)
            walls, attn = [], []
            timed.calls = 0
            for _ in range(repeats):
                timed.seconds = 0.0
                walls.append(_timed(lambda: runner.execute_argmax(step)))  # noqa: B023
                attn.append(timed.seconds)
            i = int(np.argmin(walls))
            rows.append({"batch": batch, "context": context, "kv_cache_dtype": kv_dtype,
                         "runner_attention": runner_attention,
                         "step_ms": walls[i] * 1e3,
                         "median_ms": statistics.median(walls) * 1e3,
                         "attention_ms": attn[i] * 1e3 if timed.calls else None})
    finally:
        runner.close()
        for module, original in callers:
            setattr(module, HOST_KERNEL, original)
    return rows, kv_per_token, mode


def run_decode(args: argparse.Namespace, engines: dict[str, str],
               engine_options: dict[str, dict[str, Any]], bandwidth: float) -> list[dict]:
    results = []
    for name, folder in engines.items():
        engine_dir = Path(folder)
        engine = EngineConfig.load(engine_dir)
        for attention in args.attention:
            label = f"{name} ({attention} attention)"
            print(f"[cpu_step] decode steps: {label}", flush=True)
            rows, kv_per_token, mode = time_decode(engine_dir, engine_options[name], args.cases,
                                             attention, args.repeats)
            if attention != "native" and all(r["attention_ms"] is None for r in rows):
                print(f"[cpu_step] {label}: the runner runs attention in its graph; no "
                      f"{attention} kernel to swap in, rows dropped", flush=True)
                continue
            for row in rows:
                dequantized = dequantized_weights(engine, mode, row["batch"])
                weights = matmul_weight_bytes(engine_dir, dequantized=dequantized)
                kv = kv_per_token * row["batch"] * row["context"]
                roofline_ms = (weights + kv) / (bandwidth * 1e9) * 1e3
                results.append({"engine": name, "options": engine_options[name],
                                "attention": attention, **row,
                                "matmul": "fp32" if dequantized else "4-bit",
                                "weight_mb": weights / 1e6, "kv_mb": kv / 1e6,
                                "roofline_ms": roofline_ms,
                                "vs_roofline": row["step_ms"] / roofline_ms})
    return results


def run_prefill(args: argparse.Namespace, engines: dict[str, str],
                engine_options: dict[str, dict[str, Any]], out: Path) -> dict[str, Any]:
    """Time to first token by prompt length, kvflow's engines and llama.cpp alternately."""
    from kvflow.orchestrator.llm import LLM
    from kvflow.orchestrator.sampling.params import SamplingParams
    from kvflow.text.tokenizer import EngineTokenizer
    from kvflow.workloads.prompts import make_prompt_ids

    lengths = args.prefill_lengths
    first_dir = next(iter(engines.values()))
    tok = EngineTokenizer(first_dir)
    prompts = {n: make_prompt_ids(lambda t: tok.encode(t, add_special_tokens=False), n, 0)
               for n in lengths}
    build = None if args.skip_llamacpp else ensure_build(args.llamacpp_dir, jobs=2)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    results: dict[str, dict[str, list[float]]] = {}
    llms = {}
    for name, folder in engines.items():
        bs = EngineConfig.load(folder).limits.block_size
        print(f"[cpu_step] loading {name} for the prefill curve", flush=True)
        llms[name] = LLM(folder, **{"enable_prefix_caching": False, **engine_options[name],
                                    "num_kv_blocks": -(-(max(lengths) + 1) // bs) + 2})
        llms[name].generate([prompts[min(lengths)]], params)  # warm-up
    try:
        for r in range(args.rounds):
            for name, llm in llms.items():
                for n in lengths:
                    t0 = time.perf_counter()
                    outs = llm.generate([prompts[n]], params)
                    wall = time.perf_counter() - t0
                    if outs[0].num_output_tokens != 1 or outs[0].error:
                        raise RuntimeError(f"kvflow-{name}: no first token for {n} tokens")
                    results.setdefault(f"kvflow-{name}", {}).setdefault(str(n), []).append(wall)
                    print(f"round {r} kvflow-{name:12s} {n:5d} tokens  TTFT {wall:7.2f} s",
                          flush=True)
            if build is not None:
                rows = batched_bench(build, args.gguf, lengths, 1, [1], args.threads,
                                     out / f"prefill_bench_r{r}.log")
                for row in rows:
                    results.setdefault("llama.cpp-q4_1", {}).setdefault(
                        str(row["pp"]), []).append(row["t_pp_s"])
                    print(f"round {r} llama.cpp-q4_1  {row['pp']:5d} tokens  PP "
                          f"{row['t_pp_s']:7.2f} s", flush=True)
    finally:
        for llm in llms.values():
            llm.engine.runner.close()
    return {"lengths": lengths, "version": build.version() if build else "",
            "seconds": results,
            "best_s": {sys: {n: min(v) for n, v in per_n.items()}
                       for sys, per_n in results.items()}}


def plot_decode(results: list[dict], cases: list[tuple[int, int]], out: Path) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"{b}x{c}" for b, c in cases]
    series = sorted({(r["engine"], r["attention"]) for r in results})
    width = 0.8 / (len(series) + 1)
    for k, key in enumerate(series):
        ys = [next((r["step_ms"] for r in results if (r["engine"], r["attention"]) == key
                    and (r["batch"], r["context"]) == case), np.nan) for case in cases]
        ax.bar(np.arange(len(cases)) + k * width, ys, width, label=" / ".join(key))
    last = series[-1]
    roof = [next((r["roofline_ms"] for r in results if (r["batch"], r["context"]) == case
                  and (r["engine"], r["attention"]) == last), np.nan) for case in cases]
    ax.bar(np.arange(len(cases)) + len(series) * width, roof, width, color="black",
           label=f"roofline ({last[0]})")
    ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2, labels)
    ax.set_xlabel("decode step: batch x context")
    ax.set_ylabel("ms per step (log)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("Decode step on the CPU, ONNX Runtime runner")
    return save_figure(fig, out / "cpu_step.png")


def plot_prefill(prefill: dict[str, Any], out: Path) -> str:
    plt = pyplot()
    best, lengths = prefill["best_s"], prefill["lengths"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for sys_name, per_n in best.items():
        ns = [n for n in lengths if str(n) in per_n]
        left.plot(ns, [per_n[str(n)] for n in ns], marker="o", label=sys_name)
    peer = best.get("llama.cpp-q4_1", {})
    for sys_name, per_n in best.items():
        ns = [n for n in lengths if str(n) in per_n and str(n) in peer]
        if sys_name.startswith("kvflow-") and ns:
            right.plot(ns, [per_n[str(n)] / peer[str(n)] for n in ns], marker="o",
                       label=sys_name)
    right.axhline(PREFILL_BOUND, color="black", linestyle="--", linewidth=1,
                  label=f"target {PREFILL_BOUND:g}")
    left.set_xlabel("prompt tokens")
    left.set_ylabel("time to first token (s)")
    left.set_title("Prefill by prompt length, best of the rounds")
    right.set_xlabel("prompt tokens")
    right.set_ylabel("kvflow / llama.cpp Q4_1")
    right.set_title("Ratio to llama.cpp (llama-batched-bench PP)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, out / "prefill_by_length.png")


def targets(decode: list[dict], prefill: dict[str, Any] | None) -> list[Target]:
    """Issue 32's CPU-step targets this run measured, one row per engine (and kernel)."""
    rows: list[Target] = []
    if prefill:
        peer = prefill["best_s"].get("llama.cpp-q4_1", {})
        n = str(max(prefill["lengths"]))
        for sys_name, per_n in prefill["best_s"].items():
            if sys_name.startswith("kvflow-") and n in per_n and n in peer:
                rows.append(Target(f"{sys_name}: a {n}-token prompt to its first token / "
                                   "llama.cpp Q4_1's (`-npp`)", per_n[n] / peer[n],
                                   PREFILL_BOUND, at_most=True))
    if decode:
        case = max({(r["batch"], r["context"]) for r in decode},
                   key=lambda c: (c == ROOFLINE_CASE, c[0] * c[1]))
        for r in decode:
            if (r["batch"], r["context"]) == case:
                kernel = ("" if r["attention_ms"] is None
                          else f", {r['attention']} host kernel")
                rows.append(Target(f"{r['engine']} ({r['runner_attention']} attention{kernel}): "
                                   f"decode step, batch {case[0]}, context {case[1]} / roofline",
                                   r["vs_roofline"], ROOFLINE_BOUND, at_most=True))
    return rows


def summary_lines(report: dict[str, Any], plots: list[str]) -> list[str]:
    bandwidth, decode, prefill = report["bandwidth_gbs"], report["results"], report["prefill"]
    lines = ["# The CPU engine: decode step vs roofline, prefill by prompt length", "",
             f"Memory bandwidth (NumPy copy of 512 MB, read + write, best of 5): "
             f"**{bandwidth:.1f} GB/s**. Engines: " + ", ".join(
                 f"`{n}` = {d}" + (f" ({report['engine_options'][n]})"
                                   if report["engine_options"][n] else "")
                 for n, d in report["engines"].items()) + ".", ""]
    goals = [Target(**{k: v for k, v in t.items() if k != "met"}) for t in report["targets"]]
    if goals:
        lines += ["## Targets (issue 32)", "", *targets_table(goals), ""]
    if prefill:
        best, lengths = prefill["best_s"], prefill["lengths"]
        names = list(best)
        peer = best.get("llama.cpp-q4_1", {})
        kv_names = [n for n in names if n.startswith("kvflow-")]
        lines += [f"## Prefill by prompt length: time to first token (s), best of "
                  f"{report['config']['rounds']} alternating rounds", "",
                  f"llama.cpp: {prefill['version'] or 'not run'}.", "",
                  "| prompt tokens | " + " | ".join(names) + "".join(
                      f" | {n} / llama.cpp" for n in kv_names if peer) + " |",
                  "|---|" + "---|" * (len(names) + (len(kv_names) if peer else 0))]
        for n in map(str, lengths):
            cells = [f"{best[s][n]:.2f}" if n in best[s] else "-" for s in names]
            if peer:
                cells += [f"{best[s][n] / peer[n]:.2f}" if n in best[s] and n in peer else "-"
                          for s in kv_names]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines += ["", "kvflow: `LLM.generate` of one prompt of N token ids, `max_tokens=1`, "
                  "chunked prefill at the engine's `max_num_batched_tokens`, prefix caching "
                  "off (wall time of the call). llama.cpp: `llama-batched-bench -npp N -ntg 1 "
                  "-npl 1 --no-repack`, its prompt time (T_PP).", ""]
    if decode:
        lines += [f"## Decode step vs roofline (best of {report['config']['repeats']})", "",
                  "| engine | matmul | runner attention | host kernel | KV | batch | context "
                  "| step ms (best) | median ms | attention ms | weights MB | KV MB | "
                  "roofline ms | step / roofline |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in decode:
            attn = "in graph" if r["attention_ms"] is None else f"{r['attention_ms']:.1f}"
            lines.append(f"| {r['engine']} | {r['matmul']} | {r['runner_attention']} | "
                         f"{r['attention'] if r['attention_ms'] is not None else '-'} | "
                         f"{r['kv_cache_dtype']} | {r['batch']} | "
                         f"{r['context']} | {r['step_ms']:.1f} | {r['median_ms']:.1f} | "
                         f"{attn} | {r['weight_mb']:.0f} | {r['kv_mb']:.0f} | "
                         f"{r['roofline_ms']:.1f} | {r['vs_roofline']:.2f} |")
        lines.append("")
    lines += [f"![]({p})" for p in plots]
    return lines


def main() -> int:
    from kvflow.model.loader import default_model_path

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", action="append", metavar="NAME=DIR[,KEY=VALUE...]",
                   help=f"an engine and its engine options (repeatable; default "
                   f"{DEFAULT_ENGINE})")
    p.add_argument("--cases", default="1x128,8x128,32x128,1x768,32x768",
                   help="BATCHxCONTEXT decode steps ('' for none)")
    p.add_argument("--attention", default="native",
                   help="host attention kernels to time, native and/or numpy (segmented "
                   "runner only)")
    p.add_argument("--repeats", type=int, default=10, help="decode steps timed per case")
    p.add_argument("--prefill-lengths", default="128,512,1024,2048,3968",
                   help="prompt lengths of the prefill curve ('' for none)")
    p.add_argument("--rounds", type=int, default=2, help="prefill curve: alternating rounds")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    p.add_argument("--gguf", default=str(default_model_path()), help="the Q4_1 GGUF")
    p.add_argument("--llamacpp-dir", default="reports/peers/llama.cpp",
                   help="where llama.cpp is built once and reused (shared with peers.py)")
    p.add_argument("--skip-llamacpp", action="store_true", help="the prefill curve alone")
    p.add_argument("--out", default="reports/cpu_step")
    args = p.parse_args()
    engines, engine_options = parse_engine_specs(args.engine, DEFAULT_ENGINE)
    args.cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",") if c]
    args.prefill_lengths = [int(n) for n in args.prefill_lengths.split(",") if n]
    args.attention = [a for a in args.attention.split(",") if a]
    if bad := [a for a in args.attention if a not in ("native", "numpy")]:
        raise SystemExit(f"--attention must be native and/or numpy, got {bad}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bandwidth = memory_bandwidth_gb_s()
    print(f"memory bandwidth (copy, read + write): {bandwidth:.1f} GB/s", flush=True)
    decode = run_decode(args, engines, engine_options, bandwidth) if args.cases else []
    prefill = (run_prefill(args, engines, engine_options, out) if args.prefill_lengths
               else None)
    report = {"config": {k: v for k, v in vars(args).items()}, "engines": engines,
              "engine_options": engine_options, "bandwidth_gbs": bandwidth,
              "results": decode, "prefill": prefill,
              "targets": [t.as_dict() for t in targets(decode, prefill)]}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    plots = []
    if prefill:
        plots.append(plot_prefill(prefill, out))
    if decode:
        plots.append(plot_decode(decode, args.cases, out))
    write_report(out / "summary.md", summary_lines(report, plots))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
