"""``kvflow simulate calibrate``: fit the simulator's step-time model to a real engine.

Measurements, all on the real runner:

1. **A grid** of step shapes (prefill tokens x decode batch x context length, and prefill
   chunks mixed with decodes), each timed as the median of a few repeats.
2. **A real engine run** (:class:`LLMEngine` on the same runner, a random workload, after a
   warm-up run): every step's shape, its time in the model, and its time outside the model
   (scheduling, building the step, sampling, detokenizing). Steps in a live engine cost more
   than the same shape repeated in isolation (KV blocks scattered over the pool, caches cold),
   so these steps join the grid in the fit of model time.
3. **A second engine run** with another seed, held out: the check of the whole model.

Model time is fitted on (1) and (2), the overhead on (2); the two add up to one
:class:`LinearCostModel`, saved with the error of each fit and of the held-out check.

4. **Served** (``--served``): the slowdown behind a real tritonserver, fitted by
   :mod:`kvflow.sim.served`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.sim.cost_model import (
    ENGINE_FEATURES,
    LINEAR_FEATURES,
    LinearCostModel,
    StepShape,
    fit_nonnegative,
    linear_features,
)
from kvflow.sim.served import served_slowdown

COST_MODEL_FILE = "cost_model.json"

# (name, [(start, num_new), ...]) : one sequence per pair; start = tokens already in the cache.
Shape = list[tuple[int, int]]


def calibration_grid(max_len: int, max_batch: int, max_tokens: int) -> list[tuple[str, Shape]]:
    """Step shapes to time, within the engine's limits."""
    grid: list[tuple[str, Shape]] = []
    for n in (16, 64, 128, 256, 512, 1024):
        if n <= min(max_len, max_tokens):
            grid.append((f"prefill {n}", [(0, n)]))
    if max_tokens >= 512 and max_len >= 256:
        grid.append(("prefill 2x256", [(0, 256), (0, 256)]))
    for ctx in (32, 256, 768):
        if ctx >= max_len:
            continue
        for b in (1, 2, 4, 8, 16, 32):
            if b <= max_batch:
                grid.append((f"decode b={b} ctx={ctx}", [(ctx, 1)] * b))
    for b in (4, 16):
        if b + 1 <= max_batch and 256 + b <= max_tokens and max_len >= 512:
            grid.append((f"chunk 256@256 + {b} decodes ctx=256",
                         [(256, 256)] + [(256, 1)] * b))
    if max_len >= 896 and max_tokens >= 128:
        grid.append(("chunk 128@768", [(768, 128)]))
    return grid


def _time_grid(runner: Any, grid: list[tuple[str, Shape]], repeats: int, vocab: int,
               progress: Callable[[str], None]) -> list[dict[str, Any]]:
    from kvflow.kv_manager import KVCacheManager
    from kvflow.runtime.step_builder import SeqChunk, build_step

    rng = np.random.default_rng(0)
    bs = runner.block_size
    rows: list[dict[str, Any]] = []
    for i, (name, seqs) in enumerate(grid):
        kv = KVCacheManager(runner.num_blocks, bs)
        chunks = []
        for j, (start, new) in enumerate(seqs):
            ids = rng.integers(10, vocab, size=start + new).tolist()
            kv.allocate_slots(j, start + new)
            chunks.append(SeqChunk(j, ids, start, new, True))
        step = build_step(kv, chunks)
        runner.execute(step)  # warm-up (and fills the cache positions read)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.execute(step)
            times.append(time.perf_counter() - t0)
        shape = StepShape.of(step)
        rows.append({"name": name, "shape": shape, "time_s": statistics.median(times)})
        progress(f"[calibrate] {i + 1}/{len(grid)} {name}: {rows[-1]['time_s'] * 1e3:.1f} ms")
    return rows


def _engine_run(runner: Any, engine_dir: str | Path, num_requests: int, seed: int,
                rate: float | None) -> list[dict[str, Any]]:
    """A real engine run on ``runner``: each step's shape, model and overhead time.

    Requests (random prompts of 16-512 tokens, outputs of 8-128) arrive as a Poisson stream
    at ``rate`` per second in real time, as a served stream would bring them, so the run mixes
    decode batches of every size with prefill chunks (256-token budget per step). ``rate``
    None adds them all at once (a warm-up)."""
    from kvflow.orchestrator.engine import LLMEngine
    from kvflow.orchestrator.llm import plan_engine
    from kvflow.orchestrator.sampling.params import SamplingParams
    from kvflow.sim.simulator import run_in_real_time
    from kvflow.text.tokenizer import EngineTokenizer
    from kvflow.workloads.arrivals import poisson_arrivals

    limits = runner.engine.limits
    max_len = min(1024, limits.max_model_len)
    plan = plan_engine(engine_dir, max_num_seqs=min(32, limits.max_batch_size),
                       max_model_len=max_len,
                       max_num_batched_tokens=min(256, limits.max_num_tokens))
    has_tokenizer = (Path(engine_dir) / "tokenizer.json").is_file()
    engine = LLMEngine(runner, EngineTokenizer(engine_dir) if has_tokenizer else None,
                       plan.scheduler, plan.engine.model.eos_token_ids)
    shapes: list[StepShape] = []
    execute, execute_argmax = runner.execute, runner.execute_argmax
    last: list[object] = [None]

    def record(step) -> None:  # type: ignore[no-untyped-def]
        if step is not last[0]:  # a runner's execute_argmax may call its own execute
            shapes.append(StepShape.of(step))
            last[0] = step

    def recording_execute(step):  # type: ignore[no-untyped-def]
        record(step)
        return execute(step)

    def recording_execute_argmax(step):  # type: ignore[no-untyped-def]
        record(step)
        return execute_argmax(step)

    rng = np.random.default_rng(seed)
    vocab = runner.vocab_size
    longest = max(min(512, max_len - 160), 17)
    requests = [(rng.integers(10, vocab, size=int(rng.integers(16, longest))).tolist(),
                 int(rng.integers(8, min(128, max_len - longest))))
                for _ in range(num_requests)]
    arrivals = [0.0] * num_requests if rate is None else poisson_arrivals(num_requests, rate,
                                                                          seed)

    def add(i: int, _arrival: float) -> None:
        prompt, out = requests[i]
        engine.add_request(prompt, SamplingParams(max_tokens=out, temperature=0.0,
                                                  ignore_eos=True))

    runner.execute = recording_execute
    runner.execute_argmax = recording_execute_argmax
    try:
        run_in_real_time(engine, arrivals, add)
    finally:
        runner.execute, runner.execute_argmax = execute, execute_argmax
    stats = engine.step_stats
    assert len(stats) == len(shapes), "one shape per model step"
    return [{"shape": sh, "model_s": st.model_time_s, "overhead_s": st.overhead_time_s}
            for sh, st in zip(shapes, stats, strict=True)]


def _engine_features(shape: StepShape) -> tuple[float, ...]:
    """The features an engine alone is fitted on (no serving cost per starting request)."""
    return linear_features(shape)[:len(ENGINE_FEATURES)]


def _engine_model(coef: list[float]) -> LinearCostModel:
    return LinearCostModel({**dict(zip(ENGINE_FEATURES, coef, strict=True)),
                            "first_chunks": 0.0})


OVERHEAD_FEATURES = ("step", "tokens", "seqs")


def fit_step_costs(grid: list[tuple[StepShape, float]],
                   runs: list[tuple[StepShape, float, float]],
                   ) -> tuple[LinearCostModel, LinearCostModel, dict[str, float]]:
    """Fit the cost model on measured steps.

    ``grid``: (shape, seconds in the model) of the isolated step shapes; ``runs``: (shape,
    seconds in the model, seconds outside it) of the steps of real engine runs. Model time is
    fitted on both (over :data:`ENGINE_FEATURES`), the overhead on the runs alone (per step,
    token and sequence: attention and context cost nothing outside the model). Returns the
    whole model (the two added up), the model-time part alone, and the overhead
    coefficients."""
    shapes = [sh for sh, _ in grid] + [sh for sh, _, _ in runs]
    model_s = [t for _, t in grid] + [t for _, t, _ in runs]
    model_only = _engine_model(fit_nonnegative([_engine_features(sh) for sh in shapes],
                                               model_s))
    over_idx = [LINEAR_FEATURES.index(k) for k in OVERHEAD_FEATURES]
    over_rows = [tuple(linear_features(sh)[i] for i in over_idx) for sh, _, _ in runs]
    # NOTE: the fit weighs rows by 1/time: an overhead measured as 0 would weigh infinitely.
    over_coef = fit_nonnegative(over_rows, [max(over, 1e-6) for _, _, over in runs])
    overhead = dict(zip(OVERHEAD_FEATURES, over_coef, strict=True))
    coef = dict(model_only.coefficients)
    for name, c in overhead.items():
        coef[name] += c
    return LinearCostModel(coef), model_only, overhead


def _rel_errors(model: LinearCostModel, shapes: list[StepShape],
                times: list[float]) -> dict[str, float]:
    err = np.array([abs(model.step_time_s(s) - t) / t for s, t in zip(shapes, times,
                                                                     strict=True)])
    total = abs(sum(model.step_time_s(s) for s in shapes) - sum(times)) / sum(times)
    return {"mean_abs_rel": float(err.mean()), "max_abs_rel": float(err.max()),
            "total_time_rel": float(total)}


def calibrate(engine_dir: str | Path, runner_name: str | None = None, repeats: int = 3,
              num_requests: int = 24, seed: int = 0, served: str | None = None,
              progress: Callable[[str], None] = print, trace: str | Path | None = None,
              length_scale: float = 0.25) -> LinearCostModel:
    """Time ``engine_dir``'s runner and engine, fit, and return the cost model."""
    from kvflow.build.engine_config import EngineConfig
    from kvflow.runtime import create_runner

    engine = EngineConfig.load(engine_dir)
    limits = engine.limits
    grid = calibration_grid(limits.max_model_len, limits.max_batch_size, limits.max_num_tokens)
    bs = limits.block_size
    need = max(sum(-(-(s + n + 1) // bs) for s, n in seqs) for _, seqs in grid)
    need = max(need, 32 * -(-1024 // bs)) + 2  # also the engine runs' 32 x 1024 tokens
    runner = create_runner(runner_name, engine_dir, need)
    try:
        progress(f"[calibrate] timing {len(grid)} step shapes on the {runner.name} runner "
                 f"({repeats} repeats each) ...")
        grid_rows = _time_grid(runner, grid, repeats, engine.model.vocab_size, progress)
        # Request rates that keep about 1.5, 4 and (held out) 2.5 requests in flight, from
        # the grid's estimate of one request's time alone (264-token prompt, 68 outputs).
        rough = _engine_model(fit_nonnegative([_engine_features(r["shape"]) for r in grid_rows],
                                              [r["time_s"] for r in grid_rows]))
        alone_s = (rough.step_time_s(StepShape((264,), (264,), 1))
                   + 68 * rough.step_time_s(StepShape((1,), (300,), 1)))
        rates = {"fit, light": 1.5 / alone_s, "fit, busy": 4.0 / alone_s,
                 "held out": 2.5 / alone_s}
        _engine_run(runner, engine_dir, min(num_requests, 8), seed + 1000, None)  # warm-up
        runs = {}
        for k, (name, rate) in enumerate(rates.items()):
            progress(f"[calibrate] real engine run ({name}): {num_requests} requests at "
                     f"{rate:.2f} req/s ...")
            runs[name] = _engine_run(runner, engine_dir, num_requests, seed + k, rate)
        run_rows = runs["fit, light"] + runs["fit, busy"]
        check_rows = runs["held out"]
    finally:
        runner.close()

    cost, grid_only, overhead = fit_step_costs(
        [(r["shape"], r["time_s"]) for r in grid_rows],
        [(r["shape"], r["model_s"], r["overhead_s"]) for r in run_rows])
    meta: dict[str, Any] = {
        "engine": str(engine_dir), "runner": runner_name or engine.backend,
        "engine_run_rates": rates,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"), "repeats": repeats,
        "model_coefficients": grid_only.coefficients,
        "overhead_coefficients": overhead,
        "grid": [{"name": r["name"], "measured_ms": r["time_s"] * 1e3,
                  "fitted_ms": grid_only.step_time_s(r["shape"]) * 1e3} for r in grid_rows],
        "grid_fit_error": _rel_errors(grid_only, [r["shape"] for r in grid_rows],
                                      [r["time_s"] for r in grid_rows]),
        "engine_run_error": _rel_errors(cost, [r["shape"] for r in run_rows],
                                        [r["model_s"] + r["overhead_s"] for r in run_rows]),
        "held_out_error": _rel_errors(cost, [r["shape"] for r in check_rows],
                                      [r["model_s"] + r["overhead_s"] for r in check_rows]),
        "engine_run_steps": len(run_rows),
        "held_out_steps": len(check_rows),
    }
    coef = dict(cost.coefficients)
    if served:
        meta["served"] = served_slowdown(engine_dir, cost, rates["held out"], progress,
                                         served, trace, length_scale)
        coef = {k: v * meta["served"]["slowdown"] for k, v in coef.items()}
    return LinearCostModel(coef, meta)


def add_args(p: argparse.ArgumentParser) -> None:
    """``kvflow simulate calibrate``'s flags."""
    from kvflow.utils.args import int_arg
    from kvflow.workloads.azure import DEFAULT_TRACE

    p.add_argument("--engine", required=True, help="engine folder")
    p.add_argument("--runner", default=None,
                   choices=["onnxruntime", "torch", "triton", "tensorrt"])
    p.add_argument("--output", default=None,
                   help=f"where to save the model (default: ENGINE/{COST_MODEL_FILE})")
    p.add_argument("--repeats", type=int_arg, default=3)
    p.add_argument("--num-requests", type=int_arg, default=24,
                   help="requests of the engine run that measures the overhead")
    p.add_argument("--seed", type=int_arg, default=0)
    p.add_argument("--served", nargs="?", const="random", choices=["random", "trace"],
                   default=None,
                   help="also measure how much slower the engine runs behind tritonserver, on "
                        "a served load of its own: random (default) or rows 1000+ of the "
                        "trace; calibrate on the kind of traffic you will simulate")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="--served trace: the CSV")
    p.add_argument("--length-scale", type=float, default=0.25,
                   help="--served trace: lengths multiplied by this")


def calibrate_main(args: Any) -> int:
    cost = calibrate(args.engine, args.runner, args.repeats, args.num_requests, args.seed,
                     served=args.served, trace=args.trace, length_scale=args.length_scale)
    out = Path(args.output or Path(args.engine) / COST_MODEL_FILE)
    cost.save(out)
    m = cost.meta
    print(f"[calibrate] wrote {out}")
    print("  coefficients: " + ", ".join(f"{k}={v:.3g}" for k, v in cost.coefficients.items()))
    g, e, h = m["grid_fit_error"], m["engine_run_error"], m["held_out_error"]
    print(f"  grid (model time alone): mean |error| {g['mean_abs_rel']:.1%}, max "
          f"{g['max_abs_rel']:.1%}")
    print(f"  fitted engine run ({m['engine_run_steps']} steps, model + overhead): mean "
          f"|error| {e['mean_abs_rel']:.1%}, total time {e['total_time_rel']:.1%}")
    print(f"  held-out engine run ({m['held_out_steps']} steps): mean |error| "
          f"{h['mean_abs_rel']:.1%}, total time {h['total_time_rel']:.1%}")
    if "served" in m:
        sv = m["served"]
        print(f"  served ({sv['workload']} load): mean E2E "
              f"{sv['real_mean_e2e_s'] * 1e3:.0f} ms through tritonserver, "
              f"{sv['engine_only_mean_e2e_s'] * 1e3:.0f} ms simulated for the engine alone: "
              f"every step cost x{sv['slowdown']:.3f} "
              f"({sv['fitted_mean_e2e_s'] * 1e3:.0f} ms simulated)")
    return 0
