"""Structured outputs on the default model: sampled outputs follow the schema, the regex, the
choice; bad specs are refused before they take KV; unconstrained neighbours are untouched; and
the same through tritonserver."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvflow import SamplingParams
from kvflow.orchestrator.sampling.structured_output import StructuredOutput

pytestmark = pytest.mark.slow  # the default model, and tritonserver

# Nested objects, an enum, an array, required fields; short, so that 50 outputs stay cheap.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


@pytest.fixture
def llm(default_llm):
    """The session's default-model LLM (fp32 matmuls: batch-invariant)."""
    return default_llm


def guided(**kwargs) -> StructuredOutput:
    so = StructuredOutput.from_guided(**kwargs)
    assert so is not None
    return so


def test_thirty_two_sampled_outputs_parse_and_follow_the_schema(llm):
    params = [SamplingParams(max_tokens=100, temperature=1.0, seed=i,
                             structured=guided(guided_json=PERSON)) for i in range(32)]
    outs = llm.generate(["Describe a user of a web site as JSON."] * 32, params)
    texts = [o.text for o in outs]
    assert len(set(texts)) > 10, "temperature 1.0 sampled the same few outputs"
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
    assert llm.engine.kv.pool.num_used_blocks == 0


def test_regex_and_choice_outputs_match(llm):
    regex = r"[A-Z][a-z]{2,6}-[0-9]{3}"
    choices = ["red", "green", "blue", "dark purple"]
    outs = llm.generate(["A product code:"] * 4 + ["My favourite colour is"] * 4,
                        [SamplingParams(max_tokens=20, temperature=1.0, seed=i,
                                        structured=guided(guided_regex=regex))
                         for i in range(4)]
                        + [SamplingParams(max_tokens=20, temperature=1.0, seed=i,
                                          structured=guided(guided_choice=choices))
                           for i in range(4)])
    for o in outs[:4]:
        assert re.fullmatch(regex, o.text) and o.finish_reason == "stop", o.text
    for o in outs[4:]:
        assert o.text in choices and o.finish_reason == "stop", o.text


def test_a_grammar_and_json_object(llm):
    grammar = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]/'
    outs = llm.generate(["Answer:", "A JSON object:"],
                        [SamplingParams(max_tokens=10, temperature=1.0, seed=3,
                                        structured=guided(guided_grammar=grammar)),
                         SamplingParams(max_tokens=60, temperature=0.0,
                                        structured=guided(guided_json_object=True))])
    assert re.fullmatch(r"yes|no|maybe [0-9]", outs[0].text), outs[0].text
    assert outs[1].finish_reason == "stop" and isinstance(json.loads(outs[1].text), dict)


def test_a_grammar_cut_by_max_tokens_ends_with_length(llm):
    out = llm.generate(["Count:"], SamplingParams(max_tokens=4, temperature=0.0,
                                                  structured=guided(guided_regex="[0-9]{50}")))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert re.fullmatch("[0-9]*", out.text)


@pytest.mark.parametrize(("kwargs", "field", "fragment"), [
    ({"guided_regex": "(unclosed"}, "guided_regex", ""),
    ({"guided_json": {"type": "nonsense"}}, "guided_json", ""),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", ""),
])
def test_a_bad_spec_is_refused_at_once_and_takes_no_kv(llm, kwargs, field, fragment):
    engine = llm.engine
    engine.add_request("Hello", SamplingParams(max_tokens=8, temperature=0.0),
                       request_id="neighbour")
    with pytest.raises(ValueError, match=f"^{field}: ") as info:
        engine.add_request("Hi", SamplingParams(structured=guided(**kwargs)), request_id="bad")
    assert fragment in str(info.value)
    assert "bad" not in engine.scheduler.requests and engine.kv.pool.num_used_blocks == 0
    while engine.has_unfinished_requests():  # the neighbour runs on, untouched
        outs = engine.step()
    assert outs[-1].request_id == "neighbour" and outs[-1].finish_reason == "length"


def test_unconstrained_neighbours_equal_themselves_alone(llm):
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = llm.generate(prompts, greedy)
    constrained = SamplingParams(max_tokens=40, temperature=1.0, seed=5,
                                 structured=guided(guided_json=PERSON))
    mixed = llm.generate(["A user as JSON:", *prompts, "Another user:"],
                         [constrained, greedy, greedy, greedy, constrained])
    assert [o.token_ids for o in mixed[1:4]] == [o.token_ids for o in alone]


def test_each_of_n_sequences_follows_the_grammar(llm):
    out = llm.generate(["Pick one:"], SamplingParams(
        n=3, max_tokens=8, temperature=1.0, seed=11,
        structured=guided(guided_choice=["alpha", "beta", "gamma", "delta"])))[0]
    assert [c.text in ("alpha", "beta", "gamma", "delta") for c in out.outputs] == [True] * 3


# --- through tritonserver --------------------------------------------------------------------

def test_served_schema_and_n3_requests(triton_server):
    from tests.helpers import http_post

    schema = PERSON
    status, body = http_post(triton_server, "/v2/models/kvflow/generate", {
        "text_input": "A user as JSON:", "exclude_input_in_output": True,
        "sampling_parameters": json.dumps({"max_tokens": 160, "temperature": 1.0, "seed": 2,
                                           "guided_json": schema})})
    assert status == 200, body
    out = json.loads(body)
    jsonschema.validate(json.loads(out["text_output"]), schema)
    assert out["finish_reason"] == "stop"

    status, body = http_post(triton_server, "/v2/models/kvflow/generate", {
        "text_input": "Tell me a joke.", "exclude_input_in_output": True,
        "sampling_parameters": json.dumps({"n": 3, "max_tokens": 6, "temperature": 1.0,
                                           "seed": 9, "ignore_eos": True})})
    assert status == 200, body
    out = json.loads(body)
    # As Triton's vLLM backend: one entry per sequence, in index order.
    assert len(out["text_output"]) == 3 and out["num_output_tokens"] == [6, 6, 6]
    assert out["finish_reason"] == ["length"] * 3
    assert len(set(out["text_output"])) > 1

    status, body = http_post(triton_server, "/v2/models/kvflow/generate", {
        "text_input": "x", "sampling_parameters": json.dumps({"guided_regex": "("})})
    assert status == 400 and "guided_regex" in body, body
