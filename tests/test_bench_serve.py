"""`kvflow bench serve` end to end against the real server: a report with every field."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tritonclient.grpc")


def test_short_bench_serve_writes_a_complete_report(triton_server, default_engines, tmp_path):
    from kvflow.cli import make_parser

    out = tmp_path / "report"
    args = make_parser().parse_args([
        "bench", "serve", "--url", triton_server.grpc_url,
        "--metrics-url", triton_server.metrics_url,
        "--engine", str(default_engines["onnxruntime"]), "--workload", "random",
        "--num-prompts", "8", "--input-len", "24", "--output-len", "6",
        "--request-rate", "20", "--max-concurrency", "4", "--slo", "ttft_ms=60000,tpot_ms=60000",
        "--out", str(out), "--no-progress"])
    assert args.func(args) == 0
    report = json.loads((out / "report.json").read_text())
    s = report["summary"]
    assert s["completed"] == 8 and s["failed"] == 0
    assert s["total_output_tokens"] == 8 * 6 and s["total_input_tokens"] == 8 * 24
    for key in ("request_throughput", "output_token_throughput", "total_token_throughput",
                "goodput"):
        assert s[key] > 0, key
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # generous SLOs: all good
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(s[key]) == {"mean", "median", "p90", "p95", "p99"}
        assert s[key]["p99"] >= s[key]["median"] >= 0
    assert len(report["requests"]) == 8
    assert report["server_series"], "the metrics endpoint was never scraped"
    assert {"kvflow_num_requests_running", "kvflow_kv_cache_usage_ratio"} <= set(
        report["server_series"][0])
    for name in ("summary.md", "latency_cdf.png", "server_series.png"):
        assert (out / name).stat().st_size > 0, name
