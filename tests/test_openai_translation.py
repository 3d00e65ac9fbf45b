"""The OpenAI frontend's translation, without a server: an OpenAI body -> its engine requests,
the backend's errors -> the client's, and a prompt's logprobs shared by its choices. (Served:
tests/test_openai_frontend.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvflow.openai_api.errors import OpenAIError, error_from_backend
from kvflow.openai_api.protocol import parse_completion_request

MODEL = "smollm2-135m-instruct"


def test_each_prompt_is_one_engine_request_of_n_sequences():
    parsed = parse_completion_request({"model": MODEL, "prompt": ["a", [5, 6]], "n": 3,
                                       "seed": 7, "max_tokens": 4}, MODEL, chat=False)
    assert [c.index for c in parsed.choices] == list(range(6))
    assert [c.prompt_index for c in parsed.choices] == [0, 0, 0, 1, 1, 1]
    params = [json.loads(c.inputs["sampling_parameters"][0]) for c in parsed.choices]
    # The engine gives sequence j of a seeded request seed + j.
    assert [(p["n"], p["seed"]) for p in params] == [(3, 7)] * 6
    assert parsed.choices[3].inputs["input_ids"].tolist() == [5, 6]
    assert parsed.choices[0].inputs["text_input"][0] == b"a"


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"prompt": "x", "tools": [{"type": "function"}]}, 400, "tools"),
    ({"prompt": "x", "max_token": 5}, 400, "max_token"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 65}, 400, "n"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-4o"}, 404, "model"),
    ({"prompt": "x", "echo": True, "prompt_logprobs": "2"}, 400, "prompt_logprobs"),
])
def test_malformed_bodies_are_refused_naming_the_field(body, status, param):
    with pytest.raises(OpenAIError) as info:
        parse_completion_request(body, MODEL, chat=False)
    assert (info.value.status, info.value.param) == (status, param)


def test_backend_errors_keep_their_cause_and_the_clients_field_name():
    parsed = parse_completion_request({"messages": [{"role": "user", "content": "x"}],
                                       "max_completion_tokens": 5}, MODEL, chat=True)
    overload = error_from_backend("the waiting queue is full; retry later", code="overloaded")
    assert (overload.status, overload.headers) == (503, {"Retry-After": "1"})
    assert error_from_backend("RuntimeError()", code="engine_error").status == 500
    bad = error_from_backend("sampling_parameters.max_tokens must be <= 2147483647", parsed)
    assert (bad.status, bad.param) == (400, "max_completion_tokens")
    assert bad.message.startswith("max_completion_tokens must be")
    prompt = error_from_backend("prompt has 5000 tokens; max_model_len is 1024", parsed)
    assert prompt.param == "messages"


def test_the_backend_takes_exactly_one_prompt_and_checks_every_message():
    from kvflow.text.tokenizer import ChatPrompt
    from kvflow.triton_backend.params import BadRequestError, parse_request

    def parse(**inputs):
        return parse_request({k: np.asarray(v) for k, v in inputs.items()}, max_model_len=64)

    ids = parse(input_ids=np.array([3, 4], dtype=np.int64), user=np.array([b"team-a"],
                                                                        dtype=object))
    assert (ids.prompt, ids.prompt_text, ids.tenant) == ([3, 4], "", "team-a")
    chat = parse(messages=np.array([json.dumps([{"role": "developer", "content": "Be brief."},
                                                {"role": "user", "content": "Hi"}]).encode()],
                                   dtype=object))
    assert chat.prompt == ChatPrompt([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hi"}])
    for inputs, words in (
            ({"text_input": np.array([b"a"], dtype=object),
              "input_ids": np.array([1], dtype=np.int64)}, "exactly one of"),
            ({}, "exactly one of text_input, input_ids, messages is required, got none"),
            ({"input_ids": np.array([], dtype=np.int64)}, "input_ids must not be empty"),
            ({"messages": np.array([b'[{"role": "user"}]'], dtype=object)},
             "messages[0].content must be a string"),
            ({"messages": np.array([b'[{"role": "user", "content": "x", "tool": 1}]'],
                                   dtype=object)}, "messages[0] has unknown key(s) 'tool'"),
            ({"messages": np.array([b"[" * 40 + b"]" * 40], dtype=object)},
             "messages nests 40 levels deep; the limit is 8"),
            ({"text_input": np.array([b"a"], dtype=object),
              "user": np.array([b"u" * 300], dtype=object)}, "user is 300 characters")):
        with pytest.raises(BadRequestError) as info:
            parse(**inputs)
        assert words in str(info.value)


def test_a_prompts_logprobs_are_parsed_and_encoded_once_for_its_n_choices():
    """The backend sends one prompt's logprobs once for its n choices: every choice reads the
    same parsed entries, the same converted list, and the body encodes it once."""
    from kvflow.openai_api.completion_bodies import encode_body, final_response, new_states

    parsed = parse_completion_request({"prompt": [5, 6], "n": 3, "prompt_logprobs": 1},
                                      MODEL, chat=False)
    wire = json.dumps([{"token_id": 5, "logprob": None},
                       {"token_id": 6, "logprob": -0.5, "top_logprobs": {"6": -0.5, "7": -1.5},
                        "token": "b", "top_tokens": {"6": "b", "7": "c"}}])
    states = new_states(parsed)
    for state in states:  # what the fanout hands each choice: the one response's string
        state.update({"text_output": "x", "finish_reason": "length", "num_input_tokens": 2,
                      "num_output_tokens": 1, "prompt_logprobs": wire})
    assert states[0].prompt_logprobs is states[1].prompt_logprobs is states[2].prompt_logprobs
    body = final_response(parsed, states)
    lists = [c["prompt_logprobs"] for c in body["choices"]]
    assert lists[0] is lists[1] is lists[2] and lists[0][0] is None
    assert json.loads(encode_body(body)) == json.loads(json.dumps(body))
    # A client's text that looks like the placeholder is text: only the nonce's is replaced.
    tricky = {"choices": [{"text": '"0:0"', "prompt_logprobs": lists[0]}]}
    assert json.loads(encode_body(tricky)) == json.loads(json.dumps(tricky))
