"""Tool-call parsers on recorded outputs: whole, and streamed in random chunks, the same calls
and content come out; deltas name a call first, then its argument fragments."""

from __future__ import annotations

import json
import random

import pytest

from kvflow.openai_api.tool_parsers import TOOL_PARSERS, detect_parser

CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
         '</tool_call>', "", [("get_weather", {"city": "Paris", "unit": "c"})]),
        ('Let me check.\n<tool_call>{"name": "a", "arguments": {"x": "}{\\"", "y": [1, {}]}}'
         '</tool_call>\n<tool_call>{"arguments": {}, "name": "b"}</tool_call>',
         "Let me check.", [("a", {"x": '}{"', "y": [1, {}]}), ("b", {})]),
        ("No tools needed: 2 < 3 and <tool_ is not a call.", "No tools needed: 2 < 3 and "
         "<tool_ is not a call.", []),
        # Cut off by max_tokens: the call keeps what it has (finish_reason says length).
        ('Cut off <tool_call>{"name": "f", "arguments": {"a": 1', "Cut off", [("f", '{"a": 1')]),
        ('Cut <tool_call>{"na', 'Cut <tool_call>{"na', []),
    ],
    "llama3_json": [
        ('{"name": "search", "parameters": {"query": "kv cache"}}', "",
         [("search", {"query": "kv cache"})]),
        ('<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {}}',
         "", [("a", {"n": 1}), ("b", {})]),
        ("The answer is 42.", "The answer is 42.", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3), now()]', "",
         [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]),
        ("Plain text, no calls.", "Plain text, no calls.", []),
    ],
}


def reassemble(parser, text: str, seed: int):
    """Stream ``text`` in random chunks: (content, [(name, arguments)], first piece per call)."""
    rng = random.Random(seed)
    stream = parser.stream()
    deltas = []
    i = 0
    while i < len(text):
        n = rng.randint(1, 7)
        deltas += stream.feed(text[i:i + n])
        i += n
    deltas += stream.finish()
    content = "".join(d.content for d in deltas if d.index is None)
    calls: dict[int, list] = {}
    for d in deltas:
        if d.index is None:
            continue
        if d.id is not None:
            assert d.index not in calls, "a call's id and name come once"
            calls[d.index] = [d.name, ""]
        else:
            assert d.index in calls, "arguments before the call's name"
            calls[d.index][1] += d.arguments
    return content, [tuple(calls[k]) for k in sorted(calls)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_and_streamed_outputs_give_the_same_calls(name):
    parser = TOOL_PARSERS[name]()
    for text, want_content, want_calls in CASES[name]:
        content, calls = parser.parse(text)
        assert content == want_content
        assert [(c.name, _args(c.arguments)) for c in calls] == want_calls
        for seed in range(20):
            s_content, s_calls = reassemble(parser, text, seed)
            assert s_content == content, (text, seed)
            assert s_calls == [(c.name, c.arguments) for c in calls], (text, seed)


def _args(text: str):
    """Arguments as JSON, or the raw text of a call cut off."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def test_openai_shapes():
    parser = TOOL_PARSERS["hermes"]()
    stream = parser.stream()
    deltas = stream.feed('<tool_call>{"name": "f", "arguments": {"a"') + stream.finish()
    first = deltas[0].to_openai()["tool_calls"][0]
    assert first["function"]["name"] == "f" and first["id"].startswith("call_")
    assert first["type"] == "function" and first["index"] == 0
    _, calls = parser.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert calls[0].to_openai()["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_detect_parser_from_the_chat_template():
    assert detect_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_parser(None) == "hermes"


@pytest.mark.parametrize("starts_open", [False, True])
def test_reasoning_split_whole_and_streamed(starts_open):
    from kvflow.openai_api.reasoning import ReasoningParser

    parser = ReasoningParser(starts_open=starts_open)
    opening = "" if starts_open else "<think>"
    cases = [
        (f"{opening}First, 2 < 3; so </thin is not the end.</think>The answer: 3.",
         "First, 2 < 3; so </thin is not the end.", "The answer: 3."),
        (f"{opening}cut off while thinking <", "cut off while thinking <", None),
    ]
    if not starts_open:
        cases.append(("No reasoning at all <th", None, "No reasoning at all <th"))
    for text, reasoning, content in cases:
        whole = parser.split(text)
        assert (whole.reasoning, whole.content) == (reasoning, content)
        for seed in range(20):
            rng = random.Random(seed)
            stream, parts, i = parser.stream(), [], 0
            while i < len(text):
                n = rng.randint(1, 5)
                parts.append(stream.feed(text[i:i + n]))
                i += n
            parts.append(stream.finish())
            assert "".join(r for r, _ in parts) == (reasoning or "")
            assert "".join(c for _, c in parts) == (content or "")


def test_tools_and_tool_choice_are_checked_naming_the_field():
    from kvflow.openai_api.tools import parse_tool_choice, parse_tools

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    tools = parse_tools([weather])
    assert tools[0].name == "get_weather" and parse_tools([]) == [] == parse_tools(None)
    for bad, field in [([{"type": "code_interpreter"}], "tools[0].type"),
                       ([{"type": "function", "function": {"name": "a b"}}],
                        "tools[0].function.name"),
                       ([weather, weather], "tools[1].function.name")]:
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
            parse_tools(bad)
    assert parse_tool_choice(None, tools) == "auto" and parse_tool_choice(None, []) == "none"
    assert parse_tool_choice({"type": "function", "function": {"name": "get_weather"}},
                             tools) == "get_weather"
    with pytest.raises(ValueError, match="not in tools"):
        parse_tool_choice({"type": "function", "function": {"name": "nope"}}, tools)
    with pytest.raises(ValueError, match="tool_choice must be one of"):
        parse_tool_choice("sometimes", tools)


def test_required_schema_guarantees_a_valid_call():
    """The schema accepts exactly calls of the tools with valid arguments."""
    import jsonschema

    from kvflow.openai_api.tools import calls_of_required, parse_tools, required_schema

    tools = parse_tools([
        {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}},
            "required": ["a"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "now"}}])
    one = required_schema(tools, "required", parallel=False)
    jsonschema.validate([{"name": "add", "parameters": {"a": 1}}], one)
    for bad in ([], [{"name": "add", "parameters": {"a": "x"}}],
                [{"name": "sub", "parameters": {}}],
                [{"name": "now", "parameters": {}}, {"name": "now", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, one)
    named = required_schema(tools, "now", parallel=True)
    jsonschema.validate([{"name": "now", "parameters": {}}] * 2, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "parameters": {"a": 1}}], named)
    assert calls_of_required('[{"name": "add", "parameters": {"a": 2}}]') == [("add", '{"a": 2}')]
