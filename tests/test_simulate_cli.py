"""`kvflow simulate`: reports, sweeps, calibration on a real engine, validation against the
real server."""

from __future__ import annotations

import json
import math

import pytest

from kvflow.cli import make_parser
from kvflow.orchestrator.options import EngineOptions
from kvflow.sim.cost_model import LINEAR_FEATURES, LinearCostModel, StepShape
from kvflow.workloads.azure import default_trace
from kvflow.workloads.synthetic import random_workload

SERVE_REPORT_KEYS = {"config", "summary", "requests", "server_series", "plots"}
SERVE_REQUEST_KEYS = {"send_s", "ttft_s", "tpot_s", "e2e_s", "prompt_tokens", "output_tokens",
                      "ok"}


def run_cli(*argv: str) -> int:
    args = make_parser().parse_args(list(argv))
    return args.func(args)


def test_one_run_writes_the_bench_serve_report_plus_kv_and_queue(tmp_path):
    out = tmp_path / "sim"
    assert run_cli("simulate", "--hardware", "A100", "--model", "qwen2-7b", "--workload",
                   "random", "--num-prompts", "60", "--input-len", "300", "--output-len", "40",
                   "--range-ratio", "0.5", "--request-rate", "8", "--policy", "chunked",
                   "--chunk-tokens", "512", "--slo", "ttft_ms=500", "--out", str(out),
                   "--no-progress") == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report) >= SERVE_REPORT_KEYS
    assert set(report["summary"]) >= {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "goodput",
                                      "request_throughput", "output_token_throughput"}
    assert report["summary"]["completed"] == 60
    assert report["summary"]["total_output_tokens"] == sum(
        r["output_tokens"] for r in report["requests"])
    assert all(SERVE_REQUEST_KEYS | {"queue_s"} <= set(r) for r in report["requests"])
    assert all(r["queue_s"] >= 0 for r in report["requests"])
    row = report["server_series"][0]
    assert {"t_s", "kvflow_num_requests_running", "kvflow_num_requests_waiting",
            "kvflow_kv_cache_usage_ratio", "kvflow_kv_cache_fragmentation_ratio",
            "batch_tokens"} <= set(row)
    sim = report["config"]["simulation"]
    assert sim["scheduler"]["max_num_batched_tokens"] == 512
    assert sim["scheduler"]["enable_chunked_prefill"] is True
    assert 0 <= sim["kv_fragmentation_mean"] < 1
    assert report["config"]["hardware"] == "A100 80GB"
    for name in ("summary.md", "latency_cdf.png", "server_series.png", "kv_batch.png"):
        assert (out / name).stat().st_size > 0, name


@pytest.mark.slow
@pytest.mark.skipif(not default_trace().is_file(),
                    reason=f"Azure trace not found at {default_trace()}")
def test_a_sweep_of_policies_and_rates_shows_continuous_beating_static(tmp_path):
    out = tmp_path / "sweep"
    assert run_cli("simulate", "--num-prompts", "200", "--policy", "static,continuous",
                   "--rates", "4,16", "--max-num-seqs", "64", "--slo", "ttft_ms=1000",
                   "--out", str(out), "--no-progress") == 0
    sweep = json.loads((out / "sweep.json").read_text())
    static, cont = sweep["results"]["static"], sweep["results"]["continuous"]
    assert [p["rate"] for p in static] == [4.0, 16.0]
    # Under load, static batching makes new requests wait for the longest of the batch.
    assert cont[1]["summary"]["ttft_ms"]["p99"] < static[1]["summary"]["ttft_ms"]["p99"]
    assert static[1]["simulation"]["kv_fragmentation_mean"] > \
        cont[1]["simulation"]["kv_fragmentation_mean"]
    for mode in ("static", "continuous"):
        for rate in ("4.0", "16.0"):
            assert (out / mode / f"rate_{rate}" / "report.json").is_file()
    assert (out / "sweep.png").stat().st_size > 0
    assert "Highest rate with P99 TTFT" in (out / "summary.md").read_text()


def test_bad_arguments_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="--policy"):
        run_cli("simulate", "--policy", "magic", "--out", str(tmp_path))
    with pytest.raises(ValueError, match="does not fit"):
        run_cli("simulate", "--model", "llama-3-70b", "--hardware", "L40S", "--out",
                str(tmp_path))
    with pytest.raises(FileNotFoundError, match="simulate calibrate"):
        run_cli("simulate", "--cost", str(tmp_path / "c.json"), "--out", str(tmp_path))
    LinearCostModel(dict.fromkeys(LINEAR_FEATURES, 1e-3)).save(tmp_path / "c.json")
    with pytest.raises(ValueError, match="--num-kv-blocks is required"):
        run_cli("simulate", "--cost", str(tmp_path / "c.json"), "--out", str(tmp_path))


@pytest.fixture(scope="module")
def calibration_engine(tiny_models, tmp_path_factory):
    """A tiny random-weight engine with room for the whole calibration grid (prefills of 512,
    decode batches of 32): the calibration's code paths at a fraction of the default model's
    time. The real model's figures are a measurement (docs/simulator.md), not a test."""
    from kvflow.build.builder import build_engine

    path = tmp_path_factory.mktemp("calibration-engine") / "engine"
    build_engine(str(tiny_models["llama-gqa4"][0]), path, backend="onnxruntime",
                 max_model_len=512, max_num_tokens=512, max_batch_size=32, block_size=16,
                 progress=lambda _msg: None)
    return path


@pytest.fixture(scope="module")
def calibrated(calibration_engine, tmp_path_factory):
    """The calibration engine, calibrated (one repeat per grid point)."""
    out = tmp_path_factory.mktemp("calibrate") / "cost.json"
    assert run_cli("simulate", "calibrate", "--engine", str(calibration_engine),
                   "--repeats", "1", "--num-requests", "12", "--output", str(out)) == 0
    return out


def shape_of(seqs: list[tuple[int, int]]) -> StepShape:
    """A step of sequences given as (tokens already cached, new tokens), as calibrate's grid."""
    return StepShape(tuple(n for _, n in seqs), tuple(s + n for s, n in seqs), len(seqs))


def test_calibration_fit_recovers_known_step_costs():
    """Step times made from known coefficients (model time on the grid and in engine runs,
    overhead in engine runs) are fitted back to those coefficients, with zero error."""
    from kvflow.sim.calibrate import calibration_grid, fit_step_costs

    model_truth = LinearCostModel({"step": 2e-3, "tokens": 1e-4, "seqs": 5e-5,
                                   "attention_pairs": 2e-9, "context_tokens": 1e-6,
                                   "first_chunks": 0.0})
    overhead_truth = LinearCostModel({"step": 1e-3, "tokens": 2e-6, "seqs": 3e-5,
                                      "attention_pairs": 0.0, "context_tokens": 0.0,
                                      "first_chunks": 0.0})
    grid = [shape_of(seqs) for _, seqs in calibration_grid(1024, 32, 512)]
    runs = [shape_of([(ctx, 1)] * b) for b in (1, 3, 7, 20) for ctx in (40, 300)]
    runs += [shape_of([(0, 200)] + [(90, 1)] * 5), shape_of([(128, 128), (30, 1)])]
    cost, model_only, overhead = fit_step_costs(
        [(sh, model_truth.step_time_s(sh)) for sh in grid],
        [(sh, model_truth.step_time_s(sh), overhead_truth.step_time_s(sh)) for sh in runs])
    for name, value in model_truth.coefficients.items():
        assert model_only.coefficients[name] == pytest.approx(value, rel=1e-6, abs=1e-15), name
        both = value + overhead_truth.coefficients[name]
        assert cost.coefficients[name] == pytest.approx(both, rel=1e-6, abs=1e-15), name
    assert overhead == pytest.approx({k: overhead_truth.coefficients[k]
                                      for k in ("step", "tokens", "seqs")}, rel=1e-6)


def test_slowdown_bisection_meets_its_target_and_widens_its_bracket():
    """The served calibration's bisection, on a known monotone E2E(factor): it returns a
    bracket [lo, hi] with E2E(lo) < target <= E2E(hi), narrower than its tolerance, starting
    from [0.5, 2] and widening when the target lies outside."""
    from kvflow.sim.served import fit_slowdown

    def e2e(factor: float) -> float:
        return 0.2 + 3.0 * factor

    for true_factor in (1.37, 0.5, 2.0, 0.1, 7.5):
        fit = fit_slowdown(e2e, e2e(true_factor))
        lo, hi = fit["slowdown_bracket"]
        assert fit["bracket_mean_e2e_s"] == [e2e(lo), e2e(hi)]
        assert e2e(lo) < e2e(true_factor) <= e2e(hi), true_factor
        assert hi - lo <= 1e-4 * hi and lo <= fit["slowdown"] <= hi
        assert fit["slowdown"] == pytest.approx(true_factor, rel=1e-4)
        assert fit["engine_only_mean_e2e_s"] == e2e(1.0)
    with pytest.raises(ValueError, match="no step-cost factor"):
        fit_slowdown(lambda _factor: 1.0, 2.0)  # E2E that no factor changes


def test_slowdown_bisection_on_the_simulator_finds_a_known_slowdown():
    """The E2E the served calibration bisects on: the simulator's mean E2E with every step
    cost scaled. A target simulated at a known factor is met, and that factor found (to 1%:
    as the factor moves, steps shift against arrivals and the batches change, so E2E grows
    in small steps, not smoothly, and can cross the target at a nearby factor)."""
    from kvflow.sim.served import fit_slowdown
    from kvflow.sim.simulator import simulate

    specs = random_workload(30, 120, 24, 6.0, 1.0, seed=3, range_ratio=0.5)
    cost = LinearCostModel({"step": 4e-3, "tokens": 1e-4, "seqs": 2e-4, "attention_pairs": 0.0,
                            "context_tokens": 1e-6, "first_chunks": 1e-3})
    sched = EngineOptions(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)

    def e2e(factor: float) -> float:
        scaled = LinearCostModel({k: v * factor for k, v in cost.coefficients.items()})
        timings = simulate(specs, scaled, sched, num_blocks=400, block_size=16).timings
        return sum(t.e2e_s for t in timings) / len(timings)

    target = e2e(1.3)
    fit = fit_slowdown(e2e, target)
    lo, hi = fit["slowdown_bracket"]
    assert fit["bracket_mean_e2e_s"][0] < target <= fit["bracket_mean_e2e_s"][1]
    assert fit["slowdown"] == pytest.approx(1.3, rel=0.01)
    assert fit["fitted_mean_e2e_s"] == pytest.approx(target, rel=1e-3)


@pytest.mark.slow
def test_calibrate_runs_on_the_real_engine(calibrated):
    """A smoke test: the real calibration writes a complete, usable model. How well it fits
    this machine is a measurement, reported in its file (and docs/simulator.md), not judged
    here: it depends on how busy the machine is."""
    data = json.loads(calibrated.read_text())
    coef, meta = data["coefficients"], data["meta"]
    assert set(coef) == set(LINEAR_FEATURES)
    assert all(math.isfinite(v) and v >= 0 for v in coef.values())
    names = [g["name"] for g in meta["grid"]]
    assert "prefill 512" in names and "decode b=32 ctx=256" in names
    assert all(g["measured_ms"] > 0 and math.isfinite(g["fitted_ms"]) for g in meta["grid"])
    assert sum(g["fitted_ms"] for g in meta["grid"]) > 0  # a fit that says steps cost time
    for key in ("grid_fit_error", "engine_run_error", "held_out_error"):
        assert set(meta[key]) == {"mean_abs_rel", "max_abs_rel", "total_time_rel"}, key
        assert all(math.isfinite(v) and v >= 0 for v in meta[key].values()), key
    assert meta["engine_run_steps"] > 0 and meta["held_out_steps"] > 0
    assert set(meta["overhead_coefficients"]) == {"step", "tokens", "seqs"}
    LinearCostModel.load(calibrated)  # and it loads back


@pytest.mark.slow
def test_served_calibration_runs_and_meets_its_own_target(calibrated, calibration_engine):
    """A smoke test of the served calibration through tritonserver. Whatever this machine's
    slowdown, the factor found brackets the served mean E2E in simulation."""
    pytest.importorskip("tritonclient.grpc")
    from kvflow.sim.served import served_slowdown

    cost = LinearCostModel.load(calibrated)
    served = served_slowdown(calibration_engine, cost, rate=4.0,
                             progress=print, workload="random", num_requests=10)
    assert served["requests"] == 10 and served["workload"] == "random"
    real = served["real_mean_e2e_s"]
    assert math.isfinite(real) and real > 0
    lo, hi = served["slowdown_bracket"]
    assert 0 < lo <= served["slowdown"] <= hi and hi - lo <= 1e-4 * hi
    e2e_lo, e2e_hi = served["bracket_mean_e2e_s"]
    assert e2e_lo < real <= e2e_hi


@pytest.mark.slow
def test_simulate_with_a_calibrated_model(calibrated, tmp_path):
    assert run_cli("simulate", "--cost", str(calibrated), "--num-kv-blocks", "400",
                   "--workload", "random", "--num-prompts", "20", "--input-len", "64",
                   "--output-len", "16", "--max-model-len", "1024", "--out",
                   str(tmp_path), "--no-progress") == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["cost_model"] == "calibrated"
    assert report["summary"]["completed"] == 20


@pytest.mark.slow
def test_validate_runs_the_real_server_and_the_simulator_on_the_same_requests(
        calibrated, calibration_engine, tmp_path):
    pytest.importorskip("tritonclient.grpc")
    assert run_cli("simulate", "validate", "--engine", str(calibration_engine),
                   "--cost", str(calibrated), "--workload", "random", "--num-prompts", "8",
                   "--input-len", "48", "--output-len", "8", "--request-rate", "4",
                   "--max-model-len", "512",
                   "--out", str(tmp_path), "--no-progress") == 0
    result = json.loads((tmp_path / "validate.json").read_text())
    assert set(result["errors"]) >= {"mean TTFT", "mean TPOT", "output throughput"}
    real = json.loads((tmp_path / "real" / "report.json").read_text())
    sim = json.loads((tmp_path / "sim" / "report.json").read_text())
    # The same requests: the same prompt and output token counts, request by request.
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in real["requests"]] == \
        [(r["prompt_tokens"], r["output_tokens"]) for r in sim["requests"]]
    assert real["summary"]["completed"] == sim["summary"]["completed"] == 8
    assert "error vs server" in (tmp_path / "summary.md").read_text()
    engine_alone = json.loads((tmp_path / "engine_alone" / "report.json").read_text())
    assert engine_alone["summary"]["completed"] == 8
    assert set(result["errors_vs_engine_alone"]) >= {"mean TTFT", "mean TPOT"}
    # The two step timelines, side by side: the same requests, each ended once.
    from kvflow.observability.trace_summary import load

    for part, source, expected in (("real", "engine", 9), ("sim", "simulator", 8)):
        doc = load(tmp_path / part / "steps.json")  # real: the warm-up request too
        assert doc["otherData"]["source"] == source
        ends = [e for e in doc["traceEvents"] if e["name"] == "finished"]
        assert len(ends) == expected, part
    assert "Simulator: `kvflow trace summarize" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "timelines.png").stat().st_size > 0


@pytest.mark.slow
def test_the_tenants_workload_reports_fairness_and_slo_admission_refuses(tmp_path):
    out = tmp_path / "sim"
    assert run_cli("simulate", "--workload", "tenants", "--num-prompts", "120",
                   "--request-rate", "40", "--policy", "fair", "--max-queue-delay-ms", "200",
                   "--out", str(out), "--no-progress") == 0
    report = json.loads((out / "report.json").read_text())
    tenants = report["config"]["simulation"]["tenants"]
    assert set(tenants) >= {"jain_index", "light_ttft_ms", "longest_wait_ms",
                            "not_served_fraction", "fair_share_ratio"}
    assert set(tenants["fair_share_ratio"]) == {"heavy", *(f"light-{k}" for k in range(4))}
    # Twice the capacity with a 200 ms bound on the predicted wait: some are refused at once.
    assert 0 < report["summary"]["failed"] < 120
    assert tenants["not_served_fraction"] == report["summary"]["failed"] / 120
    assert report["config"]["simulation"]["scheduler"]["policy"] == "fair"
