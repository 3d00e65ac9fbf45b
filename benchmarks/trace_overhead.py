"""What the step timeline (``trace_steps``) costs: per step, and to write.

Two engines, each run with tracing off and on, alternating, ``--repeats`` times:

* ``instant``: 256 running requests decoding, with a runner that returns at once (the
  scheduler-overhead setting of ``benchmarks/scheduler_overhead.py``): the harshest case, since
  every microsecond the tracer adds is a share of pure-Python bookkeeping;
* ``model``: the default model on ONNX Runtime, 16 requests of 48 output tokens: a real step.

For each: the median step time off and on, the tracer's own time per step (``StepRecorder._trace``,
timed directly), and the time and size of writing the ring. Writes a markdown report, a JSON file
and a PNG.

    python benchmarks/trace_overhead.py --engine engines/smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scheduler_overhead import decoding_engine  # noqa: E402

from kvflow.orchestrator.engine import LLMEngine  # noqa: E402
from kvflow.orchestrator.llm import create_engine  # noqa: E402
from kvflow.orchestrator.sampling.params import SamplingParams  # noqa: E402
from kvflow.reports.writers import pyplot, save_figure, write_report  # noqa: E402


def timed_trace(engine: LLMEngine) -> list[float]:
    """Wrap the engine's ``recorder._trace`` to time each call; returns the list it fills."""
    times: list[float] = []
    inner = engine.recorder._trace

    def traced(*args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        inner(*args, **kwargs)
        times.append(time.perf_counter() - t0)

    engine.recorder._trace = traced  # type: ignore[method-assign]
    return times


def run_instant(engine_dir: str, trace: Path | None, steps: int) -> dict:
    engine = decoding_engine(engine_dir, 256, steps, 32, False,
                             trace_steps=str(trace) if trace else None)
    record = timed_trace(engine) if trace else []
    wall = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        wall.append(time.perf_counter() - t0)
    return finish(engine, wall, record)


def run_model(engine_dir: str, trace: Path | None, num_requests: int) -> dict:
    engine = create_engine(engine_dir, max_num_seqs=num_requests,
                           trace_steps=str(trace) if trace else None)
    record = timed_trace(engine) if trace else []
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(f"Request {i}: tell me about paged attention and batching.", params)
    wall = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        wall.append(time.perf_counter() - t0)
    result = finish(engine, wall, record)
    engine.runner.close()
    return result


def finish(engine: LLMEngine, wall: list[float], record: list[float]) -> dict:
    out = {"steps": len(wall), "step_ms": statistics.median(wall) * 1e3}
    if engine.tracer is not None:
        t0 = time.perf_counter()
        path = engine.write_trace()
        out["write_s"] = time.perf_counter() - t0
        assert path is not None
        out["file_mb"] = path.stat().st_size / 2**20
        out["record_us"] = statistics.median(record) * 1e6
        out["ring_steps"] = len(engine.tracer.steps)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/smollm2-135m")
    p.add_argument("--steps", type=int, default=300, help="instant: steps timed per run")
    p.add_argument("--requests", type=int, default=16, help="model: concurrent requests")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="reports/trace_overhead")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, list[dict]]] = {"instant": {"off": [], "on": []},
                                                 "model": {"off": [], "on": []}}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for mode in ("off", "on"):
                trace = Path(tmp) / f"{mode}{rep}.json" if mode == "on" else None
                results["instant"][mode].append(run_instant(args.engine, trace, args.steps))
                results["model"][mode].append(run_model(args.engine, trace, args.requests))
                print(f"repeat {rep + 1}/{args.repeats} tracing {mode}: instant "
                      f"{results['instant'][mode][-1]['step_ms']:.2f} ms/step, model "
                      f"{results['model'][mode][-1]['step_ms']:.2f} ms/step", flush=True)

    def med(case: str, mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[case][mode])

    lines = ["# The step timeline's cost", "",
             f"`python benchmarks/trace_overhead.py --engine {args.engine}` (medians of "
             f"{args.repeats} alternating runs each).", "",
             "| engine | steps per run | step ms, tracing off | step ms, on | tracer's own "
             "record per step (us) | share of the step | write the ring (ms) | file (MB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    labels = {"instant": "256 decoding, instant runner",
              "model": f"default model (ORT), {args.requests} requests"}
    summary = {}
    for case in ("instant", "model"):
        off, on = med(case, "off", "step_ms"), med(case, "on", "step_ms")
        rec = med(case, "on", "record_us")
        share = rec / 1e3 / on
        summary[case] = {"off_ms": off, "on_ms": on, "record_us": rec, "share": share,
                         "write_ms": med(case, "on", "write_s") * 1e3,
                         "file_mb": med(case, "on", "file_mb"),
                         "steps": results[case]["on"][0]["steps"]}
        s = summary[case]
        lines.append(f"| {labels[case]} | {s['steps']} | {off:.2f} | {on:.2f} | {rec:.1f} | "
                     f"{share:.1%} | {s['write_ms']:.0f} | {s['file_mb']:.2f} |")
    lines += ["", "Tracing off, the engine has no tracer and records nothing: its cost is one "
              "`is not None` test per step. The step-time columns include the machine's noise; "
              "the tracer's own column is timed around the record call alone."]
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, case in zip(axes, ("instant", "model"), strict=True):
        s = summary[case]
        ax.bar(["tracing off", "tracing on"], [s["off_ms"], s["on_ms"]], color=["C0", "C1"])
        ax.bar(["tracing on"], [s["record_us"] / 1e3], color="C3",
               label="the tracer's own record")
        ax.set_ylabel("median step (ms)")
        ax.set_title(labels[case], fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("Step time with and without the step timeline")
    plot = save_figure(fig, out / "trace_overhead.png")
    lines += ["", f"![trace overhead]({Path(plot).name})"]
    (out / "trace_overhead.json").write_text(json.dumps({"summary": summary,
                                                         "runs": results}, indent=1))
    write_report(out / "summary.md", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
