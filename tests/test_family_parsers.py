"""The families' own tool-call formats (``mistral``, ``phi4_mini_json``) and the reasoning
parser Qwen3's template implies: recorded outputs, whole and streamed; any text split anywhere
reads as the whole and never raises; real calls come back as written; the cost is linear."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.openai_api.reasoning import reasoning_parser
from kvflow.openai_api.tool_parsers import TOOL_PARSERS
from kvflow.text.chat_tools import reasoning_format
from tests.family_tokenizers import TEMPLATES
from tests.test_tool_streams import calls, prose, split, streamed, whole

FORMATS = ("mistral", "phi4_mini_json")
CASES = {
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "now", "arguments": {}}]', "",
         [("get_weather", {"city": "Paris"}), ("now", {})]),
        # skip_special_tokens (the default) leaves the marker out: the list alone is read
        (' [{"name": "f", "parameters": {"a": [1, "]"]}}]', "", [("f", {"a": [1, "]"]})]),
        ('Let me look. [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]', "Let me look.",
         [("f", {"a": 1})]),
        ("[1, 2] is a list, [TOOL_CALLS is not a marker.",
         "[1, 2] is a list, [TOOL_CALLS is not a marker.", []),
        ('[{"a": 1}] has no name', '[{"a": 1}] has no name', []),
        ("[TOOL_CALLS] then prose", "[TOOL_CALLS] then prose", []),
        ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1', "", [("f", '{"a": 1')]),
        # Mistral Small 3.2, Devstral, Ministral 3: name[ARGS]{...}, a marker per call
        ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "P}a\\"ris"}[TOOL_CALLS]now[ARGS] {}',
         "Sure.", [("get_weather", {"city": 'P}a"ris'}), ("now", {})]),
        ("[TOOL_CALLS]not a call", "[TOOL_CALLS]not a call", []),
        ('[TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{"q": 1}', "", [("f", {"q": 1})]),
        ('[TOOL_CALLS]f[ARGS]{"a": [1, 2', "", [("f", '{"a": [1, 2')]),
    ],
    "phi4_mini_json": [
        ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
         '<|/tool_call|>', "", [("get_weather", {"city": "Paris"})]),
        ('Sure. <|tool_call|>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": '
         '{"x": "<|/tool_call|>"}}]<|/tool_call|>', "Sure.",
         [("a", {}), ("b", {"x": "<|/tool_call|>"})]),
        ('functools[{"name": "f", "parameters": {"q": 1}}]', "", [("f", {"q": 1})]),
        ('[{"name": "f", "arguments": {"q": 1}}]', "", [("f", {"q": 1})]),
        ("import functools; functools.reduce", "import functools; functools.reduce", []),
        ("The tool <|tool_ is cut", "The tool <|tool_ is cut", []),
    ],
}


@pytest.mark.parametrize("name", FORMATS)
def test_recorded_outputs_whole_and_streamed(name):
    parser = TOOL_PARSERS[name]()
    for text, content, want in CASES[name]:
        got_content, got = parser.parse(text)
        assert got_content == content, text
        assert [(c.name, _json_or_text(c.arguments)) for c in got] == want, text
        for cuts in ([1] * 3, [2, 5, 9, 13, 21], list(range(0, len(text), 3))):
            assert streamed(parser, split(text, cuts)) == whole(parser, text), (text, cuts)


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


SYNTAX = ["[TOOL_CALLS]", "[ARGS]", "[AR", "f", "<|tool_call|>", "<|/tool_call|>", "functools",
          "[TOOL_", "<|tool", "[", "]", "{", "}", '"', "\\", ":", ",", " ", "\n", '"name"',
          '"arguments"', '"parameters"', '"f"', "1", "x"]
texts = st.one_of(st.text(max_size=60), st.lists(st.sampled_from(SYNTAX), max_size=30).map(
    "".join))


@settings(max_examples=300)
@given(text=texts, cuts=st.lists(st.integers(0, 10_000), max_size=12),
       name=st.sampled_from(FORMATS))
def test_any_text_split_anywhere_reads_as_the_whole_and_never_raises(text, cuts, name):
    parser = TOOL_PARSERS[name]()
    assert streamed(parser, split(text, cuts)) == whole(parser, text)


def written(fmt: str, lead: str, cs: list[tuple[str, dict]], marked: bool) -> str:
    listed = json.dumps([{"name": n, "arguments": a} for n, a in cs])
    if not marked:
        return listed
    if fmt == "mistral":
        return f"{lead}[TOOL_CALLS]{listed}"
    if fmt == "mistral_args":
        return lead + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in cs)
    return f"{lead}<|tool_call|>{listed}<|/tool_call|>"


@settings(max_examples=200)
@given(fmt=st.sampled_from((*FORMATS, "mistral_args")), cs=calls, lead=prose,
       marked=st.booleans(), cuts=st.lists(st.integers(0, 10_000), max_size=20))
def test_real_calls_split_anywhere_come_back_as_written(fmt, cs, lead, marked, cuts):
    text = written(fmt, lead, cs, marked)
    parser = TOOL_PARSERS[fmt.removesuffix("_args")]()
    content, got, complete = whole(parser, text)
    assert complete
    assert [(n, json.loads(a)) for n, a in got] == [
        (n, json.loads(json.dumps(a))) for n, a in cs]
    assert content == (lead.rstrip() if marked and lead.strip() else "")
    assert streamed(parser, split(text, cuts)) == (content, got, complete)


@pytest.mark.parametrize("fmt", (*FORMATS, "mistral_args"))
def test_a_stream_looks_at_each_character_a_bounded_number_of_times(fmt):
    text = "Looking. " + written(fmt, "", [(f"f{i}", {"q": "z" * 300, "n": [1, {"k": None}]})
                                          for i in range(20)], True)
    scanned = {}
    for size in (1, 3, 16, len(text)):
        stream = TOOL_PARSERS[fmt.removesuffix("_args")]().stream()
        for i in range(0, len(text), size):
            stream.feed(text[i:i + size])
        stream.finish()
        assert len(stream.calls) == 20
        scanned[size] = stream.chars_scanned
        assert scanned[size] <= 3 * len(text), (size, scanned[size], len(text))
    assert scanned[1] <= 2 * scanned[len(text)] + 64


@pytest.mark.parametrize("text", ["[" * 5000, "[TOOL_CALLS]" + "[" * 5000,
                                  '[{"name": "f", "arguments": ' + "{" * 5000,
                                  '<|tool_call|>[{"name": "\\ud800", "arguments": {}}]'])
def test_no_output_raises(text):
    for fmt in FORMATS:
        parser = TOOL_PARSERS[fmt]()
        assert streamed(parser, split(text, [7, 100, 4000])) == whole(parser, text)


def test_qwen3_thinking_splits_with_the_parser_its_template_implies():
    template = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    parser = reasoning_parser(reasoning_format(template))
    assert parser is not None
    out = parser.split("<think>\nThe user wants Paris.\n</think>\n\n<tool_call>\n{}\n"
                       "</tool_call>")
    assert out.reasoning == "\nThe user wants Paris.\n"
    assert out.content == "\n\n<tool_call>\n{}\n</tool_call>"
    # enable_thinking false: the prompt holds an empty <think></think>, the output none
    assert parser.split("Paris is sunny.").content == "Paris is sunny."
