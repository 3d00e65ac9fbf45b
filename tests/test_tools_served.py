"""Tool calling and reasoning through the real tritonserver and the real OpenAI frontend, with
the default model (SmolLM2-135M-Instruct, whose template has no tools: kvflow's fallback
prompt), driven by the clients agents use: the ``openai`` SDK, LangChain, the OpenAI Agents
SDK."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.helpers import run_weather_agent

pytestmark = pytest.mark.slow  # tritonserver and the frontend

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "The current weather in a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                      "parameters": {"type": "object", "properties": {},
                                                     "additionalProperties": False}}},
]
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]
GREEDY = {"max_tokens": 64, "temperature": 0}


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _valid_call(call, name: str | None = None) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    if name is not None:
        assert call.function.name == name
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema[call.function.name])
    return arguments


def test_required_returns_a_call_whose_arguments_validate(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                       tool_choice="required", **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    _valid_call(choice.message.tool_calls[0])


def test_a_named_tool_returns_that_tool(client, model):
    for name in ("get_weather", "get_time"):
        r = client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, **GREEDY,
            tool_choice={"type": "function", "function": {"name": name}})
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        _valid_call(r.choices[0].message.tool_calls[0], name)


def test_parallel_calls_are_a_list_and_one_without(client, model):
    ask = [{"role": "user", "content": "Weather in Paris and in Rome?"}]
    r = client.chat.completions.create(model=model, messages=ask, tools=TOOLS[:1],
                                       tool_choice="required", parallel_tool_calls=False,
                                       **GREEDY)
    assert len(r.choices[0].message.tool_calls) == 1


def test_streamed_deltas_reassemble_to_the_same_call(client, model):
    whole = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                           tool_choice="required", **GREEDY)
    stream = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                            tool_choice="required", stream=True, **GREEDY)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for piece in delta.tool_calls or []:
            if piece.id is not None:  # a call's first piece: its id and name, once
                assert piece.index not in calls and piece.function.name
                calls[piece.index] = {"name": piece.function.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        assert not delta.content  # a call only: no content
        finish = chunk.choices[0].finish_reason or finish
    want = whole.choices[0].message.tool_calls[0].function
    assert finish == "tool_calls"
    assert list(calls.values()) == [{"name": want.name, "arguments": want.arguments}]


def test_a_tool_result_sent_back_produces_an_answer(client, model):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                           tool_choice="required", **GREEDY)
    call = first.choices[0].message.tool_calls[0]
    turns = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id,
              "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    assert turns[1]["role"] == "assistant" and "content" not in turns[1]
    answer = client.chat.completions.create(model=model, messages=turns, tools=TOOLS,
                                            tool_choice="none", **GREEDY)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert choice.message.content.strip()


def test_an_empty_tools_list_is_a_plain_chat(client, model):
    plain = client.chat.completions.create(model=model, messages=ASK, **GREEDY)
    with_empty = client.chat.completions.create(model=model, messages=ASK, tools=[], **GREEDY)
    assert with_empty.choices[0].message.content == plain.choices[0].message.content
    assert with_empty.choices[0].message.tool_calls is None


def test_auto_output_is_content_or_valid_calls(client, model):
    """The model decides; whatever it writes comes back well formed (a begun call is held to
    the schema by the grammar)."""
    for ask in (ASK, [{"role": "user", "content": "Call get_time to tell me the time."}]):
        r = client.chat.completions.create(model=model, messages=ask, tools=TOOLS,
                                           **GREEDY)
        message = r.choices[0].message
        for call in message.tool_calls or []:
            _valid_call(call)
        assert message.tool_calls or message.content
        assert (r.choices[0].finish_reason == "tool_calls") == bool(message.tool_calls)


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [{"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}], "tool_choice": "required"},
     "tools", "broken"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0].type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages", "messages[0].content[1] is an image_url part"),
    ({"messages": [*ASK, {"role": "tool", "content": "21C"}]}, "messages", "tool_call_id"),
])
def test_bad_tools_and_parts_are_400s_naming_them(client, model, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, **{"messages": ASK, **body}, **GREEDY)
    error = e.value.body
    assert error["param"] == param and words in error["message"], error
    # The server is fine afterwards.
    assert client.chat.completions.create(model=model, messages=ASK,
                                          max_tokens=2).choices[0].message.content is not None


@pytest.fixture(scope="module")
def thinking_frontend(triton_server, tmp_path_factory):
    """A second frontend in front of the session's server, with ``--reasoning-parser think``."""
    from kvflow.openai_api import FrontendConfig, FrontendProcess
    from kvflow.utils.procs import free_port

    log = tmp_path_factory.mktemp("thinking") / "frontend.log"
    frontend = FrontendProcess(FrontendConfig((triton_server.grpc_url,), port=free_port(),
                                              reasoning_parser="think"), log_path=log)
    frontend.start()
    yield frontend
    assert frontend.stop() == 0, log.read_text()[-3000:]


def test_reasoning_is_split_whole_and_streamed(thinking_frontend, model):
    """The 135M model does not think by itself: a regex makes it write <think>...</think>."""
    client = openai.OpenAI(base_url=thinking_frontend.url + "/v1", api_key="unused",
                           max_retries=0, timeout=300)
    body = {"model": model, "max_tokens": 60, "temperature": 0,
            "messages": [{"role": "user", "content": "Is 7 a prime? Think first."}],
            "extra_body": {"guided_regex": r"<think>[a-z ]{5,40}</think>(Yes|No)[a-z ,.]{0,20}"}}
    whole = client.chat.completions.create(**body)
    message = whole.choices[0].message.model_dump()
    assert message["reasoning_content"] and "<think>" not in message["reasoning_content"]
    assert message["content"][:2] in ("Ye", "No")
    details = whole.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < whole.usage.completion_tokens
    reasoning = content = ""
    usage = None
    for chunk in client.chat.completions.create(**body, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            delta = chunk.choices[0].delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
        usage = chunk.usage or usage
    assert (reasoning, content) == (message["reasoning_content"], message["content"])
    assert usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


# --- LangChain and the OpenAI Agents SDK, unchanged -----------------------------------------


@pytest.fixture(scope="module")
def chat_model(openai_frontend, model):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=openai_frontend.url + "/v1", api_key="unused", model=model,
                      temperature=0, max_tokens=64, max_retries=0)


def _multiply():
    from langchain_core.tools import tool

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    return multiply


def test_langchain_bind_tools_any_returns_tool_calls(chat_model):
    multiply = _multiply()
    ai = chat_model.bind_tools([multiply], tool_choice="any").invoke("What is 6 times 7?")
    assert [c["name"] for c in ai.tool_calls] == ["multiply"]
    assert set(ai.tool_calls[0]["args"]) == {"a", "b"}
    assert all(isinstance(v, int) for v in ai.tool_calls[0]["args"].values())


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_is_a_valid_object(chat_model, method):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city and its country."""

        name: str = Field(max_length=30)
        country: str = Field(max_length=30)

    city = chat_model.with_structured_output(City, method=method).invoke(
        "Name a city in France.")
    assert isinstance(city, City) and city.name and city.country


def test_langchain_two_turn_agent_runs_a_python_tool_and_finishes(chat_model):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    multiply = _multiply()
    messages: list = [HumanMessage("What is 6 times 7? Use the multiply tool.")]
    ran: list[int] = []
    bound = chat_model.bind_tools([multiply], tool_choice="any")
    for _ in range(3):
        ai = bound.invoke(messages)
        messages.append(ai)
        if not ai.tool_calls:
            break
        for call in ai.tool_calls:
            ran.append(multiply.invoke(call["args"]))
            messages.append(ToolMessage(str(ran[-1]), tool_call_id=call["id"]))
        bound = chat_model.bind_tools([multiply], tool_choice="none")  # now answer
    assert len(ran) == 1 and isinstance(messages[-1], AIMessage)
    assert not messages[-1].tool_calls and messages[-1].content.strip()


def test_openai_agents_sdk_agent_calls_a_function_tool(openai_frontend, model):
    output, cities = run_weather_agent(openai_frontend.url, model,
                                       "OpenAIChatCompletionsModel")
    assert len(cities) == 1 and output == f"Sunny and 21C in {cities[0]}."


# --- /tokenize and /detokenize (vLLM's) ------------------------------------------------------


def _post(frontend, path: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(frontend.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_gives_the_engines_tokens_and_detokenize_their_text(
        openai_frontend, default_engines, client, model):
    from kvflow.text.tokenizer import ChatPrompt, EngineTokenizer

    tokenizer = EngineTokenizer(default_engines["onnxruntime"])
    status, text = _post(openai_frontend, "/tokenize", {"prompt": "Hello, kvflow!"})
    assert status == 200, text
    assert text["tokens"] == tokenizer.encode("Hello, kvflow!")
    assert text["count"] == len(text["tokens"]) and text["max_model_len"] > 0
    plain = _post(openai_frontend, "/tokenize", {"prompt": "Hello, kvflow!",
                                                 "add_special_tokens": False})[1]
    assert plain["tokens"] == tokenizer.encode("Hello, kvflow!", add_special_tokens=False)
    # A chat with tools: the tokens a completion's prompt has (its usage counts them).
    status, chat = _post(openai_frontend, "/tokenize", {"messages": ASK, "tools": TOOLS})
    assert status == 200, chat
    prompt = ChatPrompt(ASK, TOOLS)
    assert chat["tokens"] == tokenizer.encode_chat(list(prompt.messages), tools=prompt.tools)
    used = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                          tool_choice="required", max_tokens=40)
    assert used.usage.prompt_tokens == chat["count"]
    status, back = _post(openai_frontend, "/detokenize", {"tokens": chat["tokens"]})
    assert status == 200 and back["prompt"] == tokenizer.decode(chat["tokens"],
                                                                skip_special_tokens=False)
    assert "<tool_call>" in back["prompt"] and "get_weather" in back["prompt"]
    # chat_template_kwargs reach the template (vLLM's field): the tokens are the engine's own
    # rendering with the same variables (the Qwen3 template's use: tests/test_family_templates).
    status, kw = _post(openai_frontend, "/tokenize", {
        "messages": ASK, "chat_template_kwargs": {"tools_in_user_message": False}})
    assert status == 200, kw
    prompt = ChatPrompt(ASK, None, {"tools_in_user_message": False})
    assert kw["tokens"] == tokenizer.encode_chat(list(prompt.messages),
                                                 template_kwargs=prompt.template_kwargs)


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": []}, "tokens"),
    ("/tokenize", {"prompt": "x", "messages": ASK}, "prompt"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "chat_template_kwargs": {"a": 1}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": ASK, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("/tokenize", {"messages": ASK, "chat_template_kwargs": {"messages": 1}},
     "chat_template_kwargs"),
])
def test_bad_tokenize_requests_are_400s_naming_the_field(openai_frontend, path, body, param):
    status, answer = _post(openai_frontend, path, body)
    assert status == 400 and answer["error"]["param"] == param, answer
