"""Prompt logprobs served: Triton's ``prompt_logprobs`` output, and over the OpenAI API echo with
``logprobs`` (OpenAI's legacy shape), echo with ``max_tokens: 0`` and vLLM's ``prompt_logprobs``
field. The translation is checked without a server; the served numbers against the engine's
own (``LLM``, the same engine and matmul mode as the session's tritonserver)."""

from __future__ import annotations

import json

import pytest

from kvflow.openai_api.completion_bodies import (
    ChoiceState,
    choice_chunk,
    final_response,
    vllm_prompt_logprobs,
)
from kvflow.openai_api.errors import OpenAIError
from kvflow.openai_api.protocol import parse_completion_request
from kvflow.orchestrator.outputs import TokenLogprobs
from tests.helpers import http_post, post_json, wait_for

MODEL = "smollm2-135m-instruct"
PROMPT = "The quick brown fox jumps over the lazy"


def sampling(parsed, k: int = 0) -> dict:
    return json.loads(parsed.choices[k].inputs["sampling_parameters"][0])


# --- the translation, without a server ------------------------------------------------------

def test_echo_with_logprobs_asks_the_backend_for_the_prompts_logprobs():
    parsed = parse_completion_request({"prompt": "ab", "echo": True, "logprobs": 3,
                                       "max_tokens": 2}, MODEL, chat=False)
    assert sampling(parsed)["prompt_logprobs"] == 3 and sampling(parsed)["logprobs"] == 3
    assert parsed.prompt_logprobs is None  # vLLM's field was not asked for
    plain = parse_completion_request({"prompt": "ab", "logprobs": 3}, MODEL, chat=False)
    assert "prompt_logprobs" not in sampling(plain)


@pytest.mark.parametrize(("own", "echoed", "sent"), [(None, 2, 2), (5, 2, 5), (1, 4, 4)])
def test_the_backend_gets_the_larger_of_both_asks(own, echoed, sent):
    body = {"prompt": "ab", "echo": True, "logprobs": echoed, "prompt_logprobs": own}
    parsed = parse_completion_request(body, MODEL, chat=False)
    assert sampling(parsed)["prompt_logprobs"] == sent
    assert parsed.prompt_logprobs == own


def test_echo_with_max_tokens_zero_generates_one_token_and_drops_it():
    parsed = parse_completion_request({"prompt": "ab", "echo": True, "max_tokens": 0},
                                      MODEL, chat=False)
    assert sampling(parsed)["max_tokens"] == 1 and not parsed.generate
    # Without echo, 0 goes on, for the backend to refuse by name.
    plain = parse_completion_request({"prompt": "ab", "max_tokens": 0}, MODEL, chat=False)
    assert sampling(plain)["max_tokens"] == 0 and plain.generate


def test_an_echoed_token_id_prompt_asks_for_its_tokens_text():
    parsed = parse_completion_request({"prompt": [[5, 6], [7]], "echo": True}, MODEL,
                                      chat=False)
    assert sampling(parsed)["prompt_logprobs"] == 0
    assert all(c.echo and c.echo_text == "" for c in parsed.choices)


@pytest.mark.parametrize("value", ["2", 1.5, True, [1]])
def test_prompt_logprobs_of_the_wrong_type_is_a_400_naming_it(value):
    for chat, body in ((False, {"prompt": "x"}),
                       (True, {"messages": [{"role": "user", "content": "x"}]})):
        with pytest.raises(OpenAIError) as info:
            parse_completion_request({**body, "prompt_logprobs": value}, MODEL, chat=chat)
        assert (info.value.status, info.value.param) == (400, "prompt_logprobs")


def _wire(token: int, logprob: float | None, top: dict[int, float], text: str) -> dict:
    return TokenLogprobs(token, logprob, tuple(sorted(top.items(), key=lambda kv: -kv[1])),
                         text, {t: f"<{t}>" if t != token else text for t in top}).to_wire()


PROMPT_WIRE = [_wire(1, None, {}, "Hi"),
               _wire(2, -0.5, {2: -0.5, 3: -1.5}, " there"),
               _wire(4, -3.0, {5: -0.1, 6: -2.0, 4: -3.0}, "!")]


def test_echoed_prompt_logprobs_come_first_in_the_legacy_shape():
    parsed = parse_completion_request({"prompt": [1, 2, 4], "echo": True, "logprobs": 2,
                                       "max_tokens": 1}, MODEL, chat=False)
    state = ChoiceState(0)
    state.update({"text_output": " ok", "finish_reason": "length", "num_input_tokens": 3,
                  "num_output_tokens": 1, "prompt_logprobs": json.dumps(PROMPT_WIRE),
                  "output_logprobs": json.dumps([_wire(7, -0.2, {7: -0.2, 8: -1.9}, " ok")])})
    choice = final_response(parsed, [state])["choices"][0]
    assert choice["text"] == "Hi there! ok"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["Hi", " there", "!", " ok"]
    assert lp["token_logprobs"] == [None, -0.5, -3.0, -0.2]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][2] == {"<5>": -0.1, "<6>": -2.0}
    assert lp["text_offset"] == [0, 2, 8, 9]
    assert "prompt_logprobs" not in choice


def test_max_tokens_zero_answers_the_prompt_alone_and_counts_no_completion_token():
    parsed = parse_completion_request({"prompt": "Hi there!", "echo": True, "logprobs": 0,
                                       "max_tokens": 0}, MODEL, chat=False)
    state = ChoiceState(0, generate=parsed.generate)
    state.update({"text_output": " ok", "finish_reason": "stop", "num_input_tokens": 3,
                  "num_output_tokens": 1, "prompt_logprobs": json.dumps(PROMPT_WIRE),
                  "output_logprobs": json.dumps([_wire(7, -0.2, {7: -0.2}, " ok")])})
    body = final_response(parsed, [state])
    choice = body["choices"][0]
    assert choice["text"] == "Hi there!" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["Hi", " there", "!"]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == 3


def test_vllm_prompt_logprobs_rank_what_the_backend_listed_and_no_further():
    entries = [TokenLogprobs.from_wire(e) for e in PROMPT_WIRE]
    out = vllm_prompt_logprobs(entries, k=1, asked=2)
    assert out[0] is None
    assert out[1] == {"2": {"logprob": -0.5, "rank": 1, "decoded_token": " there"}}
    # Token 4 is below the top 2 the backend listed: its rank is unknown.
    assert out[2] == {"5": {"logprob": -0.1, "rank": 1, "decoded_token": "<5>"},
                      "4": {"logprob": -3.0, "rank": None, "decoded_token": "!"}}


# --- served: Triton ---------------------------------------------------------------------------

def engine_prompt_logprobs(llm, prompt: str, k: int):
    from kvflow import SamplingParams

    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0,
                                                prompt_logprobs=k))[0]
    return out.prompt_token_ids, out.prompt_logprobs


@pytest.mark.slow
def test_triton_prompt_logprobs_equal_the_engines(triton_server, default_llm):
    ids, engine = engine_prompt_logprobs(default_llm, PROMPT, 3)
    status, text = http_post(triton_server, "/v2/models/kvflow/generate", {
        "text_input": PROMPT, "max_tokens": 2, "exclude_input_in_output": True,
        "sampling_parameters": json.dumps({"temperature": 0.0, "prompt_logprobs": 3})})
    assert status == 200, text
    served = json.loads(json.loads(text)["prompt_logprobs"])
    assert [e["token_id"] for e in served] == ids
    assert served[0]["logprob"] is None and served[0]["top_logprobs"] == {}
    for entry, expected in zip(served[1:], engine[1:], strict=True):
        assert {int(t) for t in entry["top_logprobs"]} == set(expected)
        for token, logprob in expected.items():
            assert entry["top_logprobs"][str(token)] == pytest.approx(logprob, abs=1e-4)
        assert entry["logprob"] == pytest.approx(expected[entry["token_id"]], abs=1e-4)
        assert isinstance(entry["token"], str)
    assert "".join(e["token"] for e in served) == PROMPT


@pytest.mark.slow
def test_triton_sends_prompt_logprobs_once_on_a_stream(triton_server):
    import tritonclient.grpc as grpcclient

    from kvflow.client import build_inputs

    responses = []
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.append((result, error)))
    try:
        inputs = build_inputs(PROMPT, {"temperature": 0.0, "ignore_eos": True, "max_tokens": 4,
                                       "prompt_logprobs": 0})
        client.async_stream_infer("kvflow", inputs, request_id="p")
        wait_for(lambda: any(r is not None and r.as_numpy("finish_reason")[0]
                             for r, _ in responses), what="the stream's last response")
    finally:
        client.stop_stream()
        client.close()
    assert all(e is None for _, e in responses)
    carried = [r.as_numpy("prompt_logprobs") is not None for r, _ in responses]
    assert carried[0] and not any(carried[1:])
    first = json.loads(responses[0][0].as_numpy("prompt_logprobs")[0])
    assert all(len(e["top_logprobs"]) == (0 if i == 0 else 1) for i, e in enumerate(first))


@pytest.mark.slow
@pytest.mark.parametrize("value", [21, -1, "x"])
def test_triton_refuses_a_bad_k_naming_the_field(triton_server, value):
    status, text = http_post(triton_server, "/v2/models/kvflow/generate", {
        "text_input": PROMPT, "max_tokens": 2,
        "sampling_parameters": json.dumps({"prompt_logprobs": value})})
    assert status == 400 and "prompt_logprobs" in text, text


# --- served: the OpenAI API -------------------------------------------------------------------

@pytest.mark.slow
def test_echo_with_logprobs_returns_the_prompt_then_the_output(client, default_llm):
    ids, engine = engine_prompt_logprobs(default_llm, PROMPT, 2)
    comp = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2,
                                     max_tokens=3, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    choice, n = comp.choices[0], len(ids)
    assert comp.usage.prompt_tokens == n and comp.usage.completion_tokens == 3
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == n + 3 and "".join(lp.tokens) == choice.text
    assert "".join(lp.tokens[:n]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(engine[i][ids[i]], abs=1e-4)
        assert len(lp.top_logprobs[i]) == 2
    assert lp.text_offset[n] == len(PROMPT)
    assert lp.text_offset == sorted(lp.text_offset)


@pytest.mark.slow
def test_echo_with_max_tokens_zero_scores_the_prompt_and_generates_nothing(openai_frontend,
                                                                          default_llm):
    ids, engine = engine_prompt_logprobs(default_llm, PROMPT, 1)
    # lm-evaluation-harness's loglikelihood request: a batch of token-id prompts.
    status, body = post_json(openai_frontend, "/v1/completions", {
        "model": MODEL, "prompt": [ids, ids[:4]], "echo": True, "logprobs": 1,
        "max_tokens": 0, "temperature": 0.0, "seed": 1234})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(ids) + 4
    for choice, length in zip(body["choices"], (len(ids), 4), strict=True):
        lp = choice["logprobs"]
        assert choice["finish_reason"] == "length" and len(lp["tokens"]) == length
        assert choice["text"] == "".join(lp["tokens"])
        assert lp["token_logprobs"][1:] == pytest.approx(
            [engine[i][ids[i]] for i in range(1, length)], abs=1e-4)
    assert body["choices"][0]["text"] == PROMPT
    status, body = post_json(openai_frontend, "/v1/completions",
                             {"model": MODEL, "prompt": PROMPT, "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens", body


@pytest.mark.slow
def test_vllm_prompt_logprobs_field_on_completions_and_chat(client, default_llm):
    ids, engine = engine_prompt_logprobs(default_llm, PROMPT, 2)
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                     temperature=0.0, extra_body={"prompt_logprobs": 2})
    field = comp.choices[0].model_extra["prompt_logprobs"]
    assert field[0] is None and len(field) == len(ids)
    for i in range(1, len(ids)):
        entry = field[i]
        assert entry[str(ids[i])]["logprob"] == pytest.approx(engine[i][ids[i]], abs=1e-4)
        ranked = sorted((v["rank"], int(t)) for t, v in entry.items() if v["rank"] is not None)
        assert [r for r, _ in ranked][:2] == [1, 2] and len(entry) in (2, 3)
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        temperature=0.0, extra_body={"prompt_logprobs": 0})
    field = chat.model_extra["prompt_logprobs"]
    assert field[0] is None and len(field) == chat.usage.prompt_tokens
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in field[1:])


@pytest.mark.slow
def test_streamed_echo_sends_the_prompt_first(client):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1,
                                       max_tokens=3, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT)
    assert "".join(first.logprobs.tokens).startswith(PROMPT)
    assert first.logprobs.token_logprobs[0] is None
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert "".join(c.choices[0].text for c in chunks) == "".join(tokens)


@pytest.mark.slow
@pytest.mark.parametrize(("body", "param"), [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"echo": True, "logprobs": 21, "prompt_logprobs": 3}, "logprobs"),
    ({"echo": True, "logprobs": 2, "prompt_logprobs": 30}, "prompt_logprobs"),
])
def test_a_bad_k_is_a_400_naming_the_field(openai_frontend, body, param):
    status, answer = post_json(openai_frontend, "/v1/completions",
                               {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, **body})
    assert status == 400 and answer["error"]["param"] == param, answer
    assert param in answer["error"]["message"]
    status, answer = post_json(openai_frontend, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "prompt_logprobs": 25})
    assert status == 400 and answer["error"]["param"] == "prompt_logprobs", answer


def test_a_streamed_echo_with_max_tokens_zero_is_the_prompt_alone():
    parsed = parse_completion_request({"prompt": [1, 2, 4], "echo": True, "logprobs": 1,
                                       "max_tokens": 0, "stream": True,
                                       "prompt_logprobs": 1}, MODEL, chat=False)
    state = ChoiceState(0, generate=parsed.generate)
    delta, entries = state.update({
        "text_output": " ok", "finish_reason": "length", "num_input_tokens": 3,
        "num_output_tokens": 1, "prompt_logprobs": json.dumps(PROMPT_WIRE),
        "output_logprobs": json.dumps([_wire(7, -0.2, {7: -0.2}, " ok")])})
    chunk = choice_chunk(parsed, parsed.choices[0], state, delta, entries, first=True)
    assert chunk["text"] == "Hi there!" and chunk["finish_reason"] == "length"
    assert chunk["logprobs"]["tokens"] == ["Hi", " there", "!"]
    assert chunk["prompt_logprobs"][0] is None and len(chunk["prompt_logprobs"]) == 3
    assert state.completion_tokens == 0
