"""The OpenAI-compatible frontend (``kvflow openai``) in front of a real tritonserver, with the
official ``openai`` package as the client (plain HTTP where a test needs the raw socket)."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from tests.helpers import (  # noqa: E402
    http_post,
    metric,
    scrape,
    settled_generation_tokens,
    wait_for,
    wait_idle,
)

MODEL = "smollm2-135m-instruct"
GREEDY = {"temperature": 0.0, "max_tokens": 12}


@pytest.fixture(scope="module")
def tokenizer(default_engines):
    from kvflow.text.tokenizer import EngineTokenizer

    return EngineTokenizer(default_engines["onnxruntime"])


def triton_generate(server, body: dict) -> dict:
    status, text = http_post(server, "/v2/models/kvflow/generate",
                             {"exclude_input_in_output": True, **body})
    assert status == 200, text
    return json.loads(text)


# --- against the real servers ---------------------------------------------------------------

@pytest.mark.slow
def test_models_lists_the_engine_by_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.slow
def test_greedy_completion_equals_triton_generate(client, triton_server, tokenizer):
    prompt = "The three primary colours are"
    want = triton_generate(triton_server, {"text_input": prompt, "sampling_parameters":
                                           json.dumps({**GREEDY, "ignore_eos": True})})
    got = client.completions.create(model=MODEL, prompt=prompt, extra_body={"ignore_eos": True},
                                    **GREEDY)
    assert got.choices[0].text == want["text_output"]
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert got.usage.completion_tokens == 12
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12
    # Token ids as the prompt: the same tokens, the same completion.
    by_ids = client.completions.create(model=MODEL, prompt=tokenizer.encode(prompt),
                                       extra_body={"ignore_eos": True}, **GREEDY)
    assert by_ids.choices[0].text == want["text_output"]
    # Streamed: the deltas add up to the same text.
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                            extra_body={"ignore_eos": True}, **GREEDY))
    assert len(chunks) > 1
    assert "".join(c.choices[0].text for c in chunks) == want["text_output"]
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.slow
def test_greedy_chat_equals_triton_generate_with_the_chat_template(client, triton_server,
                                                                   tokenizer):
    question = "Name a planet."
    want = triton_generate(triton_server, {"text_input": question, "apply_chat_template": True,
                                           "sampling_parameters": json.dumps(GREEDY)})
    messages = [{"role": "user", "content": question}]
    got = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want["text_output"]
    assert got.usage.prompt_tokens == len(tokenizer.encode_chat(messages))
    assert got.usage.completion_tokens == want["num_output_tokens"]
    stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        want["text_output"]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == got.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.slow
def test_a_system_turn_and_text_parts_reach_the_template(client, tokenizer):
    messages = [{"role": "system", "content": "Answer in French."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                             {"type": "text", "text": " there"}]}]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    joined = [messages[0], {"role": "user", "content": "Hello there"}]
    assert got.usage.prompt_tokens == len(tokenizer.encode_chat(joined))


@pytest.mark.slow
def test_a_repeated_prompt_reports_cached_tokens(client):
    prompt = "You are a careful assistant who answers briefly. " * 8 + "What is a KV cache?"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens > 64
    assert second.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.slow
def test_n_choices_are_the_sequences_of_one_request(client):
    got = client.completions.create(model=MODEL, prompt="Once upon a time", n=3, max_tokens=6,
                                    temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert got.usage.completion_tokens == 18
    assert len({c.text for c in got.choices}) > 1, "the three sequences drew the same"
    one = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                    temperature=1.0, seed=4, extra_body={"ignore_eos": True})
    assert one.choices[0].text == got.choices[1].text  # choice j draws from seed + j
    streamed = ["", "", ""]
    for chunk in client.completions.create(model=MODEL, prompt="Once upon a time", n=3,
                                           max_tokens=6, temperature=1.0, seed=3, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in got.choices]
    again = client.completions.create(model=MODEL, prompt="Once upon a time", n=3,
                                      max_tokens=6, temperature=1.0, seed=3,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in got.choices]  # seeded


@pytest.mark.slow
def test_response_format_json_schema_is_followed(client):
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "rank": {"enum": ["low", "high"]}}, "required": ["city", "rank"],
        "additionalProperties": False}
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a city."}], max_tokens=40,
        temperature=1.0, seed=1, response_format={
            "type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"city", "rank"} and value["rank"] in ("low", "high")
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_logprobs_come_back_in_openai_shape(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": "Hi"}],
                                          max_tokens=4, logprobs=True, top_logprobs=2,
                                          temperature=0.0)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)  # greedy
        assert entry.bytes == list(entry.token.encode())
    comp = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=3, logprobs=1,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text
    assert lp.text_offset[0] == 0 and len(lp.top_logprobs) == 3


@pytest.mark.slow
@pytest.mark.parametrize(("kwargs", "param", "words"), [
    ({"temperature": -1.0}, "temperature", "temperature must be in [0"),
    ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
    ({"max_tokens": 5000}, "max_tokens", "max_tokens must be in [1, 1023]"),
    ({"extra_body": {"min_tokens": 10, "max_tokens": 5}}, "min_tokens", "min_tokens"),
    ({"stop": [""]}, "stop", "stop[0] must be a non-empty string"),
    ({"extra_body": {"temprature": 0.5}}, "temprature", "unknown field"),
    ({"extra_body": {"response_format": {"type": "xml"}}}, "response_format",
     "response_format must be an object whose type is"),
    ({"extra_body": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}}, "response_format", "response_format: "),
    ({"extra_body": {"guided_regex": "("}}, "guided_regex", "guided_regex: "),
])
def test_a_bad_field_is_a_400_naming_it(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", **kwargs)
    error = info.value.body
    assert words in error["message"] and error["param"] == param
    assert error["type"] == "invalid_request_error"
    # And the server keeps serving.
    assert client.completions.create(model=MODEL, prompt="OK", max_tokens=1).choices


@pytest.mark.slow
def test_bad_messages_and_bodies(client, openai_frontend):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard",
                                                               "content": "x"}])
    assert "messages[0].role must be one of system, user, assistant" in \
        info.value.body["message"]
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi " * 3000)
    assert "max_model_len" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="hi")
    assert info.value.body["code"] == "model_not_found"
    req = urllib.request.Request(openai_frontend.url + "/v1/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http_error:
        urllib.request.urlopen(req, timeout=60)
    assert http_error.value.code == 400
    assert "not valid JSON" in json.loads(http_error.value.read())["error"]["message"]


def _raw_post(frontend, body: dict, timeout: float = 300):
    host, port = frontend.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    return conn


@pytest.mark.slow
def test_a_disconnect_mid_stream_cancels_and_frees_the_kv_cache(openai_frontend, triton_server):
    wait_idle(triton_server)
    before = scrape(triton_server)
    conn = _raw_post(openai_frontend, {"prompt": "Write a very long story.", "stream": True,
                                       "max_tokens": 600, "ignore_eos": True})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    wait_for(lambda: metric(scrape(triton_server), "kvflow_kv_cache_usage_ratio") > 0,
             what="KV in use")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert settled_generation_tokens(triton_server, before) < 600  # freed by the cancel


@pytest.mark.slow
def test_a_client_gone_from_a_whole_response_cancels_it(openai_frontend, triton_server):
    """Triton never reports a dropped non-streaming HTTP generate (issue 15, item 11); the
    frontend watches its own client and cancels the gRPC stream."""
    wait_idle(triton_server)
    before = scrape(triton_server)
    conn = _raw_post(openai_frontend, {"prompt": "Write a very long story.", "max_tokens": 600,
                                       "ignore_eos": True})
    wait_for(lambda: metric(scrape(triton_server), "kvflow_num_requests_running") > 0,
             what="the request running")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert settled_generation_tokens(triton_server, before) < 600


@pytest.mark.slow
def test_thirty_two_concurrent_streams_all_finish_batched(openai_frontend, triton_server):
    wait_idle(triton_server)
    before = scrape(triton_server)

    async def run() -> list[list]:
        aclient = openai.AsyncOpenAI(base_url=openai_frontend.url + "/v1", api_key="unused",
                                     max_retries=0, timeout=300)

        async def one(i: int) -> list:
            stream = await aclient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}],
                max_tokens=16, temperature=0.0, stream=True,
                extra_body={"ignore_eos": True})
            return [c async for c in stream]

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert len(results) == 32
    for chunks in results:
        assert chunks[-1].choices[0].finish_reason == "length"
    assert settled_generation_tokens(triton_server, before) == 32 * 16
    after = scrape(triton_server)
    steps = (metric(after, "kvflow_iteration_num_seqs_count")
             - metric(before, "kvflow_iteration_num_seqs_count"))
    single = (metric(after, "kvflow_iteration_num_seqs_bucket", le="1")
              - metric(before, "kvflow_iteration_num_seqs_bucket", le="1"))
    assert steps - single >= 1, "no step ran more than one sequence"
    assert steps < 32 * 16  # shared steps: fewer than one per token


@pytest.mark.slow
def test_health_and_metrics_pass_through(openai_frontend, client):
    with urllib.request.urlopen(openai_frontend.url + "/health", timeout=60) as resp:
        assert resp.status == 200
    client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    text = urllib.request.urlopen(openai_frontend.url + "/metrics", timeout=60).read().decode()
    assert "kvflow_kv_cache_usage_ratio" in text  # the server's own series
    assert 'kvflow_openai_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'kvflow_openai_requests_total{endpoint="/v1/completions",status="400"}' in text


@pytest.mark.slow
def test_the_frontend_is_a_stateless_pool_of_servers(triton_server, tmp_path):
    """Two URLs (here the same server twice) and a name of its own: each request goes to one
    server; nothing else changes."""
    from kvflow.openai_api import FrontendConfig, FrontendProcess
    from kvflow.utils.procs import free_port

    cfg = FrontendConfig((triton_server.grpc_url, triton_server.grpc_url), port=free_port(),
                         served_model_name="my-model")
    with FrontendProcess(cfg, log_path=tmp_path / "log") as frontend:
        pooled = openai.OpenAI(base_url=frontend.url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in pooled.models.list().data] == ["my-model"]
        texts = {pooled.completions.create(model="my-model", prompt="Red, green,",
                                           temperature=0.0, max_tokens=4).choices[0].text
                 for _ in range(4)}
        assert len(texts) == 1
    # Stopped: nothing listens on its port any more.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", cfg.port), timeout=2).close()


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_drives_the_openai_api(openai_frontend, triton_server, default_engines,
                                           tmp_path, endpoint):
    """The same load generator through the OpenAI door: every token counted, on time order."""
    from kvflow.cli import make_parser

    out = tmp_path / "report"
    args = make_parser().parse_args([
        "bench", "serve", "--backend", "openai", "--endpoint", endpoint,
        "--url", openai_frontend.url, "--metrics-url", triton_server.metrics_url,
        "--engine", str(default_engines["onnxruntime"]), "--num-prompts", "4",
        "--input-len", "16", "--output-len", "5", "--max-concurrency", "2",
        "--out", str(out), "--no-progress"])
    assert args.func(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["backend"] == f"openai-{endpoint}"
    s = report["summary"]
    assert s["completed"] == 4 and s["failed"] == 0 and s["total_output_tokens"] == 20
    if endpoint == "completions":  # chat adds the template's tokens to every prompt
        assert s["total_input_tokens"] == 4 * 16
    for row in report["requests"]:
        assert row["ttft_s"] <= row["e2e_s"]


@pytest.mark.slow
def test_a_server_that_is_down_is_passed_over_and_alone_is_a_503(triton_server, tmp_path):
    from kvflow.openai_api import FrontendConfig, FrontendProcess
    from kvflow.utils.procs import free_port

    blocker = socket.socket()  # bound, never listening: connections to it are refused
    blocker.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{blocker.getsockname()[1]}"
    cfg = FrontendConfig((dead, triton_server.grpc_url), port=free_port())
    with FrontendProcess(cfg, log_path=tmp_path / "pool.log") as frontend:
        pooled = openai.OpenAI(base_url=frontend.url + "/v1", api_key="x", max_retries=0)
        for _ in range(4):  # a request the dead server fails goes to the other one
            reply = pooled.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
            assert reply.usage.completion_tokens == 1
        pooled.close()
    alone = FrontendConfig((dead,), port=free_port(), served_model_name=MODEL)
    with FrontendProcess(alone, log_path=tmp_path / "alone.log").start(
            require_backend=False) as frontend:
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(frontend.url + "/health", timeout=60)
        assert health.value.code == 503
        lonely = openai.OpenAI(base_url=frontend.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            lonely.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        assert info.value.status_code == 503 and info.value.body["code"] == "backend_unavailable"
        assert info.value.response.headers["retry-after"] == "1"
        lonely.close()
    blocker.close()


@pytest.mark.slow
def test_timeout_ms_reaches_the_engine_and_a_request_ends_with_timeout(client):
    """``timeout_ms`` is a vLLM-style extra that the backend's SamplingParams validates; past it
    the choice ends with ``timeout`` and the text it had."""
    got = client.completions.create(model=MODEL, prompt="Count to a thousand:", max_tokens=900,
                                    temperature=0.0,
                                    extra_body={"ignore_eos": True, "timeout_ms": 2000})
    choice = got.choices[0]
    assert choice.finish_reason == "timeout"
    assert 0 < got.usage.completion_tokens < 900
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"timeout_ms": 0})
    assert "timeout_ms must be in [1, 604800000]" in info.value.message
