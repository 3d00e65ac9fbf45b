"""The CPU decode step against its roofline: fp32 and 4-bit engines, compiled and NumPy attention.

    python benchmarks/cpu_step.py --engine fp32=engines/smollm2-135m-fp32 \\
        --engine q4=engines/smollm2-135m --out reports/cpu_step

For each engine, batch size and context length, a decode step (every sequence adds one token)
is timed on the ONNX Runtime runner, split into the time inside ORT's sessions, in the
PagedAttention kernel and the rest. The roofline is the bytes a step must read, the weights the
MatMuls read (the quantized codes, scales and minima; the embedding table is a Gather of a few
rows) plus the K/V of every context position of every layer, over the machine's measured
memory bandwidth (a NumPy copy of 512 MB, best of 5). The attention kernels alone (compiled vs
NumPy) are timed on the same shapes. Writes ``report.json``, ``summary.md`` and
``cpu_step.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnx

from kvflow.build.engine_config import EngineConfig
from kvflow.plugins import paged_attention_host, paged_attention_native
from kvflow.reports.writers import memory_bandwidth_gb_s, pyplot, save_figure, write_report
from kvflow.runtime import ort_runner
from kvflow.runtime.base import StepInput


def _timed(fn) -> float:
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
    """Wraps the attention function the runner calls, to split the step's time."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def time_engine(engine_dir: Path, cases: list[tuple[int, int]], int8: bool,
                attention: str, repeats: int) -> list[dict]:
    engine = EngineConfig.load(engine_dir)
    bs = engine.limits.block_size
    max_blocks = max(b * -(-c // bs) for b, c in cases) + 1
    impl = (paged_attention_native.paged_attention_native if attention == "native"
            else paged_attention_host.paged_attention_host)
    timed = _Timed(impl)
    original = ort_runner.paged_attention_native
    ort_runner.paged_attention_native = timed  # the benchmark's own probe, not the engine's
    runner = ort_runner.OnnxRuntimeRunner(engine_dir, engine, max_blocks,
                                          quantized_matmul="int8" if int8 else "fp32")
    rows = []
    try:
        for batch, context in cases:
            step = decode_step(batch, context, bs)
            for _ in range(2):
                runner.execute_argmax(step)
            walls, attn = [], []
            for _ in range(repeats):
                timed.seconds = 0.0
                walls.append(_timed(lambda: runner.execute_argmax(step)))  # noqa: B023
                attn.append(timed.seconds)
            i = int(np.argmin(walls))
            rows.append({"batch": batch, "context": context, "step_ms": walls[i] * 1e3,
                         "median_ms": statistics.median(walls) * 1e3,
                         "attention_ms": attn[i] * 1e3})
    finally:
        runner.close()
        ort_runner.paged_attention_native = original
    return rows


def kv_bytes(engine: EngineConfig, batch: int, context: int) -> int:
    m = engine.model
    return 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * 4 * batch * context


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", action="append", required=True, metavar="NAME=DIR")
    p.add_argument("--cases", default="1x128,8x128,32x128,1x768,32x768",
                   help="BATCHxCONTEXT decode steps")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="reports/cpu_step")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    bandwidth = memory_bandwidth_gb_s()
    print(f"memory bandwidth (copy, read + write): {bandwidth:.1f} GB/s", flush=True)
    results = []
    for spec in args.engine:
        name, folder = spec.split("=", 1)
        engine_dir = Path(folder)
        engine = EngineConfig.load(engine_dir)
        variants = [("int8", True), ("fp32", False)] if engine.quantization else [("fp32", False)]
        for mode, int8 in variants:
            weights = matmul_weight_bytes(engine_dir, dequantized=not int8)
            for attention in ("native", "numpy"):
                label = f"{name} ({mode} matmul, {attention} attention)"
                print(f"timing {label}", flush=True)
                for row in time_engine(engine_dir, cases, int8, attention, args.repeats):
                    read = weights + kv_bytes(engine, row["batch"], row["context"])
                    roofline_ms = read / (bandwidth * 1e9) * 1e3
                    results.append({"engine": name, "matmul": mode, "attention": attention,
                                    **row, "weight_mb": weights / 1e6,
                                    "kv_mb": kv_bytes(engine, row["batch"],
                                                      row["context"]) / 1e6,
                                    "roofline_ms": roofline_ms,
                                    "vs_roofline": row["step_ms"] / roofline_ms})
    (out / "report.json").write_text(json.dumps({"bandwidth_gbs": bandwidth,
                                                 "results": results}, indent=2))
    lines = [f"# CPU decode step vs roofline (memory bandwidth {bandwidth:.1f} GB/s)", "",
             "| engine | matmul | attention | batch | context | step ms (best) | median ms | "
             "attention ms | weights MB | KV MB | roofline ms | step / roofline |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['engine']} | {r['matmul']} | {r['attention']} | {r['batch']} | "
                     f"{r['context']} | {r['step_ms']:.1f} | {r['median_ms']:.1f} | "
                     f"{r['attention_ms']:.1f} | {r['weight_mb']:.0f} | {r['kv_mb']:.0f} | "
                     f"{r['roofline_ms']:.1f} | {r['vs_roofline']:.2f} |")
    write_report(out / "summary.md", lines)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"{b}x{c}" for b, c in cases]
    series = sorted({(r["engine"], r["matmul"], r["attention"]) for r in results})
    width = 0.8 / (len(series) + 1)
    for k, key in enumerate(series):
        ys = [next(r["step_ms"] for r in results if (r["engine"], r["matmul"], r["attention"])
                   == key and (r["batch"], r["context"]) == case) for case in cases]
        ax.bar(np.arange(len(cases)) + k * width, ys, width, label=" / ".join(key))
    roof = [next(r["roofline_ms"] for r in results if (r["batch"], r["context"]) == case
                 and r["engine"] == series[-1][0]) for case in cases]
    ax.bar(np.arange(len(cases)) + len(series) * width, roof, width, color="black",
           label=f"roofline ({series[-1][0]})")
    ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2, labels)
    ax.set_xlabel("decode step: batch x context")
    ax.set_ylabel("ms per step (log)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("Decode step on the CPU, ONNX Runtime runner")
    save_figure(fig, out / "cpu_step.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
