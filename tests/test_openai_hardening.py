"""Hostile and loosely typed OpenAI request bodies against the real frontend and tritonserver
(issue 29): each is a 400 that names the client's field (OpenAI's ``param``) and the limit, and
the server keeps serving."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from tests.helpers import post_json

pytestmark = pytest.mark.slow  # the OpenAI frontend before tritonserver

SURROGATE = "\udc00"  # what JSON's "\udc00" decodes to: a lone surrogate, not Unicode text


def complete(frontend, **fields) -> tuple[int, dict]:
    return post_json(frontend, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, **fields})


def chat(frontend, messages: list, **fields) -> tuple[int, dict]:
    return post_json(frontend, "/v1/chat/completions",
                     {"messages": messages, "max_tokens": 1, **fields})


def with_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def nested(depth: int) -> dict:
    """A JSON schema whose objects nest ``depth`` levels deep."""
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def assert_refused(answer: tuple[int, dict], param: str, *words: str) -> None:
    status, body = answer
    assert status == 400, body
    error = body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def assert_still_serving(frontend) -> None:
    status, body = complete(frontend)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 1


# --- 1. nesting ------------------------------------------------------------------------------

def test_a_body_nested_past_32_levels_is_a_400_naming_its_field(openai_frontend):
    deep = b'{"prompt": "Hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert_refused(post_json(openai_frontend, "/v1/completions", deep), "x",
                   "100001 levels deep", "the limit is 32")
    # Just past the limit, in a field that exists: the same error, not the field's own.
    assert_refused(complete(openai_frontend, guided_json=nested(32)), "guided_json",
                   "33 levels deep", "the limit is 32")
    assert_refused(complete(openai_frontend, response_format=with_schema(nested(40))),
                   "response_format", "43 levels deep", "the limit is 32")
    assert_still_serving(openai_frontend)


def test_an_unterminated_string_of_escaped_quotes_is_a_400(openai_frontend):
    """The depth scan is linear: a pattern that needs a string's closing quote is retried from
    each escaped quote of an unterminated one, and would hold the server for hours here."""
    body = b'{"prompt": "' + b'\\"[' * 1_000_000
    status, answer = post_json(openai_frontend, "/v1/completions", body)
    assert status == 400 and "not valid JSON" in answer["error"]["message"], answer
    assert_still_serving(openai_frontend)


def test_an_integer_past_pythons_digit_limit_is_a_400(openai_frontend):
    body = b'{"prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}"
    status, answer = post_json(openai_frontend, "/v1/completions", body)
    assert status == 400 and "not valid JSON" in answer["error"]["message"], answer
    assert_still_serving(openai_frontend)


# --- 2. lone surrogates ----------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "param", "where"), [
    ({"prompt": f"Hi {SURROGATE}"}, "prompt", "prompt holds"),
    ({"prompt": ["Hi", SURROGATE]}, "prompt", "prompt[1] holds"),
    ({"user": SURROGATE}, "user", "user holds"),
    ({"cache_salt": SURROGATE}, "cache_salt", "cache_salt holds"),
    ({"stop": SURROGATE}, "stop", "stop holds"),
    ({"stop": ["a", f"b{SURROGATE}"]}, "stop", "stop[1] holds"),
    ({"guided_regex": f"a{SURROGATE}"}, "guided_regex", "guided_regex holds"),
    ({"guided_grammar": SURROGATE}, "guided_grammar", "guided_grammar holds"),
    ({"guided_choice": ["a", SURROGATE]}, "guided_choice", "guided_choice[1] holds"),
    ({"guided_json": {"enum": [SURROGATE]}}, "guided_json", "guided_json.enum[0] holds"),
    ({"guided_json": f'{{"enum": ["{SURROGATE}"]}}'}, "guided_json", "guided_json holds"),
    ({"response_format": with_schema({"properties": {SURROGATE: {}}})}, "response_format",
     "response_format.json_schema.schema.properties (a key) holds"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(openai_frontend, fields, param, where):
    assert_refused(complete(openai_frontend, **fields), param, where, "lone surrogate",
                   "U+DC00")
    assert_still_serving(openai_frontend)


@pytest.mark.parametrize(("message", "where"), [
    ({"role": "user", "content": SURROGATE}, "messages[1].content holds"),
    ({"role": "user", "content": [{"type": "text", "text": SURROGATE}]},
     "messages[1].content[0].text holds"),
    ({"role": "user", "content": "Hi", "name": SURROGATE}, "messages[1].name holds"),
])
def test_a_lone_surrogate_in_a_message_is_a_400_naming_messages(openai_frontend, message,
                                                                where):
    answer = chat(openai_frontend, [{"role": "system", "content": "Be brief."}, message])
    assert_refused(answer, "messages", where, "lone surrogate")
    assert_still_serving(openai_frontend)


def test_an_unknown_field_named_with_a_lone_surrogate_is_a_400(openai_frontend):
    status, answer = complete(openai_frontend, **{SURROGATE: 1})
    assert status == 400 and "unknown field" in answer["error"]["message"], answer
    assert answer["error"]["param"] == "\\udc00"  # escaped: the error body must be UTF-8
    assert_still_serving(openai_frontend)


# --- 3. priority -----------------------------------------------------------------------------

@pytest.mark.parametrize("priority", [2**40, 2**63, -(2**70)])
def test_a_priority_past_the_backends_range_is_a_400_naming_it(openai_frontend, priority):
    assert_refused(complete(openai_frontend, priority=priority), "priority",
                   "priority must be in [-1073741824, 1073741824]")
    assert_still_serving(openai_frontend)


# --- 4. types --------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "value", "kind"), [
    ("max_tokens", "10", "an integer"), ("max_tokens", 10.0, "an integer"),
    ("max_tokens", True, "an integer"), ("echo", "yes", "a boolean"), ("echo", [1], "a boolean"),
    ("echo", 1, "a boolean"), ("temperature", "0.5", "a number"), ("top_p", "1", "a number"),
    ("min_p", True, "a number"), ("presence_penalty", "0", "a number"),
    ("frequency_penalty", "0", "a number"), ("repetition_penalty", "1", "a number"),
    ("top_k", "5", "an integer"), ("seed", "1", "an integer"), ("min_tokens", "1", "an integer"),
    ("timeout_ms", "1000", "an integer"), ("ignore_eos", "true", "a boolean"),
    ("ignore_eos", 1, "a boolean"), ("skip_special_tokens", "false", "a boolean"),
    ("guided_json_object", "true", "a boolean"), ("guided_choice", '["a", "b"]', "a list"),
    ("user", 5, "a string"), ("cache_salt", ["s"], "a string"), ("priority", "1", "an integer"),
    ("model", 5, "a string"),
])
def test_a_loosely_typed_field_is_a_400_naming_it(openai_frontend, name, value, kind):
    assert_refused(complete(openai_frontend, **{name: value}), name, f"{name} must be {kind}")
    assert_still_serving(openai_frontend)


def test_max_completion_tokens_must_be_an_integer(openai_frontend):
    answer = chat(openai_frontend, [{"role": "user", "content": "Hi"}],
                  max_completion_tokens="10")
    assert_refused(answer, "max_completion_tokens", "max_completion_tokens must be an integer")


@pytest.mark.parametrize("number", [b"1e999", b"-Infinity", b"NaN", b"1" + b"0" * 400])
def test_a_number_past_float_range_is_a_400_naming_its_field(openai_frontend, number):
    body = b'{"prompt": "Hi", "max_tokens": 1, "temperature": ' + number + b"}"
    assert_refused(post_json(openai_frontend, "/v1/completions", body), "temperature",
                   "temperature must be a finite number")
    assert_still_serving(openai_frontend)


# --- 5. limits, named by the client's field --------------------------------------------------

@pytest.mark.parametrize(("fields", "param"), [
    ({"stop": [f"s{i}" for i in range(40_000)]}, "stop"),
    ({"stop": "x" * 300_000}, "stop"),
    ({"guided_json": {"description": "x" * (260 << 10)}}, "guided_json"),
    ({"response_format": with_schema({"description": "x" * (260 << 10)})}, "response_format"),
    # Each under the limit, together over it: the one that takes the most room is named.
    ({"stop": "x" * 100_000, "guided_regex": "a" * 200_000}, "guided_regex"),
])
def test_sampling_fields_past_the_backends_size_limit_are_named(openai_frontend, fields, param):
    assert_refused(complete(openai_frontend, **fields), param, "the limit is 262144")
    assert_still_serving(openai_frontend)


def test_messages_past_the_backends_limits_are_named(openai_frontend):
    big = [{"role": "user", "content": "x" * ((4 << 20) + 1)}]
    assert_refused(chat(openai_frontend, big), "messages", "the limit is 4194304")
    deep = [{"role": "user", "content": [{"type": "text", "text": "Hi", "x": [[[[[[]]]]]]}]}]
    assert_refused(chat(openai_frontend, deep), "messages", "10 levels deep",
                   "the limit is 8")
    assert_still_serving(openai_frontend)


# --- 6. assistant turns without content ------------------------------------------------------

def test_an_assistant_turn_with_null_content_is_served(openai_frontend):
    messages = [{"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": None},
                {"role": "user", "content": "Well?"}]
    status, answer = chat(openai_frontend, messages)
    assert status == 200, answer
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["completion_tokens"] == 1


# --- 7. fields kvflow ignores, and fields it refuses -----------------------------------------

IGNORED = {"metadata": {"app": "test"}, "store": True, "reasoning_effort": "high",
           "prompt_cache_key": "k-1", "safety_identifier": "u-1", "verbosity": "low",
           "service_tier": "flex"}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_fields_that_change_nothing_are_accepted_ignored_and_logged(openai_frontend, endpoint):
    logged = len(openai_frontend.log_path.read_text())
    if endpoint == "chat":
        answer = chat(openai_frontend, [{"role": "user", "content": "Hi"}], **IGNORED)
    else:
        answer = complete(openai_frontend, **IGNORED)
    assert answer[0] == 200, answer
    assert answer[1]["usage"]["completion_tokens"] == 1
    log = openai_frontend.log_path.read_text()[logged:].splitlines()
    warned = [line for line in log if "WARNING" in line and "ignored" in line]
    assert any(all(name in line for name in IGNORED) for line in warned), warned[-3:]


@pytest.mark.parametrize(("name", "value"), [
    ("suffix", "and then"), ("best_of", 2), ("logit_bias", {"50256": -100}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "required"),
    ("functions", [{"name": "f"}]), ("function_call", {"name": "f"}),
])
def test_fields_that_would_change_the_output_are_refused(openai_frontend, name, value):
    assert_refused(complete(openai_frontend, **{name: value}), name, f"{name} is not supported")
    assert_still_serving(openai_frontend)


def test_their_defaults_are_accepted(openai_frontend):
    status, answer = complete(openai_frontend, suffix="", best_of=1, logit_bias={},
                              functions=[], function_call="none")
    assert status == 200, answer
    # Open WebUI's plain chats carry an empty tool list.
    status, answer = chat(openai_frontend, [{"role": "user", "content": "Hi"}], tools=[],
                          tool_choice="auto", parallel_tool_calls=True, max_tokens=2)
    assert status == 200, answer


# --- 8. keep-alive ---------------------------------------------------------------------------

def test_a_connection_is_kept_alive_between_requests_six_seconds_apart(openai_frontend):
    """uvicorn closes an idle connection after 5 s by default, before clients' pools do."""
    host, port = openai_frontend.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    body = json.dumps({"prompt": "Hi", "max_tokens": 1})
    headers = {"Content-Type": "application/json"}
    try:
        conn.request("POST", "/v1/completions", body, headers)
        first = conn.getresponse()
        assert first.status == 200 and json.loads(first.read())["choices"]
        local = conn.sock.getsockname()
        time.sleep(6)
        conn.request("POST", "/v1/completions", body, headers)
        second = conn.getresponse()  # the server closed the connection: RemoteDisconnected
        assert second.status == 200 and json.loads(second.read())["choices"]
        assert conn.sock.getsockname() == local  # the same connection, not a new one
    finally:
        conn.close()


# --- 9. every request bounded before work (issue 43) -----------------------------------------

def big_tools(count: int, description_chars: int, properties: int = 0) -> list[dict]:
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "d" * description_chars,
        "parameters": {"type": "object", "properties": {
            f"p{j}": {"type": "string", "description": "x" * 50} for j in range(properties)}}}}
        for i in range(count)]


def test_n_times_prompt_logprobs_past_the_response_bound_is_a_400_naming_them(openai_frontend):
    # 64 x (20 + 1) x 900 prompt tokens is 1.2 million entries, past 2^20: refused before
    # any prefill, the prompt tokenized (a text's length is the backend's to know).
    answer = complete(openai_frontend, prompt="hello " * 900, n=64, prompt_logprobs=20)
    assert_refused(answer, "prompt_logprobs", "n 64", "prompt_logprobs 20",
                   "the limit is 1048576")
    # Token ids: refused by the frontend, before anything is sent.
    answer = complete(openai_frontend, prompt=[1] * 800, n=64, prompt_logprobs=20)
    assert_refused(answer, "prompt_logprobs", "800 prompt tokens", "the limit is 1048576")
    # Echo with logprobs asks for the prompt's too: the client's field is named.
    answer = complete(openai_frontend, prompt=[1] * 800, n=64, echo=True, logprobs=20)
    assert_refused(answer, "logprobs", "the limit is 1048576")
    # Under the bound, n choices share one prompt's logprobs, each as the client asked.
    status, body = complete(openai_frontend, prompt="hello there", n=3, prompt_logprobs=2)
    assert status == 200, body
    lists = [c["prompt_logprobs"] for c in body["choices"]]
    assert lists[0] == lists[1] == lists[2] and lists[0][0] is None and len(lists[0]) > 1
    assert_still_serving(openai_frontend)


def test_detokenize_of_more_ids_than_max_model_len_is_a_400(openai_frontend):
    status, answer = post_json(openai_frontend, "/tokenize", {"prompt": "Hi there"})
    assert status == 200, answer
    limit = answer["max_model_len"]
    assert post_json(openai_frontend, "/detokenize", {"tokens": [1] * limit})[0] == 200
    assert_refused(post_json(openai_frontend, "/detokenize", {"tokens": [1] * (limit + 1)}),
                   "tokens", f"tokens has {limit + 1} ids",
                   f"the limit is max_model_len ({limit})")
    assert_still_serving(openai_frontend)


def test_tokenize_of_a_text_no_context_holds_is_refused_by_its_length(openai_frontend):
    """4 MB of text (the issue's probe): refused by its length, never tokenized."""
    assert_refused(post_json(openai_frontend, "/tokenize", {"prompt": "x" * 4_000_000}),
                   "prompt", "prompt is 4000000 characters", "max_model_len",
                   "no token covers more than")
    messages = [{"role": "user", "content": "Hi"}]
    assert_refused(post_json(openai_frontend, "/tokenize",
                             {"messages": messages, "tools": big_tools(1, 3_000_000)}),
                   "tools", "tools[0].function.description is 3000000 characters")
    assert_still_serving(openai_frontend)


def test_tools_no_context_holds_are_a_400_naming_them(openai_frontend):
    messages = [{"role": "user", "content": "What is the weather?"}]
    # One description of 3 MB: named, and refused by its length before tokenizing.
    assert_refused(chat(openai_frontend, messages, tools=big_tools(1, 3_000_000)),
                   "tools", "tools[0].function.description is 3000000 characters",
                   "max_model_len")
    # 128 tools of 30 KB each: together.
    assert_refused(chat(openai_frontend, messages, tools=big_tools(128, 30_000)),
                   "tools", "tools is", "max_model_len")
    # Past what any prompt may carry as JSON: refused by the frontend before its tool plan.
    assert_refused(chat(openai_frontend, messages, tools=big_tools(2, 2_200_000)),
                   "tools", "messages and tools together", "the limit is 4194304")
    assert_still_serving(openai_frontend)


def test_the_event_loop_serves_others_while_a_big_request_is_parsed(openai_frontend):
    """A 3.7 MB tools list takes the frontend a good part of a second to parse and plan (then
    it is refused): on a worker thread, while the event loop answers /health meanwhile. The
    order of the answers is the check: a blocked loop would answer the first /health, sent
    while the big one is parsed, after it. (How many more fit before it depends on the
    machine's load, so only the first is asserted.)"""
    import threading
    import urllib.request

    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "tools": big_tools(128, 100, properties=300)}
    data = json.dumps(body).encode()
    assert len(data) < 4 << 20
    finished: list[str] = []
    started = threading.Event()

    def big() -> None:
        started.set()
        post_json(openai_frontend, "/v1/chat/completions", data)
        finished.append("big")

    thread = threading.Thread(target=big)
    thread.start()
    started.wait()
    time.sleep(0.2)  # the body is sent, and being parsed
    for _ in range(5):
        with urllib.request.urlopen(openai_frontend.url + "/health", timeout=300) as r:
            assert r.status == 200
        finished.append("health")
    thread.join()
    assert finished[0] == "health" and finished.count("big") == 1, finished
    assert_still_serving(openai_frontend)
