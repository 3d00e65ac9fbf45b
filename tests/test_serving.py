"""kvflow behind a real tritonserver: gRPC streaming, HTTP generate, concurrency, cancellation,
bad input, metrics. The clients are tritonclient and plain HTTP."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

tritonclient = pytest.importorskip("tritonclient.grpc")

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.client import build_inputs, stream_generate  # noqa: E402
from tests.helpers import (  # noqa: E402
    DEADLINE_S,
    http_post,
    metric,
    scrape,
    settled_generation_tokens,
    wait_for,
    wait_idle,
)

pytestmark = pytest.mark.slow  # a real tritonserver serving the default model

GREEDY = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}


def settled_scrape(server, before: dict[str, float], finished: int) -> dict[str, float]:
    """Metrics once ``finished`` more requests are counted (they are published off the engine
    loop, a moment after the responses)."""
    def counted() -> bool:
        now = scrape(server)
        return (metric(now, "kvflow_request_success_total")
                - metric(before, "kvflow_request_success_total")) >= finished

    wait_for(counted, what=f"{finished} finished requests in the metrics")
    return scrape(server)


def test_streamed_greedy_equals_offline_generate(triton_server, default_engines):
    prompt = "The three most important inventions are"
    chunks = list(stream_generate(triton_server.grpc_url, prompt, GREEDY))
    served = "".join(c.text for c in chunks)
    assert len(chunks) > 3, "the response was not streamed"
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_output_tokens == 24
    # fp32 matmuls, as the session server runs them: the 4-bit paths are not batch-invariant.
    with LLM(default_engines["onnxruntime"], max_model_len=1024,
             quantized_matmul="fp32") as llm:
        offline = llm.generate([prompt], SamplingParams(**GREEDY))[0]
    assert served == offline.text
    assert chunks[-1].num_input_tokens == offline.num_prompt_tokens


def test_http_generate_and_generate_stream(triton_server):
    status, body = http_post(triton_server, "/v2/models/kvflow/generate",
                             {"text_input": "Hello, my name is", "max_tokens": 8,
                              "temperature": 0.0})
    assert status == 200, body
    out = json.loads(body)
    assert out["text_output"].startswith("Hello, my name is")  # echoed unless excluded
    assert out["finish_reason"] == "length" and out["num_output_tokens"] == 8

    status, body = http_post(triton_server, "/v2/models/kvflow/generate_stream",
                             {"text_input": "Hello, my name is", "max_tokens": 8,
                              "temperature": 0.0, "stream": True})
    assert status == 200, body
    events = [json.loads(line[len("data: "):]) for line in body.splitlines()
              if line.startswith("data: ")]
    assert len(events) >= 2
    assert "".join(e["text_output"] for e in events) == out["text_output"][len(
        "Hello, my name is"):]
    assert events[-1]["finish_reason"] == "length"


def test_thirty_two_concurrent_streaming_clients(triton_server):
    wait_idle(triton_server)
    before = scrape(triton_server)
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(32)

    def client(i: int) -> None:
        try:
            start.wait(DEADLINE_S)  # all 32 threads up before any sends
            results[i] = list(stream_generate(
                triton_server.grpc_url, f"Question {i}: what is {i} plus {i}? Answer:",
                {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not errors, errors[:3]
    assert len(results) == 32
    for chunks in results.values():
        assert chunks[-1].finish_reason == "length"
        assert chunks[-1].num_output_tokens == 16
        assert len(chunks) > 1, "the response was not streamed"
    after = settled_scrape(triton_server, before, 32)
    assert (metric(after, "kvflow_generation_tokens_total")
            - metric(before, "kvflow_generation_tokens_total")) == 32 * 16


def test_requests_held_running_together_share_every_step(triton_server):
    """Batching, shown without relying on speed: 32 requests too long to finish (or to outgrow
    the KV pool) within many steps are held open until every one has streamed a token, so at
    that moment all 32 were running; then they are cancelled. The server's batch histogram
    must have seen steps of all 32 (more than 16)."""
    wait_idle(triton_server)
    before = scrape(triton_server)
    client = tritonclient.InferenceServerClient(triton_server.grpc_url)
    first_tokens: set[str] = set()
    errors: list[str] = []
    lock = threading.Lock()

    def callback(result, error):
        with lock:
            if error is not None:
                errors.append(str(error))
            else:
                first_tokens.add(result.get_response().id)

    # 32 x (~12 prompt + 100 output) tokens fit the pool (256 MiB: 364 blocks of 16) whole:
    # no request can be preempted, and none finishes before 100 steps.
    params = {"max_tokens": 100, "temperature": 0.0, "ignore_eos": True}
    client.start_stream(callback=callback)
    for i in range(32):
        client.async_stream_infer("kvflow", build_inputs(f"Count to a hundred, {i}:", params),
                                  request_id=f"held-{i}")
    try:
        wait_for(lambda: len(first_tokens) == 32 or errors, what="a token from all 32")
        assert not errors, errors[:3]

        def steps_over_16() -> float:
            now = scrape(triton_server)
            return ((metric(now, "kvflow_iteration_num_seqs_count")
                     - metric(before, "kvflow_iteration_num_seqs_count"))
                    - (metric(now, "kvflow_iteration_num_seqs_bucket", le="16")
                       - metric(before, "kvflow_iteration_num_seqs_bucket", le="16")))

        # Every request is running, and stays so until cancelled: the next step holds all 32.
        wait_for(lambda: steps_over_16() >= 1, what="a step of more than 16 sequences")
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    assert settled_generation_tokens(triton_server, before) < 32 * 100  # cancelled, not done
    assert metric(scrape(triton_server), "kvflow_num_preemptions_total") == metric(
        before, "kvflow_num_preemptions_total"), "the held requests did not fit the KV pool"


def test_cancelling_mid_stream_frees_the_kv_cache(triton_server):
    wait_idle(triton_server)
    before = scrape(triton_server)
    client = tritonclient.InferenceServerClient(triton_server.grpc_url)
    got = threading.Event()
    client.start_stream(callback=lambda result, error: got.set())
    client.async_stream_infer("kvflow", build_inputs(
        "Write a very long story about a dragon.",
        {"max_tokens": 600, "temperature": 0.0, "ignore_eos": True}), request_id="cancel-me")
    assert got.wait(DEADLINE_S), "no token arrived"
    wait_for(lambda: metric(scrape(triton_server), "kvflow_kv_cache_usage_ratio") > 0,
             what="KV in use")
    client.stop_stream(cancel_requests=True)
    client.close()
    # Freed by the cancel, not by running to its end.
    assert settled_generation_tokens(triton_server, before) < 600


BAD_REQUESTS = [
    ({"stream": False}, "text_input"),
    ({"text_input": ""}, "text_input must not be empty"),
    ({"text_input": "hi " * 3000}, "max_model_len"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens must be in [1, 1023]"),
    ({"text_input": "hi", "max_tokens": 5000}, "max_tokens must be in [1, 1023]"),
    ({"text_input": "hi", "sampling_parameters": "{not json"}, "not valid JSON"),
    ({"text_input": "hi", "sampling_parameters": '{"beam_width": 4}'}, "unknown key"),
    ({"text_input": "hi", "sampling_parameters": '{"top_p": 1.5}'}, "top_p"),
    ({"text_input": "hi", "sampling_parameters": '{"max_tokens": "many"}'}, "max_tokens"),
    ({"text_input": "hi", "temperature": -1.0}, "temperature"),
    ({"text_input": "hi", "top_k": -5}, "top_k"),
    # The wrong JSON type for an INT32 input: Triton's HTTP front end refuses it itself.
    ({"text_input": "hi", "max_tokens": "ten"}, "JSON non-signed-integer as signed-integer"),
]


@pytest.mark.parametrize(("body", "message"), BAD_REQUESTS)
def test_bad_input_gets_an_error_and_service_continues(triton_server, body, message):
    status, text = http_post(triton_server, "/v2/models/kvflow/generate", body)
    assert status >= 400, text
    assert message in text
    status, text = http_post(triton_server, "/v2/models/kvflow/generate",
                             {"text_input": "OK", "max_tokens": 2})
    assert status == 200, text


def test_invalid_utf8_and_wrong_tensor_types_over_grpc(triton_server):
    client = tritonclient.InferenceServerClient(triton_server.grpc_url)
    results = []
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    bad = tritonclient.InferInput("text_input", [1], "BYTES")
    bad.set_data_from_numpy(np.array([b"\xff\xfe bad"], dtype=np.object_))
    client.async_stream_infer("kvflow", [bad])
    wait_for(lambda: results, what="an answer to invalid UTF-8")
    assert results[0][1] is not None and "not valid UTF-8" in str(results[0][1])
    wrong = tritonclient.InferInput("text_input", [1], "INT32")
    wrong.set_data_from_numpy(np.array([5], dtype=np.int32))
    client.async_stream_infer("kvflow", [wrong])
    wait_for(lambda: len(results) >= 2, what="an answer to a wrongly typed input")
    assert results[1][1] is not None and re.search("(?i)data.?type", str(results[1][1]))
    client.stop_stream()
    client.close()


def test_queue_overflow_is_rejected_at_once(triton_server):
    wait_idle(triton_server)
    before = scrape(triton_server)
    client = tritonclient.InferenceServerClient(triton_server.grpc_url)
    errors, done = [], threading.Event()
    count = [0]

    def callback(result, error):
        count[0] += 1
        if error is not None:
            errors.append(str(error))
        if count[0] >= 1 and errors:
            done.set()

    client.start_stream(callback=callback)
    for i in range(90):  # the server keeps at most 40 waiting
        client.async_stream_infer("kvflow", build_inputs(
            f"Story {i}:", {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True}),
            request_id=f"flood-{i}")
    assert done.wait(DEADLINE_S), "no request was rejected"
    rejections = [e for e in errors if "waiting queue is full (max_waiting_requests=40)" in e]
    assert rejections, errors[:3]
    client.stop_stream(cancel_requests=True)
    client.close()
    # NOTE: the series are published by the backend's metrics thread, after the responses:
    # wait until they show the rejections the client saw (an idle view alone may be the one
    # from before the flood), then read them.
    wait_for(lambda: metric(scrape(triton_server), "kvflow_request_rejected_total")
             - metric(before, "kvflow_request_rejected_total") >= len(rejections),
             what="the rejections counted in kvflow_request_rejected_total")
    generated = settled_generation_tokens(triton_server, before)
    rejected = (metric(scrape(triton_server), "kvflow_request_rejected_total")
                - metric(before, "kvflow_request_rejected_total"))
    assert len(rejections) <= rejected < 90
    # The accepted requests were cancelled, not run to their 300 tokens.
    assert generated < (90 - rejected) * 300


FAMILIES = [
    "kvflow_time_to_first_token_seconds", "kvflow_inter_token_latency_seconds",
    "kvflow_e2e_request_latency_seconds", "kvflow_request_queue_time_seconds",
    "kvflow_num_requests_running", "kvflow_num_requests_waiting", "kvflow_kv_cache_usage_ratio",
    "kvflow_prompt_tokens_total", "kvflow_generation_tokens_total",
    "kvflow_num_preemptions_total", "kvflow_request_rejected_total",
    "kvflow_prefix_cache_queries_total", "kvflow_prefix_cache_hits_total",
    "kvflow_engine_steps_total", "kvflow_engine_step_seconds_total",
    "kvflow_serving_seconds_total",
]


def test_metrics_expose_every_family_consistently(triton_server, default_engines):
    from kvflow.build.engine_config import EngineConfig

    block_size = EngineConfig.load(default_engines["onnxruntime"]).limits.block_size
    wait_idle(triton_server)
    before = scrape(triton_server)
    outs = [list(stream_generate(triton_server.grpc_url, p, {"max_tokens": n, "temperature": 0,
                                                             "ignore_eos": True}))[-1]
            for p, n in (("One", 5), ("Two three", 7))]
    after = settled_scrape(triton_server, before, 2)
    text = urllib.request.urlopen(triton_server.metrics_url, timeout=DEADLINE_S).read().decode()
    for family in FAMILIES:
        assert re.search(rf"^# TYPE {family} ", text, re.M), family

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("kvflow_prompt_tokens_total") == sum(o.num_input_tokens for o in outs)
    assert delta("kvflow_generation_tokens_total") == 12
    assert delta("kvflow_request_success_total") == 2
    assert delta("kvflow_time_to_first_token_seconds_count") == 2
    assert delta("kvflow_e2e_request_latency_seconds_count") == 2
    assert delta("kvflow_inter_token_latency_seconds_count") == 4 + 6
    assert delta("kvflow_prefix_cache_queries_total") == sum(o.num_input_tokens for o in outs)
    # A prompt can reuse only full blocks short of its last token: none, for these two.
    assert all(o.num_input_tokens <= block_size for o in outs)
    assert delta("kvflow_prefix_cache_hits_total") == 0
    assert metric(after, "kvflow_num_requests_running") == 0
    # One after the other, each prompt in one step: a step per output token (5 + 7), each of
    # one sequence. Each step and the serving around it take some time (how much is this
    # machine's business: benchmarks/triton_overhead.py reports it).
    assert delta("kvflow_engine_steps_total") == 5 + 7
    assert delta("kvflow_iteration_num_seqs_count") == 5 + 7
    assert delta("kvflow_iteration_num_seqs_sum") == 5 + 7
    assert delta("kvflow_iteration_num_seqs_bucket", le="1") == 5 + 7
    assert delta("kvflow_engine_step_seconds_total") > 0
    assert delta("kvflow_serving_seconds_total") > 0


def test_a_repeated_prompt_reports_cached_tokens(triton_server, default_engines):
    from kvflow.build.engine_config import EngineConfig

    block_size = EngineConfig.load(default_engines["onnxruntime"]).limits.block_size
    prompt = "You are a careful assistant. " * 12 + "Question: what is a KV cache?"
    params = {"max_tokens": 4, "temperature": 0.0}
    wait_idle(triton_server)
    start = scrape(triton_server)
    first = list(stream_generate(triton_server.grpc_url, prompt, params))[-1]
    # The first request's counters settled, so that the second's delta is its own.
    before = settled_scrape(triton_server, start, 1)
    second = list(stream_generate(triton_server.grpc_url, prompt, params))[-1]
    after = settled_scrape(triton_server, before, 1)
    assert first.num_input_tokens == second.num_input_tokens > 4 * block_size
    assert first.cached_tokens == 0
    # All of the first's full prompt blocks, short of the block holding the last token.
    assert second.cached_tokens == (second.num_input_tokens - 1) // block_size * block_size
    assert (metric(after, "kvflow_prefix_cache_hits_total")
            - metric(before, "kvflow_prefix_cache_hits_total")) == second.cached_tokens
