"""Tool parameters' schemas as clients write them: Pydantic's ``$defs`` and ``$ref``, version
1's ``definitions``, recursive models, an ``$id``; each resolves against the tool's own schema
under tool_choice required, named and auto, and what llguidance generates from the call's
schema parses into arguments that validate. A schema that describes no object, or no value at
all, is refused naming ``tools[i].function.parameters``."""

from __future__ import annotations

import json
import random

import jsonschema
import llguidance
import pytest
from llguidance import LLMatcher
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from pydantic import BaseModel

from kvflow.openai_api.tool_parsers import HermesParser, JsonListParser
from kvflow.openai_api.tools import auto_grammar, plan_tools, required_schema
from kvflow.orchestrator.sampling.structured import JSON_OPTIONS
from kvflow.text.chat_tools import parse_tools
from kvflow.text.tool_schema import embedded_parameters
from tests.helpers import byte_level_tokenizer


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    home: Address
    past: list[Address] = []


class Node(BaseModel):
    value: int
    children: list[Node] = []


ADDRESS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SCHEMAS = {
    "pydantic nested": Person.model_json_schema(),
    "pydantic recursive": Node.model_json_schema(),
    "definitions": {"type": "object", "properties": {"to": {"$ref": "#/definitions/A"}},
                    "required": ["to"], "definitions": {"A": ADDRESS}},
    "recursive #": {"type": "object", "properties": {"value": {"type": "integer"}, "kids": {
        "type": "array", "items": {"$ref": "#"}, "maxItems": 2}}, "required": ["value"],
        "additionalProperties": False},
    "$id": {"$id": "https://example.com/p.json", "type": "object",
            "properties": {"at": {"$ref": "#/$defs/A"}}, "required": ["at"],
            "$defs": {"A": ADDRESS}},
    "no type": {"properties": {"q": {"type": "string"}}, "required": ["q"]},
}


DEEP: dict = {"type": "object"}
for _ in range(3000):
    DEEP = {"allOf": [DEEP]}


def tool(name: str, parameters: object) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOK = byte_level_tokenizer()
LLTOK = llguidance.LLTokenizer(TOK.to_str())
# Closing characters first: a walk that prefers them ends soon, whatever the schema.
PREFERRED = [TOK.token_to_id(c) for c in '"]}0,']


def generate(grammar: str, seed: int, prefix: str = "") -> str:
    """A random output the grammar accepts, one byte a token (``prefix`` forced first)."""
    rng = random.Random(seed)
    matcher = LLMatcher(LLTOK, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    out = prefix
    assert matcher.consume_tokens(TOK.encode(prefix).ids) if prefix else True
    mask = allocate_token_bitmask(1, LLTOK.vocab_size)
    for _ in range(3000):
        if matcher.is_stopped():
            break
        fill_next_token_bitmask(matcher, mask, 0)
        allowed = [t for t in range(LLTOK.vocab_size) if (mask[0][t // 32] >> (t % 32)) & 1]
        assert allowed, "the grammar allows nothing: no output can complete it"
        if matcher.is_accepting() and LLTOK.eos_token in allowed:
            break
        ok = [t for t in PREFERRED if t in allowed]
        token = rng.choice(ok) if ok and rng.random() < 0.7 else rng.choice(allowed)
        assert matcher.consume_token(token)
        out += TOK.decode([token])
    assert matcher.is_accepting(), out
    return out


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_references_resolve_in_the_tools_own_schema(kind):
    schema = SCHEMAS[kind]
    tools = [tool("lookup", schema), tool("other", ADDRESS)]
    for choice in ("required", {"type": "function", "function": {"name": "lookup"}}, "auto"):
        plan = plan_tools({"tools": tools, "tool_choice": choice}, "hermes")
        assert plan.constraint, choice
    constraint = required_schema(parse_tools(tools), "lookup", parallel=False)
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(constraint), overrides=JSON_OPTIONS)
    validator = jsonschema.Draft202012Validator(
        {k: v for k, v in schema.items() if k != "$id"})
    texts = [generate(grammar, seed) for seed in range(12)]
    for text in texts:
        read = JsonListParser().read(text)
        assert read.complete and [c.name for c in read.calls] == ["lookup"], text
        arguments = json.loads(read.calls[0].arguments)
        assert isinstance(arguments, dict)
        validator.validate(arguments)
    if kind == "recursive #":  # the walk went down the recursion
        assert any('"kids": [{"value"' in t for t in texts), texts


def test_auto_calls_are_held_to_the_schema_with_references():
    tools = parse_tools([tool("lookup", SCHEMAS["pydantic nested"])])
    grammar = llguidance.grammar_from("grammar", auto_grammar(tools, parallel=False))
    for seed in range(5):
        text = generate(grammar, seed, prefix="Sure. <tool_call>")
        content, calls = HermesParser().parse(text)
        assert content == "Sure." and calls[0].name == "lookup", text
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["pydantic nested"])


def test_the_constraint_matches_the_tools_own_schema():
    """Embedded, the schema accepts and refuses what the tool's own schema does."""
    schema = SCHEMAS["recursive #"]
    call = required_schema(parse_tools([tool("t", schema)]), "t", parallel=False)
    for value in ({"value": 1}, {"value": 1, "kids": [{"value": 2, "kids": []}]},
                  {"value": 1, "kids": [{"kids": []}]}, {"value": "x"}):
        ok = jsonschema.Draft202012Validator(schema).is_valid(value)
        assert jsonschema.Draft202012Validator(call).is_valid(
            [{"name": "t", "parameters": value}]) == ok, value
    assert embedded_parameters({"properties": {}}, "t")["type"] == "object"
    # Data is not a reference: a "$ref" inside a const or an enum stays as written.
    const = embedded_parameters({"type": "object", "const": {"$ref": "#"}}, "t")
    assert const["const"] == {"$ref": "#"}


@pytest.mark.parametrize("parameters, words", [
    ({"type": "string"}, 'must describe an object ("type": "object"'),
    ({"type": "array", "items": {"type": "integer"}}, "got \"type\": 'array'"),
    ({"type": ["object", "null"]}, "must describe an object"),
    ({"$ref": "#/$defs/S", "$defs": {"S": {"type": "string"}}}, "must describe an object"),
    ({"$ref": "#"}, "the reference '#' leads only back to itself"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"],
      "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"allOf": [{"$ref": "#/$defs/A"}]}}},
     "leads only back to itself"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}},
     "Pointer '/$defs/nowhere' does not exist"),
    ({"$ref": "#/$defs/a", "$defs": {"a": DEEP}}, "is nested too deeply"),
])
def test_parameters_that_describe_no_object_are_refused_by_name(parameters, words):
    # tool_choice none checks the schema's shape, but compiles nothing.
    for choice in ("required", "auto", *(("none",) if "Pointer" not in words else ())):
        with pytest.raises(ValueError) as e:
            plan_tools({"tools": [tool("ok", ADDRESS), tool("bad", parameters)],
                        "tool_choice": choice}, "hermes")
        assert "tools[1].function.parameters" in str(e.value), str(e.value)
        assert words in str(e.value), str(e.value)


def test_absent_parameters_are_a_function_of_no_arguments():
    tools = parse_tools([{"type": "function", "function": {"name": "now"}}])
    assert tools[0].parameters == {"type": "object", "properties": {}}
    plan_tools({"tools": [tool("now", None)], "tool_choice": "required"}, "hermes")


def test_schemas_too_large_for_a_constrained_call_are_refused_before_compiling():
    """Parameters past what a constrained output carries are refused by their size, naming
    ``tools``; under ``auto`` with a parser that reads free text, nothing is constrained."""
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100}
                                            for i in range(3000)}}
    tools = [tool("big", big)]
    for choice in ("required", {"type": "function", "function": {"name": "big"}}):
        with pytest.raises(ValueError, match=r"^tools: .* at most 262144 \(256 KiB\)"):
            plan_tools({"tools": tools, "tool_choice": choice}, "hermes")
    with pytest.raises(ValueError, match=r"^tools: "):
        plan_tools({"tools": tools}, "hermes")
    assert plan_tools({"tools": tools}, "llama3_json").constraint == {}
