"""``kvflow simulate calibrate --served``: how much slower the engine runs when served.

Behind a real tritonserver, with the load generator on the same machine, the engine shares
the CPU with Triton's gRPC threads, the Python backend's response path and the client's
streams; on a 2-core machine its steps run some 10-30% slower than alone
(``kvflow_engine_step_seconds_total`` against the same steps offline). A served open-loop load
of its own is measured, the same requests are simulated, and the factor on every step cost
that reproduces its mean E2E latency is applied.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.sim.cost_model import LinearCostModel
from kvflow.workloads.arrivals import retime
from kvflow.workloads.azure import load_azure_trace
from kvflow.workloads.prompts import make_prompts
from kvflow.workloads.synthetic import random_workload

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
    from kvflow.client import stream_generate
    from kvflow.loadgen.sender import run_load
    from kvflow.orchestrator.llm import plan_engine
    from kvflow.sim.simulator import simulate
    from kvflow.text.tokenizer import EngineTokenizer
    from kvflow.triton_backend.launcher import ServerConfig, TritonServer

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
        return float(np.mean([t.e2e_s for t in result.timings if t.e2e_s is not None]))

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
