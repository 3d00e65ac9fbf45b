"""Tool-call parsers on recorded outputs: whole, and streamed in random chunks, the same calls
and content come out; deltas name a call first, then its argument fragments."""

from __future__ import annotations

import json
import random

import pytest

from kvflow.openai_api.tool_parsers import TOOL_PARSERS, JsonListParser
from kvflow.text.chat_tools import tool_call_format
from tests.helpers import byte_level_tokenizer

PARSERS = {**TOOL_PARSERS, "json_list": JsonListParser}

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
    # tool_choice required: llguidance holds the output to this shape.
    "json_list": [
        ('[{"name": "add", "parameters": {"a": 1, "b": "[}"}}, {"name": "now", '
         '"parameters": {}}]', "", [("add", {"a": 1, "b": "[}"}), ("now", {})]),
        ('[{"name": "add", "parameters": {"a": 1', "", [("add", '{"a": 1')]),
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
    parser = PARSERS[name]()
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


def test_tool_call_format_from_the_chat_template():
    assert tool_call_format("{% if tools %}{{ '<|python_tag|>' }}{% endif %}") == "llama3_json"
    assert tool_call_format("{% for t in tools %}[func_name1(a=1)]{% endfor %}") == "pythonic"
    # No tools in the template: kvflow's fallback prompt, in the hermes format.
    assert tool_call_format("{{ '<|python_tag|>' }}") == "hermes"
    assert tool_call_format(None) == "hermes"


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
    from kvflow.openai_api.tools import parse_tool_choice
    from kvflow.text.chat_tools import parse_tools

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    tools = parse_tools([weather])
    assert tools[0].name == "get_weather" and parse_tools([]) == () == parse_tools(None)
    for bad, field in [([{"type": "code_interpreter"}], "tools[0].type"),
                       ([{"type": "function", "function": {"name": "a b"}}],
                        "tools[0].function.name"),
                       ([weather, weather], "tools[1].function.name")]:
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
            parse_tools(bad)
    assert parse_tool_choice(None, tools) == "auto" and parse_tool_choice(None, []) == "none"
    assert parse_tool_choice("auto", []) == "none"  # tools: [] is a plain chat
    assert parse_tool_choice({"type": "function", "function": {"name": "get_weather"}},
                             tools) == "get_weather"
    with pytest.raises(ValueError, match="not in tools"):
        parse_tool_choice({"type": "function", "function": {"name": "nope"}}, tools)
    with pytest.raises(ValueError, match="tool_choice must be one of"):
        parse_tool_choice("sometimes", tools)


def test_required_schema_guarantees_a_valid_call():
    """The schema accepts exactly calls of the tools with valid arguments."""
    import jsonschema

    from kvflow.openai_api.tools import required_schema
    from kvflow.text.chat_tools import parse_tools

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
    jsonschema.validate([{"name": "now", "parameters": {}}], named)
    for bad in ([{"name": "add", "parameters": {"a": 1}}],
                [{"name": "now", "parameters": {}}] * 2):  # a named function: one call
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, named)
    several = required_schema(tools, "required", parallel=True)
    jsonschema.validate([{"name": "now", "parameters": {}}] * 2, several)
    _, calls = JsonListParser().parse('[{"name": "add", "parameters": {"a": 2}}]')
    assert [(c.name, c.arguments) for c in calls] == [("add", '{"a": 2}')]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}


def test_tool_plans():
    """none leaves the tools out; required and a named tool constrain the output to a call;
    auto constrains hermes calls once begun, unless the request constrains the output."""
    from kvflow.openai_api.tools import plan_tools

    assert plan_tools({"tools": []}, "hermes").choice == "none"
    none = plan_tools({"tools": [WEATHER], "tool_choice": "none"}, "hermes")
    assert none.tools == () and none.parser is None and not none.constraint
    required = plan_tools({"tools": [WEATHER], "tool_choice": "required"}, "hermes")
    assert set(required.constraint) == {"guided_json"} and required.parser.name == "json_list"
    named = plan_tools({"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, "pythonic")
    assert named.choice == "get_weather" and "guided_json" in named.constraint
    auto = plan_tools({"tools": [WEATHER]}, "hermes")
    assert set(auto.constraint) == {"guided_grammar"} and auto.parser.name == "hermes"
    assert not plan_tools({"tools": [WEATHER]}, "llama3_json").constraint
    assert not plan_tools({"tools": [WEATHER], "response_format": {"type": "json_object"}},
                          "hermes").constraint
    with pytest.raises(ValueError, match="not both"):
        plan_tools({"tools": [WEATHER], "tool_choice": "required",
                    "guided_regex": "a+"}, "hermes")
    bad = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.parameters \(broken\)"):
        plan_tools({"tools": [WEATHER, bad], "tool_choice": "required"}, "hermes")


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_grammar_leaves_text_free_and_holds_calls_to_the_schema(parallel):
    import llguidance
    from llguidance import LLMatcher

    from kvflow.openai_api.tools import auto_grammar
    from kvflow.text.chat_tools import parse_tools

    tok = byte_level_tokenizer()
    grammar = llguidance.grammar_from("grammar", auto_grammar(parse_tools([WEATHER]), parallel))
    lltok = llguidance.LLTokenizer(tok.to_str())

    def accepts(text: str) -> bool:
        matcher = LLMatcher(lltok, grammar, log_level=0)
        assert not matcher.get_error()
        return all(matcher.consume_token(t) for t in tok.encode(text).ids) and \
            matcher.is_accepting()

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts("Just text: 2 < 3, <tool_ is not a call.")
    assert accepts(f"Let me check. {call}")
    assert accepts(f"Let me check. {call} Done.") == parallel  # one call ends the output
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}')
    assert not accepts('<tool_call>\n{"name": "get_time", "arguments": {}}')
    assert not accepts("<tool_call> hello")
    assert accepts(f"{call}{call}") == parallel


def test_chat_output_whole_and_streamed_agree():
    """Reasoning, content and calls of one output: the whole message, and the stream's deltas
    merged, are the same; a response's tokens inside the reasoning count as reasoning."""
    from kvflow.openai_api.chat_output import ChatOutput
    from kvflow.openai_api.reasoning import reasoning_parser
    from kvflow.openai_api.tools import plan_tools

    text = ('<think>The user wants weather.</think>Checking.\n<tool_call>\n{"name": '
            '"get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    plan = plan_tools({"tools": [WEATHER]}, "hermes")
    whole = ChatOutput(plan, reasoning_parser("think"))
    message = whole.message(text)
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] == "Checking."
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == \
        "length"
    for seed in range(10):
        rng = random.Random(seed)
        out = ChatOutput(plan, reasoning_parser("think"))
        merged: dict = {"reasoning_content": "", "content": "", "args": "", "names": []}
        i, sofar = 0, ""
        while i < len(text):
            piece = text[i:i + rng.randint(1, 6)]
            i += len(piece)
            sofar += piece
            out.count(sofar, piece, 1)
            delta = out.feed(piece, final=i >= len(text))
            merged["reasoning_content"] += delta.get("reasoning_content", "")
            merged["content"] += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                if "name" in call["function"]:
                    merged["names"].append(call["function"]["name"])
                merged["args"] += call["function"]["arguments"]
        assert merged["reasoning_content"] == message["reasoning_content"]
        assert merged["content"] == message["content"]
        assert merged["names"] == ["get_weather"]
        assert merged["args"] == message["tool_calls"][0]["function"]["arguments"]
        # One token per response: those of "<think>...</think>" are the reasoning's.
        end = text.index("</think>") + len("</think>")
        assert abs(out.reasoning_tokens(text) - _responses_until(text, end, seed)) <= 1


def _responses_until(text: str, end: int, seed: int) -> int:
    rng = random.Random(seed)
    i = n = 0
    while i < end:
        i += rng.randint(1, 6)
        n += 1
    return n
