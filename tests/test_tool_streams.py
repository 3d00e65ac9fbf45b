"""Tool-call streams as properties: any text, split anywhere, reads as the whole text does and
never raises; real calls of every format come back as written; and a stream looks at each
character a bounded number of times, however many pieces it comes in."""

from __future__ import annotations

import json
import keyword

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.openai_api.chat_output import ChatOutput
from kvflow.openai_api.reasoning import ReasoningParser
from kvflow.openai_api.tool_parsers import TOOL_PARSERS, JsonListParser, python_calls
from kvflow.openai_api.tools import plan_tools

PARSERS = {**TOOL_PARSERS, "json_list": JsonListParser}
# Pieces of every format's syntax, so that random text often comes close to a call.
SYNTAX = ["<tool_call>", "</tool_call>", "<tool_", "{", "}", "[", "]", '"', "\\", ":", ",",
          " ", "\n", '"name"', '"arguments"', '"parameters"', '"f"', "<|python_tag|>", ";",
          "f(", ")", "a=", "1", "'", "#", "b'x'", "{1, 2}", "1j", "1e999", "<think>",
          "</think>", "\\ud800"]
texts = st.one_of(st.text(max_size=60), st.lists(st.sampled_from(SYNTAX), max_size=30).map(
    "".join))


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


def streamed(parser, pieces: list[str]):
    """(content, [(name, arguments)], complete) of a stream fed ``pieces``."""
    stream = parser.stream()
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.index is not None:
            if d.id is not None:
                assert d.index not in calls, "a call's id and name come once"
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    return ("".join(d.content for d in deltas if d.index is None),
            [tuple(calls[k]) for k in sorted(calls)], stream.complete)


def whole(parser, text: str):
    out = parser.read(text)
    for call in out.calls:  # the response can hold them: no lone surrogate from "\ud800"
        (call.name + call.arguments).encode("utf-8")
    return out.content, [(c.name, c.arguments) for c in out.calls], out.complete


@settings(max_examples=300)
@given(text=texts, cuts=st.lists(st.integers(0, 10_000), max_size=12),
       name=st.sampled_from(sorted(PARSERS)))
def test_any_text_split_anywhere_reads_as_the_whole_and_never_raises(text, cuts, name):
    parser = PARSERS[name]()
    assert streamed(parser, split(text, cuts)) == whole(parser, text)


@settings(max_examples=100)
@given(text=texts, cuts=st.lists(st.integers(0, 10_000), max_size=12), open_=st.booleans())
def test_reasoning_split_anywhere_reads_as_the_whole(text, cuts, open_):
    parser = ReasoningParser(starts_open=open_)
    stream = parser.stream()
    parts = [stream.feed(p) for p in split(text, cuts)] + [stream.finish()]
    split_whole = parser.split(text)
    assert "".join(r for r, _ in parts) == (split_whole.reasoning or "")
    assert "".join(c for _, c in parts) == (split_whole.content or "")


# --- real calls of each format ---------------------------------------------------------------
names = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=6), inner, max_size=3), max_leaves=8)
identifiers = names.filter(lambda n: not keyword.iskeyword(n))
calls = st.lists(st.tuples(names, st.dictionaries(identifiers, values, max_size=4)),
                 min_size=1, max_size=3)
prose = st.text(st.characters(blacklist_characters="<[{", blacklist_categories=["Cs"]),
                max_size=30)


def written(fmt: str, lead: str, cs: list[tuple[str, dict]]) -> str:
    """The calls as a model writes them in format ``fmt`` (``lead``: text before, hermes)."""
    if fmt == "hermes":
        return lead + "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n"
                              "</tool_call>\n" for n, a in cs)
    if fmt == "llama3_json":
        return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a})
                                            for n, a in cs)
    if fmt == "json_list":
        return json.dumps([{"name": n, "parameters": a} for n, a in cs])
    if fmt == "mistral":
        return lead + "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in cs])
    if fmt == "phi4_mini_json":
        return (lead + "<|tool_call|>" + json.dumps([{"name": n, "arguments": a} for n, a in cs])
                + "<|/tool_call|>")
    return "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})"
                           for n, a in cs) + "]"


@settings(max_examples=200)
@given(fmt=st.sampled_from(sorted(PARSERS)), cs=calls, lead=prose,
       cuts=st.lists(st.integers(0, 10_000), max_size=20))
def test_real_calls_split_anywhere_come_back_as_written(fmt, cs, lead, cuts):
    text = written(fmt, lead, cs)
    parser = PARSERS[fmt]()
    content, got, complete = whole(parser, text)
    assert complete
    assert [(n, json.loads(a)) for n, a in got] == [
        (n, json.loads(json.dumps(a))) for n, a in cs]
    led = fmt in ("hermes", "mistral", "phi4_mini_json")
    assert content == (lead.strip() and lead.rstrip() if led else "")
    assert streamed(parser, split(text, cuts)) == (content, got, complete)


# --- what a model may write that is not a call -------------------------------------------------
@pytest.mark.parametrize("text", [
    '[f(a=b"x")]', "[f(a={1,2})]", "[f(a=1j)]", "[f(a=1e999)]", "[f(**kw)]", "[f(1)]",
    '[f(a="\\ud800")]', '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
    "[" * 5000, "[f(a=" + "(" * 300 + ")" * 300 + ")]", "[f(a=1" + "0" * 5000 + ")]",
    '<tool_call>{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}</tool_call>",
    '{"name": "f", "parameters": ' + "[" * 5000 + "]" * 5000 + "}",
    '[{"name": "f", "parameters": ' + "{" * 5000,
])
def test_no_output_raises(text):
    for parser in PARSERS.values():
        content, calls, complete = whole(parser(), text)
        assert streamed(parser(), split(text, [7, 100, 4000])) == (content, calls, complete)
        for _, arguments in calls:  # a call claimed complete has arguments that parse
            assert not complete or json.loads(arguments) is not None
    assert python_calls('[f(a=b"x")]') is None and python_calls("[f(a=1j)]") is None


# --- the cost ----------------------------------------------------------------------------------
LONG = {
    "hermes": "Let me look. " + "".join(
        f'<tool_call>\n{{"name": "f{i}", "arguments": {{"text": "{"x" * 300}\\" }}{{", '
        f'"n": [1, 2, {{"k": null}}]}}}}\n</tool_call>\n' for i in range(20)),
    "llama3_json": "; ".join(f'{{"name": "f{i}", "parameters": {{"q": "{"y" * 300}"}}}}'
                             for i in range(20)),
    "json_list": "[" + ", ".join(f'{{"name": "f{i}", "parameters": {{"q": "{"z" * 300}"}}}}'
                                 for i in range(20)) + "]",
    "pythonic": "[" + ", ".join(f'f{i}(q="{"w" * 300}", n=[1, 2])' for i in range(20)) + "]",
}


@pytest.mark.parametrize("fmt", sorted(LONG))
def test_a_stream_looks_at_each_character_a_bounded_number_of_times(fmt):
    """However finely the output is split, the work is O(its length): the characters the
    stream looks at (an instrumented count) stay under a small multiple of the text's."""
    text = LONG[fmt]
    scanned = {}
    for size in (1, 3, 16, len(text)):
        stream = PARSERS[fmt]().stream()
        for i in range(0, len(text), size):
            stream.feed(text[i:i + size])
        stream.finish()
        assert len(stream.calls) == 20
        scanned[size] = stream.chars_scanned
        assert scanned[size] <= 3 * len(text), (size, scanned[size], len(text))
    # One character a piece costs no more than a small constant over the whole at once.
    assert scanned[1] <= 2 * scanned[len(text)] + 64


def test_a_stop_string_that_cuts_a_call_finishes_as_length():
    """``stop: ["}"]`` under tool_choice required: the call's JSON is cut, so the choice is
    no finished call; whole and streamed agree."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    required = plan_tools({"tools": [weather], "tool_choice": "required"}, "hermes")
    auto = plan_tools({"tools": [weather]}, "hermes")
    for plan, text, reason in [
            (required, '[{"name": "get_weather", "parameters": {"city": "Paris"', "length"),
            (required, '[{"name": "get_weather", "parameters": {"city": "Paris"}}', "length"),
            (required, '[{"na', "length"),
            (required, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
             "tool_calls"),
            (auto, 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "P',
             "length"),
            (auto, '<tool_call>{"name": "get_weather", "arguments": {"city": "P"}}',
             "tool_calls"),
            (auto, "No call here.", "stop")]:
        out = ChatOutput(plan, None)
        out.message(text)
        assert out.finish_reason("stop") == reason, text
        assert out.finish_reason("length") == "length"
        stream = ChatOutput(plan, None)
        for i in range(0, len(text), 4):
            stream.feed(text[i:i + 4], final=i + 4 >= len(text))
        assert stream.finish_reason("stop") == reason, text
