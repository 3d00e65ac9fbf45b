"""`kvflow bench serve` end to end against the real server: a report with every field, every
failed request named, and a client that survives connections the server closed while idle."""

from __future__ import annotations

import json
import socket

import pytest

pytest.importorskip("tritonclient.grpc")

# SLOs no run can miss (about 11 days), so that what the goodput and sustained-rate checks
# see does not depend on how fast this machine is.
NEVER_MISSED_MS = "1e9"


@pytest.mark.slow
def test_short_bench_serve_writes_a_complete_report(triton_server, default_engines, tmp_path):
    from kvflow.cli import make_parser

    out = tmp_path / "report"
    args = make_parser().parse_args([
        "bench", "serve", "--url", triton_server.grpc_url,
        "--metrics-url", triton_server.metrics_url,
        "--engine", str(default_engines["onnxruntime"]), "--workload", "random",
        "--num-prompts", "8", "--input-len", "24", "--output-len", "6",
        "--request-rate", "20", "--max-concurrency", "4", "--slo",
        f"ttft_ms={NEVER_MISSED_MS},tpot_ms={NEVER_MISSED_MS}",
        "--out", str(out), "--no-progress"])
    assert args.func(args) == 0
    report = json.loads((out / "report.json").read_text())
    s = report["summary"]
    assert s["completed"] == 8 and s["failed"] == 0
    assert s["total_output_tokens"] == 8 * 6 and s["total_input_tokens"] == 8 * 24
    for key in ("request_throughput", "output_token_throughput", "total_token_throughput",
                "goodput"):
        assert s[key] > 0, key
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # every request is good
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(s[key]) == {"mean", "median", "p90", "p95", "p99"}
        assert s[key]["p99"] >= s[key]["median"] >= 0
    assert len(report["requests"]) == 8
    assert report["server_series"], "the metrics endpoint was never scraped"
    assert {"kvflow_num_requests_running", "kvflow_kv_cache_usage_ratio"} <= set(
        report["server_series"][0])
    for name in ("summary.md", "latency_cdf.png", "server_series.png"):
        assert (out / name).stat().st_size > 0, name


@pytest.mark.slow
@pytest.mark.parametrize("shut", [socket.SHUT_RDWR, socket.SHUT_RD],
                         ids=["send-fails", "status-line-fails"])
def test_a_stale_keep_alive_connection_is_retried_once_on_a_fresh_one(openai_frontend, shut):
    """A kept-alive connection that died while idle (the server closed it) fails the next
    request before any byte of its response: sent again on a fresh socket, it succeeds."""
    from kvflow.loadgen.clients import OpenAIClient

    client = OpenAIClient(openai_frontend.url)
    conn = client.connect()
    assert list(client.stream(conn, "Red, green,", 2))[-1][0] == 2
    stale = conn.sock
    assert stale is not None, "the connection is kept alive between requests"
    # SHUT_RDWR: the next send fails (BrokenPipeError); SHUT_RD: the send goes out and the
    # status line finds the socket closed (RemoteDisconnected).
    stale.shutdown(shut)
    counts = list(client.stream(conn, "Red, green,", 3))
    assert counts[-1][0] == 3 and client.stale_retries == 1
    assert conn.sock is not None and conn.sock is not stale
    client.close(conn)


def test_a_fresh_connection_that_fails_is_not_retried():
    """Only a reused connection can be stale: a refused connect is the server's answer."""
    from kvflow.loadgen.clients import OpenAIClient

    blocker = socket.socket()  # bound, never listening: connections to it are refused
    blocker.bind(("127.0.0.1", 0))
    client = OpenAIClient(f"http://127.0.0.1:{blocker.getsockname()[1]}", model="any")
    with pytest.raises(ConnectionRefusedError):
        list(client.stream(client.connect(), "Hi", 1))
    assert client.stale_retries == 0
    blocker.close()


@pytest.mark.slow
def test_failed_requests_are_reported_by_index_and_kind_and_fail_the_command(
        openai_frontend, triton_server, default_engines, tmp_path, capsys):
    """Prompts around the server's 1024-token limit: those over it (with their output) are
    refused with a 400; each is named in report.json and summary.md, the others are served,
    and the command exits 1."""
    from kvflow.cli import make_parser
    from kvflow.workloads.flags import build_workload

    out = tmp_path / "report"
    args = make_parser().parse_args([
        "bench", "serve", "--backend", "openai", "--url", openai_frontend.url,
        "--metrics-url", triton_server.metrics_url,
        "--engine", str(default_engines["onnxruntime"]), "--num-prompts", "4",
        "--input-len", "1010", "--range-ratio", "0.02", "--output-len", "2", "--seed", "0",
        "--max-concurrency", "2", "--out", str(out), "--no-progress"])
    specs, _ = build_workload(args)
    too_long = [i for i, s in enumerate(specs) if s.prompt_tokens + s.output_tokens > 1024]
    assert 0 < len(too_long) < len(specs), "the workload must mix refused and served requests"
    assert args.func(args) == 1
    report = json.loads((out / "report.json").read_text())
    s = report["summary"]
    assert s["failed"] == len(too_long) and s["completed"] == len(specs) - len(too_long)
    assert s["failed_by_kind"] == {"HTTP 400": len(too_long)}
    assert [e["index"] for e in report["errors"]] == too_long
    assert [not row["ok"] for row in report["requests"]] == [
        i in too_long for i in range(len(specs))]
    for e in report["errors"]:
        assert "1024" in e["error"], e  # the server's message, with the limit
    summary = (out / "summary.md").read_text()
    assert f"{len(too_long)} of {len(specs)} requests failed (HTTP 400: {len(too_long)})" in summary
    assert f"- request {too_long[0]}: HTTP 400: " in summary
    err = capsys.readouterr().err
    assert f"kvflow bench serve: {len(too_long)} of {len(specs)} requests failed" in err


def test_max_sustained_rate_is_the_last_rate_of_an_unbroken_run_under_the_slo():
    from kvflow.reports.sweep import max_sustained_rate

    def point(rate, p99, failed=0):
        return {"rate": rate, "summary": {"failed": failed, "ttft_ms": {"p99": p99}}}

    assert max_sustained_rate([point(2, 900), point(1, 100), point(4, 2500)], 1000) == 2
    assert max_sustained_rate([point(1, 100), point(2, 5000), point(4, 500)], 1000) == 1
    assert max_sustained_rate([point(1, 100, failed=1)], 1000) is None
    assert max_sustained_rate([point(1, None)], 1000) is None


@pytest.mark.slow
def test_compare_arguments_are_checked_by_name(default_engines, tmp_path):
    from kvflow.cli import make_parser
    from kvflow.workloads.flags import parse_rates
    from kvflow.workloads.modes import parse_modes

    assert parse_rates("inf,1,0.5,1") == [0.5, 1.0, float("inf")]
    with pytest.raises(ValueError, match="--rates"):
        parse_rates("1,fast")
    with pytest.raises(ValueError, match="--rates"):
        parse_rates("0")
    with pytest.raises(ValueError, match="--modes"):
        parse_modes("static,turbo")
    # Whole prompts need a budget of max_model_len, over this engine's 512-token steps:
    # refused by name before any server starts.
    args = make_parser().parse_args(["bench", "compare", "--engine",
                                     str(default_engines["onnxruntime"]), "--max-model-len",
                                     "1024", "--out", str(tmp_path / "never")])
    with pytest.raises(ValueError, match="max_num_batched_tokens=1024 exceeds"):
        args.func(args)
    assert not (tmp_path / "never").exists()


@pytest.mark.slow
def test_short_bench_compare_serves_each_mode_and_measures_hf(tiny_engines, tiny_models,
                                                             tmp_path):
    """Every part of `bench compare` on a tiny random-weight model (its HF folder is the
    baseline): the default model's figures are a benchmark (docs/benchmarks.md)."""
    from kvflow.cli import make_parser

    out = tmp_path / "compare"
    args = make_parser().parse_args([
        "bench", "compare", "--engine", str(tiny_engines["llama-gqa4", "onnxruntime"]),
        "--hf-model", str(tiny_models["llama-gqa4"][0]),
        "--workload", "random", "--num-prompts", "6", "--input-len", "40", "--output-len", "6",
        "--range-ratio", "0.5", "--rates", "8,inf", "--modes", "static,chunked",
        "--chunk-tokens", "32", "--max-num-seqs", "4", "--hf-batch-size", "3",
        "--max-model-len", "256",
        "--slo", f"ttft_ms={NEVER_MISSED_MS}", "--out", str(out), "--no-progress"])
    assert args.func(args) == 0
    report = json.loads((out / "compare.json").read_text())
    assert set(report["results"]) == {"static", "chunked"}
    for mode, points in report["results"].items():
        assert [p["rate"] for p in points] == [8.0, float("inf")], mode
        for p in points:
            s = p["summary"]
            assert s["completed"] == 6 and s["failed"] == 0
            assert s["total_output_tokens"] == report["hf_baseline"]["output_tokens"]
        assert report["max_sustained_rate"][mode] == float("inf")  # an SLO never missed
    engine_args = report["config"]["engine_args"]
    assert engine_args["static"]["policy"] == "static"
    assert engine_args["chunked"]["max_num_batched_tokens"] == 32
    assert not engine_args["chunked"]["enable_prefix_caching"]
    hf = report["hf_baseline"]
    assert hf["batch_size"] == 3 and hf["requests"] == 6
    # Static batches generate each batch's longest output for every member.
    assert hf["generated_tokens"] >= hf["output_tokens"]
    assert report["throughput_vs_hf"]["chunked"] > 0
    assert (out / "compare.png").stat().st_size > 0
    text = (out / "summary.md").read_text()
    assert "HF transformers `generate`" in text and "continuous + chunked prefill" in text
    # Judged again under an SLO nothing meets, from the saved points, without serving.
    again = make_parser().parse_args(["bench", "compare", "--rereport", "--out", str(out),
                                      "--slo", "ttft_ms=0.001"])
    assert again.func(again) == 0
    redone = json.loads((out / "compare.json").read_text())
    assert redone["max_sustained_rate"] == {"static": None, "chunked": None}
    assert redone["results"] == report["results"]
    assert redone["config"]["slo"] == {"ttft_ms": 0.001}
