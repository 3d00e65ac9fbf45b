"""Tool schemas through the real tritonserver and frontend, with the default model: Pydantic's
``$defs`` (what LangChain and the OpenAI Agents SDK send) and a recursive model under
tool_choice required, named and auto give calls whose arguments validate; parameters that are
not an object are a 400 naming the field; a stop string that cuts a constrained call finishes
the choice as ``length``, never as ``tool_calls`` with arguments that do not parse."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

pytestmark = pytest.mark.slow  # tritonserver and the frontend


# extra="forbid" (additionalProperties false), as the OpenAI Agents SDK's strict schemas: a
# 135M model otherwise goes on writing keys of its own until max_tokens.
class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    street: str = Field(max_length=20)
    city: str = Field(max_length=20)


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=20)
    home: Address


class Node(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: int
    children: list[Node] = Field(default=[], max_length=2)


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"Record a {name}",
                                             "parameters": parameters}}


PERSON, NODE = tool("person", Person.model_json_schema()), tool("node", Node.model_json_schema())
WEATHER = tool("get_weather", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False})
ASK = [{"role": "user", "content": "Alice lives at 3 Main St in Paris. Record her."}]
GREEDY = {"max_tokens": 120, "temperature": 0}


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_pydantic_defs_give_calls_whose_arguments_validate(client, model, choice):
    tools = [PERSON, WEATHER]
    tool_choice = ({"type": "function", "function": {"name": "person"}} if choice == "named"
                   else choice)
    r = client.chat.completions.create(model=model, messages=ASK, tools=tools,
                                       tool_choice=tool_choice, **GREEDY)
    message, reason = r.choices[0].message, r.choices[0].finish_reason
    if choice != "auto":
        assert reason == "tool_calls" and len(message.tool_calls or []) >= 1, message
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if choice == "named":
        assert message.tool_calls[0].function.name == "person"
    assert (reason == "tool_calls") == bool(message.tool_calls) or reason == "length"


def test_a_recursive_model_is_followed_down_its_recursion(client, model):
    """The 135M model, greedy, nests children until max_tokens: the call is held to Node's
    shape all the way down (its $ref resolves in the tool's schema), and is cut as length."""
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Make a tree of 1, 2 and 3."}],
        tools=[NODE], tool_choice="required", **GREEDY)
    choice = r.choices[0]
    arguments = choice.message.tool_calls[0].function.arguments
    assert choice.finish_reason in ("tool_calls", "length"), choice
    if choice.finish_reason == "tool_calls":
        jsonschema.validate(json.loads(arguments), NODE["function"]["parameters"])
    else:
        assert arguments.startswith('{"value": ') and '"children": [{"value": ' in arguments


@pytest.mark.parametrize("parameters, words", [
    ({"type": "string"}, "must describe an object"),
    ({"type": "array", "items": {"type": "integer"}}, "must describe an object"),
    ({"$ref": "#"}, "leads only back to itself"),
])
def test_parameters_that_are_not_an_object_are_400s_naming_the_field(client, model,
                                                                      parameters, words):
    for tool_choice in ("required", "auto"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=ASK, **GREEDY,
                                           tools=[WEATHER, tool("bad", parameters)],
                                           tool_choice=tool_choice)
        message = e.value.body["message"]
        assert "tools[1].function.parameters" in message and words in message, message


def test_a_stop_string_that_cuts_the_call_finishes_as_length(client, model):
    ask = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    body = {"model": model, "messages": ask, "tools": [WEATHER], "tool_choice": "required",
            "stop": ["}"], **GREEDY}
    whole = client.chat.completions.create(**body).choices[0]
    calls = whole.message.tool_calls or []
    assert whole.finish_reason == "length", whole
    reason, arguments = None, ""
    for chunk in client.chat.completions.create(**body, stream=True):
        for piece in chunk.choices[0].delta.tool_calls or []:
            arguments += piece.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "length"
    assert arguments == "".join(c.function.arguments for c in calls)
    # Without the stop string the same call is whole.
    body.pop("stop")
    full = client.chat.completions.create(**body).choices[0]
    assert full.finish_reason == "tool_calls"
    json.loads(full.message.tool_calls[0].function.arguments)
