"""`kvflow simulate`: reports, sweeps, calibration on a real engine, validation against the
real server."""

from __future__ import annotations

import json

import pytest

from kvflow.bench.serve import default_trace
from kvflow.cli import make_parser

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
            "kvflow_kv_cache_usage_ratio", "kv_fragmentation", "batch_tokens"} <= set(row)
    sim = report["config"]["simulation"]
    assert sim["scheduler"]["max_num_batched_tokens"] == 512
    assert sim["scheduler"]["enable_chunked_prefill"] is True
    assert 0 <= sim["kv_fragmentation_mean"] < 1
    assert report["config"]["hardware"] == "A100 80GB"
    for name in ("summary.md", "latency_cdf.png", "server_series.png", "kv_batch.png"):
        assert (out / name).stat().st_size > 0, name


@pytest.mark.skipif(not default_trace().is_file(),
                    reason=f"Azure trace not found at {default_trace()}")
def test_a_sweep_of_policies_and_rates_shows_continuous_beating_static(tmp_path):
    out = tmp_path / "sweep"
    assert run_cli("simulate", "--num-prompts", "400", "--policy", "static,continuous",
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
    from kvflow.sim.cost_model import LINEAR_FEATURES, LinearCostModel

    LinearCostModel(dict.fromkeys(LINEAR_FEATURES, 1e-3)).save(tmp_path / "c.json")
    with pytest.raises(ValueError, match="--num-kv-blocks is required"):
        run_cli("simulate", "--cost", str(tmp_path / "c.json"), "--out", str(tmp_path))


@pytest.fixture(scope="module")
def calibrated(default_engines, tmp_path_factory):
    """The default model's ONNX Runtime engine, calibrated (one repeat per grid point)."""
    out = tmp_path_factory.mktemp("calibrate") / "cost.json"
    assert run_cli("simulate", "calibrate", "--engine", str(default_engines["onnxruntime"]),
                   "--repeats", "1", "--num-requests", "12", "--output", str(out)) == 0
    return out


def test_calibrate_fits_the_real_engine(calibrated):
    data = json.loads(calibrated.read_text())
    coef, meta = data["coefficients"], data["meta"]
    assert coef["tokens"] > 0 and coef["step"] > 0  # a token and a step both cost something
    assert min(coef.values()) >= 0
    names = [g["name"] for g in meta["grid"]]
    assert "prefill 512" in names and "decode b=32 ctx=256" in names
    # The fit explains the grid it was fitted on, and the whole steps of a real engine run
    # (model + overhead) it was not fitted on as a whole.
    assert meta["grid_fit_error"]["mean_abs_rel"] < 0.25
    assert meta["engine_run_error"]["total_time_rel"] < 0.25


def test_served_calibration_reproduces_the_served_mean_e2e(calibrated, default_engines):
    pytest.importorskip("tritonclient.grpc")
    from kvflow.sim.calibrate import served_slowdown
    from kvflow.sim.cost_model import LinearCostModel

    cost = LinearCostModel.load(calibrated)
    served = served_slowdown(default_engines["onnxruntime"], cost, rate=4.0,
                             progress=print, workload="random", num_requests=10)
    assert served["requests"] == 10 and 0.5 < served["slowdown"] < 2.0
    # The factor found by bisection makes the simulated mean E2E the served one.
    assert served["fitted_mean_e2e_s"] == pytest.approx(served["real_mean_e2e_s"], rel=0.02)


def test_simulate_with_a_calibrated_model(calibrated, tmp_path):
    assert run_cli("simulate", "--cost", str(calibrated), "--num-kv-blocks", "400",
                   "--workload", "random", "--num-prompts", "20", "--input-len", "64",
                   "--output-len", "16", "--max-model-len", "1024", "--out",
                   str(tmp_path), "--no-progress") == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["cost_model"] == "calibrated"
    assert report["summary"]["completed"] == 20


def test_validate_runs_the_real_server_and_the_simulator_on_the_same_requests(
        calibrated, default_engines, tmp_path):
    pytest.importorskip("tritonclient.grpc")
    assert run_cli("simulate", "validate", "--engine", str(default_engines["onnxruntime"]),
                   "--cost", str(calibrated), "--workload", "random", "--num-prompts", "8",
                   "--input-len", "48", "--output-len", "8", "--request-rate", "4",
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
