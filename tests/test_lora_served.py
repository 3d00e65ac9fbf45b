"""LoRA adapters served: one tritonserver of the default model started with ``--lora-modules``,
the real OpenAI frontend (with an API key) in front of it, adapters made with PEFT on the
default model's HF weights. Through the ``openai`` SDK (``model=ADAPTER``), tritonclient
(``lora_name``) and Triton's HTTP generate, an adapter's greedy text is ``LLM.generate(lora=...)``'s
on the same engine (fp32 path); adapters load, serve, unload and load again over HTTP; a bad
adapter is a 400 naming the problem and nothing else changes. (Without a server:
tests/test_lora_doors.py.)"""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request

import pytest

from tests.helpers import DEADLINE_S, metric, post, scrape, wait_for

pytestmark = pytest.mark.slow  # tritonserver, the frontend, the default model

KEY = "lora-key"
FP32 = {"quantized_matmul": "fp32", "kv_cache_dtype": "fp32"}
PROMPTS = ["The capital of France is", "Here is a short poem about the sea:"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    """PEFT adapters on the default model: ``a`` (all seven projections), ``b`` (attention
    only, another rank), ``too-big`` (rank 32, over the server's max_lora_rank 16)."""
    pytest.importorskip("peft")
    from kvflow.bench.lora_adapters import hf_folder
    from kvflow.lora.synthetic import make_peft_adapter

    root = tmp_path_factory.mktemp("lora-adapters")
    hf = hf_folder("default", root)
    return {"a": str(make_peft_adapter(hf, root / "a", rank=8, alpha=16, seed=1)),
            "b": str(make_peft_adapter(hf, root / "b", rank=4, alpha=4, seed=2,
                                       targets=["q_proj", "k_proj", "v_proj", "o_proj"])),
            "too-big": str(make_peft_adapter(hf, root / "big", rank=32, targets=["q_proj"]))}


@pytest.fixture(scope="module")
def reference(default_engines, adapters) -> dict[tuple[str | None, str], str]:
    """(adapter or None, prompt) -> the greedy text of ``LLM.generate(lora=...)`` on the
    served engine, fp32 as the server runs it."""
    from kvflow import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {}
    with LLM(default_engines["onnxruntime"], lora_modules={"a": adapters["a"],
                                                           "b": adapters["b"]}, **FP32) as llm:
        for lora in (None, "a", "b"):
            for prompt, result in zip(PROMPTS, llm.generate(PROMPTS, greedy, lora=lora),
                                      strict=True):
                out[lora, prompt] = result.outputs[0].text
    for prompt in PROMPTS:  # the adapters move the model: a comparison that can fail
        assert out["a", prompt] != out[None, prompt] != out["b", prompt]
    return out


@pytest.fixture(scope="module")
def lora_server(default_engines, adapters, tmp_path_factory):
    """The default model served with adapter ``a`` from the start (max_loras 2), invariants
    checked every step, and the OpenAI frontend that wants the key KEY."""
    from kvflow.openai_api import FrontendConfig, FrontendProcess
    from kvflow.triton_backend.launcher import ServerConfig, TritonServer
    from kvflow.utils.procs import free_port

    folder = tmp_path_factory.mktemp("lora-served")
    cfg = ServerConfig.on_free_ports(default_engines["onnxruntime"],
                                     {"lora_modules": {"a": adapters["a"]}, "max_loras": 2,
                                      "debug_checks": True, **FP32}, ready_timeout_s=300,
                                     api_key=KEY)  # a keyed server loads adapters at run time
    with TritonServer(cfg, log_path=folder / "tritonserver.log") as server:
        frontend = FrontendProcess(FrontendConfig((server.grpc_url,), port=free_port(),
                                                  metrics_urls=(server.metrics_url,),
                                                  api_key=KEY),
                                   log_path=folder / "frontend.log")
        frontend.start()
        try:
            yield server, frontend
        finally:
            assert frontend.stop() == 0


@pytest.fixture(scope="module")
def sdk(lora_server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=lora_server[1].url + "/v1", api_key=KEY, max_retries=0,
                         timeout=DEADLINE_S)


def _call(frontend, path: str, body: dict | None = None, key: str | None = KEY
          ) -> tuple[int, str]:
    """POST ``body`` (GET without one) to the frontend: (status, body text)."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(frontend.url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE_S) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _complete(sdk, model: str, prompt: str) -> str:
    reply = sdk.completions.create(model=model, prompt=prompt, temperature=0.0,
                                   max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    assert reply.model == model
    return reply.choices[0].text


def test_models_lists_the_base_and_each_adapter_with_its_parent(lora_server, adapters, sdk):
    models = sdk.models.list().data
    base = models[0].id
    assert [m.id for m in models] == [base, "a"]
    card = models[1].model_dump()
    assert card["parent"] == base and card["root"] == adapters["a"]
    # The model config a Triton client reads names no path (serve.json holds them).
    server, _ = lora_server
    config = urllib.request.Request(f"http://{server.http_url}/v2/models/kvflow/config",
                                    headers={"x-api-key": KEY})
    with urllib.request.urlopen(config, timeout=DEADLINE_S) as r:
        assert adapters["a"] not in r.read().decode()


def test_openai_model_selects_the_adapter_and_equals_llm_generate(lora_server, sdk, reference):
    base = sdk.models.list().data[0].id
    for prompt in PROMPTS:
        assert _complete(sdk, "a", prompt) == reference["a", prompt]
        assert _complete(sdk, base, prompt) == reference[None, prompt]
    # The chat path and the stream select it the same way.
    chat = sdk.chat.completions.create(model="a", messages=[{"role": "user", "content": "Hi"}],
                                       temperature=0.0, max_tokens=4)
    assert chat.model == "a" and chat.choices[0].message.content
    streamed = sdk.completions.create(model="a", prompt=PROMPTS[0], temperature=0.0,
                                      max_tokens=MAX_TOKENS, stream=True,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == reference["a",
                                                                                   PROMPTS[0]]


def test_an_unknown_model_is_404_naming_what_is_served(lora_server, sdk):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.NotFoundError) as e:
        sdk.completions.create(model="nope", prompt="x", max_tokens=2)
    assert "`nope` does not exist" in str(e.value) and "`a`" in str(e.value)


def test_load_serve_unload_and_load_again_over_http(lora_server, adapters, sdk, reference):
    _, frontend = lora_server
    load = {"lora_name": "b", "lora_path": adapters["b"]}
    assert _call(frontend, "/v1/load_lora_adapter", load, key=None)[0] == 401
    assert _call(frontend, "/v1/load_lora_adapter", load) == (
        200, "Success: LoRA adapter 'b' added successfully.")
    assert [m.id for m in sdk.models.list().data][1:] == ["a", "b"]
    assert _complete(sdk, "b", PROMPTS[0]) == reference["b", PROMPTS[0]]
    assert _call(frontend, "/v1/unload_lora_adapter", {"lora_name": "b"}) == (
        200, "Success: LoRA adapter 'b' removed successfully.")
    assert [m.id for m in sdk.models.list().data][1:] == ["a"]
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.NotFoundError):
        _complete(sdk, "b", PROMPTS[0])
    status, text = _call(frontend, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 404 and "cannot be found" in text
    assert _call(frontend, "/v1/load_lora_adapter", load)[0] == 200
    assert _complete(sdk, "b", PROMPTS[1]) == reference["b", PROMPTS[1]]
    assert _call(frontend, "/v1/unload_lora_adapter", {"lora_name": "b"})[0] == 200


@pytest.mark.parametrize(("body", "words"), [
    ({"lora_name": "c", "lora_path": "/no/such/adapter"}, "/no/such/adapter"),
    ({"lora_name": "c", "lora_path": "too-big"}, "rank"),
    ({"lora_name": "a", "lora_path": "b"}, "loaded already"),
])
def test_a_bad_adapter_is_a_400_naming_the_problem_and_serving_goes_on(
        lora_server, adapters, sdk, reference, body, words):
    _, frontend = lora_server
    body = {**body, "lora_path": adapters.get(body["lora_path"], body["lora_path"])}
    status, text = _call(frontend, "/v1/load_lora_adapter", body)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert [m.id for m in sdk.models.list().data][1:] == ["a"]
    assert _complete(sdk, "a", PROMPTS[0]) == reference["a", PROMPTS[0]]


def test_unloading_an_adapter_in_use_is_refused_naming_the_request(lora_server, adapters, sdk):
    _, frontend = lora_server
    stream = sdk.completions.create(model="a", prompt=PROMPTS[1], max_tokens=400,
                                    temperature=0.0, stream=True,
                                    extra_body={"ignore_eos": True})
    next(iter(stream))  # running: its first token came
    status, text = _call(frontend, "/v1/unload_lora_adapter", {"lora_name": "a"})
    stream.close()  # the client goes: the request is aborted
    assert status == 400 and "in use by request(s)" in text, text
    assert [m.id for m in sdk.models.list().data][1:] == ["a"]

    def unloaded() -> bool:
        return _call(frontend, "/v1/unload_lora_adapter", {"lora_name": "a"})[0] == 200

    wait_for(unloaded, what="the aborted request to leave the adapter")
    assert _call(frontend, "/v1/load_lora_adapter",
                 {"lora_name": "a", "lora_path": adapters["a"]})[0] == 200


def test_tritonclient_and_http_generate_select_the_adapter_by_lora_name(lora_server, reference):
    import tritonclient.grpc as grpcclient

    from kvflow.client import build_inputs
    from kvflow.triton_backend.protocol import (
        API_KEY_HEADER,
        GRPC_API_KEY_HEADER,
        LORA_PARAMETER,
        MODEL_NAME,
    )

    server, _ = lora_server
    sampling = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)),
                        headers={GRPC_API_KEY_HEADER: KEY})
    try:
        def ask(parameters: dict, inputs: list | None = None) -> tuple:
            if inputs is None:
                inputs = build_inputs(PROMPTS[0], sampling, stream=False)
            client.async_stream_infer(MODEL_NAME, inputs, parameters=parameters)
            return answers.get(timeout=DEADLINE_S)

        result, error = ask({"lora_name": "a"})
        assert error is None and result.as_numpy("text_output")[0].decode() == reference[
            "a", PROMPTS[0]]
        # Triton's vLLM backend clients: lora_name in sampling_parameters.
        result, error = ask({}, build_inputs(PROMPTS[0], {**sampling, "lora_name": "a"},
                                             stream=False))
        assert result.as_numpy("text_output")[0].decode() == reference["a", PROMPTS[0]]
        _, error = ask({"lora_name": "nope"})
        assert error is not None and "no adapter 'nope'" in str(error)
        result, error = ask({LORA_PARAMETER: json.dumps({"op": "list"})}, [])  # no inputs
        assert error is None, error
        listed = json.loads(result.as_numpy("lora")[0])
        assert listed["enabled"] and [a["name"] for a in listed["loras"]] == ["a"]
    finally:
        client.stop_stream()
        client.close()
    status, body = post(server, {"text_input": PROMPTS[1], "lora_name": "a",
                                 "exclude_input_in_output": True,
                                 "sampling_parameters": json.dumps(sampling)},
                        headers={API_KEY_HEADER: KEY})
    assert status == 200 and body["text_output"] == reference["a", PROMPTS[1]]


def test_the_console_state_and_metrics_show_each_requests_adapter(lora_server, sdk):
    server, frontend = lora_server
    stream = sdk.completions.create(model="a", prompt=PROMPTS[0], max_tokens=400,
                                    temperature=0.0, stream=True,
                                    extra_body={"ignore_eos": True})
    next(iter(stream))
    try:
        status, text = _call(frontend, "/v1/kvflow/state")
        running = wait_for(lambda: metric(scrape(server), "kvflow_lora_requests_running",
                                          lora_name="a"), what="the adapter's running gauge")
    finally:
        stream.close()
    state = json.loads(text)["servers"][0]
    assert status == 200 and [a["name"] for a in state["loras"]] == ["a"]
    assert "a" in [r["lora_name"] for r in state["requests"]]
    assert running == 1
    assert metric(scrape(server), "kvflow_lora_swaps_total") >= 1  # into its slot at least once


def test_a_keyless_frontend_refuses_to_load_adapters_at_run_time(openai_frontend):
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "x"})):
        status, text = _call(openai_frontend, path, body, key=None)
        assert status == 403 and "--api-key" in json.loads(text)["error"]["message"]


def test_without_lora_a_load_command_says_how_to_turn_it_on(triton_server):
    import tritonclient.grpc as grpcclient

    from kvflow.triton_backend.protocol import LORA_PARAMETER, MODEL_NAME

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer(MODEL_NAME, [], parameters={LORA_PARAMETER: json.dumps(
            {"op": "load", "lora_name": "x", "lora_path": "/tmp"})})
        _, error = answers.get(timeout=DEADLINE_S)
    finally:
        client.stop_stream()
        client.close()
    assert error is not None and "--enable-lora" in str(error)
