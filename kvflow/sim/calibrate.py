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

4. **Served** (``--served``): behind a real tritonserver, with the load generator on the
   same machine, the engine shares the CPU with Triton's gRPC threads, the Python backend's
   response path and the client's streams; on a 2-core machine its steps run some 10-30%
   slower than alone (``kvflow_engine_step_seconds_total`` against the same steps offline).
   A served open-loop load of its own is measured, the same requests are simulated, and the
   factor on every step cost that reproduces its mean E2E latency is applied.
"""

from __future__ import annotations

import statistics
import tempfile
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
    bs = runner.engine.limits.block_size
    rows = []
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
    from kvflow.bench.workloads import poisson_arrivals
    from kvflow.orchestrator.engine import LLMEngine
    from kvflow.orchestrator.llm import plan_engine
    from kvflow.orchestrator.sampling.params import SamplingParams
    from kvflow.sim.simulator import run_in_real_time
    from kvflow.text.tokenizer import EngineTokenizer

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
    vocab = runner.engine.model.vocab_size
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


SERVED_TRACE_SKIP = 1000  # the served trace load starts at this row: validate uses the first


def served_slowdown(engine_dir: str | Path, cost: LinearCostModel, rate: float,
                    progress: Callable[[str], None], workload: str = "random",
                    trace: str | Path | None = None,
                    length_scale: float = 0.25,
                    num_requests: int | None = None) -> dict[str, Any]:
    """How much slower the engine runs behind tritonserver with a load generator on the same
    machine (see the module docstring): the factor on every step cost that makes the
    simulator reproduce the mean E2E latency of a served open-loop load of its own.

    ``workload``: ``random`` (``num_requests`` or 40 requests, prompts 50-350, outputs
    16-112) or ``trace`` (``num_requests`` or 48 requests of the Azure trace from row 1000 on,
    none of those ``validate`` replays by default, lengths times ``length_scale``), both at
    ``rate``. The serving cost depends on
    the request mix, so calibrate on the kind of traffic you will simulate."""
    from kvflow.bench.serve import make_prompts, run_load
    from kvflow.bench.workloads import load_azure_trace, random_workload, retime
    from kvflow.client import stream_generate
    from kvflow.orchestrator.llm import plan_engine
    from kvflow.sim.simulator import simulate
    from kvflow.text.tokenizer import EngineTokenizer
    from kvflow.triton_backend.server import ServerConfig, TritonServer

    if workload == "trace":
        if trace is None:
            raise ValueError("a served trace calibration needs the trace file")
        rows, _ = load_azure_trace(trace, limit=SERVED_TRACE_SKIP + (num_requests or 48),
                                   max_prompt_tokens=768, max_output_tokens=256,
                                   length_scale=length_scale)
        specs = retime(rows[SERVED_TRACE_SKIP:], rate)
    elif workload == "random":
        specs = random_workload(num_requests or 40, 200, 64, rate, 1.0, seed=12345,
                                range_ratio=0.75)
    else:
        raise ValueError(f"served workload must be random or trace, got {workload!r}")
    options = {"max_num_seqs": 32, "max_num_batched_tokens": 256,
               "enable_prefix_caching": False}
    plan = plan_engine(engine_dir, **options)
    texts = make_prompts(specs, str(engine_dir), seed=12345)
    tok = EngineTokenizer(engine_dir)
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    cfg = ServerConfig.on_free_ports(engine_dir, options)
    progress(f"[calibrate] served: {len(specs)} requests at {rate:.2f} req/s through "
             "tritonserver ...")
    log = Path(tempfile.mkdtemp(prefix="kvflow-calibrate-")) / "tritonserver.log"
    with TritonServer(cfg, log_path=log) as server:
        list(stream_generate(server.grpc_url, texts[0], {"max_tokens": 2}))  # warm-up
        timings, _ = run_load(server.grpc_url, specs, texts, None, progress=False)
    real = float(np.mean([t.e2e_s for t in timings if t.e2e_s is not None]))

    def sim_e2e(factor: float) -> float:
        scaled = LinearCostModel({k: v * factor for k, v in cost.coefficients.items()})
        result = simulate(specs, scaled, plan.scheduler, plan.num_blocks,
                          plan.engine.limits.block_size, prompts=prompts)
        return float(np.mean([t.e2e_s for t in result.timings]))

    return {"workload": workload, "rate": rate, "requests": len(specs),
            **fit_slowdown(sim_e2e, real)}


def fit_slowdown(mean_e2e_s: Callable[[float], float], target_s: float,
                 rel_tol: float = 1e-4) -> dict[str, Any]:
    """The factor on every step cost at which the simulated mean E2E latency
    ``mean_e2e_s(factor)`` reaches ``target_s`` (the served one).

    E2E grows with the factor, so the factor is bisected: the bracket starts at [0.5, 2],
    widens (halving ``lo``, doubling ``hi``) until ``mean_e2e_s(lo) < target_s <=
    mean_e2e_s(hi)``, and keeps that while it narrows to ``hi - lo <= rel_tol * hi``. The
    result holds the bracket, its two simulated E2Es, and the midpoint as ``slowdown``."""
    if not target_s > 0:
        raise ValueError(f"target mean E2E must be > 0 s, got {target_s}")
    lo, hi = 0.5, 2.0
    e2e_lo, e2e_hi = mean_e2e_s(lo), mean_e2e_s(hi)
    for _ in range(60):
        if e2e_lo < target_s:
            break
        lo, hi, e2e_hi = lo / 2, lo, e2e_lo
        e2e_lo = mean_e2e_s(lo)
    for _ in range(60):
        if e2e_hi >= target_s:
            break
        lo, hi, e2e_lo = hi, hi * 2, e2e_hi
        e2e_hi = mean_e2e_s(hi)
    if not e2e_lo < target_s <= e2e_hi:
        raise ValueError(f"no step-cost factor in [{lo:g}, {hi:g}] gives a simulated mean E2E "
                         f"of {target_s:.4g} s (it gives {e2e_lo:.4g}-{e2e_hi:.4g} s)")
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        e2e_mid = mean_e2e_s(mid)
        if e2e_mid < target_s:
            lo, e2e_lo = mid, e2e_mid
        else:
            hi, e2e_hi = mid, e2e_mid
    factor = (lo + hi) / 2
    return {"slowdown": factor, "slowdown_bracket": [lo, hi],
            "bracket_mean_e2e_s": [e2e_lo, e2e_hi], "real_mean_e2e_s": target_s,
            "engine_only_mean_e2e_s": mean_e2e_s(1.0), "fitted_mean_e2e_s": mean_e2e_s(factor)}


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
    meta = {
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
