"""``/v1/responses`` without a server: the body's translation onto the chat path, the events a
stream writes (validated against the ``openai`` SDK's own event types), and the store's
bounds, namespaces and file."""

from __future__ import annotations

import json

import pytest

from kvflow.openai_api.completion_bodies import ChoiceState, new_states
from kvflow.openai_api.errors import OpenAIError
from kvflow.openai_api.protocol import ChatFormat
from kvflow.openai_api.response_store import ResponseStore
from kvflow.openai_api.responses_request import parse_responses_request
from kvflow.openai_api.responses_stream import ResponseEvents

MODEL = "m"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}


def parse(body: dict, previous: dict | None = None):
    return parse_responses_request({"model": MODEL, **body}, MODEL, ChatFormat(), previous)


def sent_messages(request) -> list[dict]:
    return json.loads(request.chat.choices[0].inputs["messages"][0])


def sampling(request) -> dict:
    return json.loads(request.chat.choices[0].inputs["sampling_parameters"][0])


def test_a_string_input_and_instructions_are_a_system_and_a_user_turn():
    request = parse({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 5,
                     "temperature": 0.5})
    assert sent_messages(request) == [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hi"}]
    assert sampling(request) == {"max_tokens": 5, "temperature": 0.5}
    assert request.store and request.id.startswith("resp_")


def test_items_become_chat_turns_with_calls_and_their_outputs():
    request = parse({"input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"type": "message", "role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"}],
        "tools": [WEATHER]})
    messages = sent_messages(request)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    tools = json.loads(request.chat.choices[0].inputs["tools"][0])
    assert tools[0]["function"]["name"] == "get_weather"


def test_previous_response_continues_its_conversation_without_its_instructions():
    first = parse({"input": "My name is Ada.", "instructions": "Old rules."})
    record = {"history": first.history,
              "response": {"output": [{"type": "message", "role": "assistant",
                                       "content": [{"type": "output_text", "text": "Hi Ada",
                                                    "annotations": []}]}]}}
    second = parse({"input": "Who am I?", "instructions": "New rules."}, record)
    assert sent_messages(second) == [
        {"role": "system", "content": "New rules."},
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi Ada"}]},
        {"role": "user", "content": "Who am I?"}]


@pytest.mark.parametrize("tool", ["web_search_preview", "file_search", "computer_use_preview",
                                  "code_interpreter"])
def test_a_built_in_tool_is_a_400_naming_it(tool):
    with pytest.raises(OpenAIError) as info:
        parse({"input": "x", "tools": [WEATHER, {"type": tool}]})
    assert info.value.status == 400 and info.value.param == "tools"
    assert tool in info.value.message and "tools[1]" in info.value.message


def test_refused_fields_name_themselves():
    cases = {"truncation": {"truncation": "auto"},
             "text.format": {"text": {"format": {"type": "xml"}}},
             "tool_choice": {"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}},
             "max_output_tokens": {"max_output_tokens": "9"},
             "input": {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
             "include": {"include": ["message.output_text.logprobs"]},
             "metadata": {"metadata": {"k": 1}},
             "frobnicate": {"frobnicate": 1}}
    for param, body in cases.items():
        with pytest.raises(OpenAIError) as info:
            parse({"input": "x", **body})
        assert info.value.status == 400 and info.value.param == param, (param, info.value)


def test_text_format_json_schema_goes_to_the_structured_output_path():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    request = parse({"input": "x", "text": {"format": {"type": "json_schema", "name": "n",
                                                       "schema": schema, "strict": True}}})
    assert sampling(request)["guided_json"] == schema
    assert request.chat.renamed["guided_json"] == "text.format"


def test_a_required_tool_choice_constrains_the_output_to_a_call():
    request = parse({"input": "x", "tools": [WEATHER], "tool_choice": "required"})
    assert request.chat.tools is not None and request.chat.tools.choice == "required"
    assert "guided_json" in sampling(request)
    named = parse({"input": "x", "tools": [WEATHER],
                   "tool_choice": {"type": "function", "name": "get_weather"}})
    assert named.chat.tools is not None and named.chat.tools.choice == "get_weather"


def validate_events(stream: bytes) -> list:
    """Each SSE event of ``stream`` parsed by the ``openai`` SDK's own types (strictly)."""
    import typing

    from openai.types.responses import ResponseStreamEvent

    union = typing.get_args(ResponseStreamEvent)[0]  # Annotated[Union[...], discriminator]
    by_type = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
               for cls in typing.get_args(union)}
    events = []
    for block in stream.decode().split("\n\n"):
        if not block:
            continue
        head, data = block.split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert head == "event: " + body["type"]
        events.append(by_type[body["type"]].model_validate(body))
    return events


def feed(events: ResponseEvents, deltas: list[dict], state: ChoiceState) -> bytes:
    out = events.start()
    for delta in deltas:
        out += events.delta(delta)
    closing, _ = events.finish([state], "completed", None)
    return b"".join(out + closing)


def test_stream_events_are_the_sdks_in_order():
    request = parse({"input": "x", "tools": [WEATHER]})
    state = new_states(request.chat)[0]
    events = ResponseEvents(request)
    deltas = [{"role": "assistant", "reasoning_content": "Think"}, {"reasoning_content": "ing"},
              {"content": "Let me check."},
              {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}]
    parsed = validate_events(feed(events, deltas, state))
    kinds = [e.type for e in parsed]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert kinds.count("response.output_item.added") == 3 == kinds.count(
        "response.output_item.done")
    assert "".join(e.delta for e in parsed if e.type == "response.reasoning_text.delta") == \
        "Thinking"
    done = next(e for e in parsed if e.type == "response.function_call_arguments.done")
    assert done.arguments == '{"city": "Paris"}'
    final = parsed[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Let me check."
    assert final.output[2].call_id == "call_1" and final.output[2].status == "completed"


def test_an_empty_answer_is_one_empty_message():
    request = parse({"input": "x"})
    parsed = validate_events(feed(ResponseEvents(request), [{"role": "assistant"}],
                                  new_states(request.chat)[0]))
    assert parsed[-1].response.output[0].type == "message"
    assert parsed[-1].response.output_text == ""


def test_store_evicts_the_least_recently_used_by_count_and_bytes():
    store = ResponseStore(":memory:", max_count=2, max_bytes=10_000)
    store.put("a", "r1", {"x": 1})
    store.put("a", "r2", {"x": 2})
    assert store.get("a", "r1") == {"x": 1}  # r1 is now the most recently used
    store.put("a", "r3", {"x": 3})
    assert store.get("a", "r2") is None and store.get("a", "r1") is not None
    assert store.evictions == 1 and store.totals()[0] == 2
    store.put("a", "big", {"x": "y" * 9_990})  # the bytes bound: the two others go
    assert store.totals()[0] == 1 and store.evictions == 3
    store.put("a", "huge", {"x": "y" * 20_000})  # larger than the bound alone: not kept
    assert store.get("a", "huge") is None and store.evictions == 4


def test_store_keeps_keys_apart_and_survives_in_its_file(tmp_path):
    path = str(tmp_path / "responses.db")
    store = ResponseStore(path, 10, 1 << 20)
    store.put("key-a", "r1", {"x": 1})
    assert store.get("key-b", "r1") is None and not store.delete("key-b", "r1")
    store.close()
    again = ResponseStore(path, 10, 1 << 20)
    assert again.get("key-a", "r1") == {"x": 1}
    assert again.delete("key-a", "r1") and again.get("key-a", "r1") is None


def test_a_backend_error_names_the_responses_field():
    from kvflow.openai_api.errors import error_from_backend
    from kvflow.openai_api.responses_request import client_error

    request = parse({"input": "x", "max_output_tokens": 10**9})
    error = client_error(error_from_backend("max_tokens (1000000000) exceeds max_model_len",
                                            request.chat))
    assert error.param == "max_output_tokens"
    assert error.message.startswith("max_output_tokens (1000000000)")
    prompt = client_error(error_from_backend("messages[0].content is too long", request.chat))
    assert prompt.param == "input" and prompt.message.startswith("input[0]")
