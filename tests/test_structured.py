"""Structured outputs: request validation, compiling with llguidance, and constrained decoding
driven by hand with the default model's real tokenizer and random (seeded) logits."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer

from kvflow.build.engine_config import EngineConfig
from kvflow.orchestrator.sampling.structured import (
    MAX_ERROR_CHARS,
    MAX_SPEC_BYTES,
    Grammar,
    GrammarCompiler,
    StructuredOutput,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
)

REPO_ENGINE = Path(__file__).resolve().parents[1] / "engines" / "smollm2-135m"

PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "owner": {"type": "object",
                  "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                 "verified": {"type": "boolean"}},
                  "required": ["age", "verified"], "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine_dir(request) -> Path:
    """The default model's engine: the repo's own if built, else the session's."""
    if (REPO_ENGINE / "engine_config.json").is_file():
        return REPO_ENGINE
    return request.getfixturevalue("default_engines")["onnxruntime"]


@pytest.fixture(scope="module")
def tokenizer(engine_dir) -> Tokenizer:
    return Tokenizer.from_file(str(engine_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def compiler(engine_dir) -> GrammarCompiler:
    model = EngineConfig.load(engine_dir).model
    return GrammarCompiler((engine_dir / "tokenizer.json").read_text(), model.vocab_size,
                           model.eos_token_ids)


def make_compiler(engine_dir: Path, cache_size: int) -> GrammarCompiler:
    model = EngineConfig.load(engine_dir).model
    return GrammarCompiler((engine_dir / "tokenizer.json").read_text(), model.vocab_size,
                           model.eos_token_ids, cache_size=cache_size)


def generate(compiler: GrammarCompiler, tokenizer: Tokenizer, grammar: Grammar, seed: int,
             max_steps: int = 300) -> str:
    """Greedy decoding of random logits under ``grammar``: the text, without EOS."""
    rng = np.random.default_rng(seed)
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    tokens: list[int] = []
    for _ in range(max_steps):
        if grammar.is_stopped:
            break
        fill_bitmasks([grammar], bitmask)
        logits = rng.standard_normal((1, compiler.vocab_size)).astype(np.float32)
        apply_bitmask(logits, bitmask)
        token = int(np.argmax(logits))
        assert grammar.accept(token), grammar.error
        if token in compiler.eos_token_ids:
            assert grammar.is_stopped
            break
        tokens.append(token)
    else:
        pytest.fail(f"no end after {max_steps} steps: {tokenizer.decode(tokens)!r}")
    assert not grammar.is_error and grammar.is_accepting
    return tokenizer.decode(tokens)


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


# --- StructuredOutput -----------------------------------------------------------------------
@pytest.mark.parametrize("fields, message", [
    ({"guided_regex": 3}, "guided_regex must be a string, got 3 (int)"),
    ({"guided_regex": ""}, "guided_regex must be a non-empty string"),
    ({"guided_grammar": ["start: 'a'"]}, "guided_grammar must be a string, got"),
    ({"guided_json": 3}, "guided_json must be a JSON schema"),
    ({"guided_json": "{not json"}, "guided_json must be a JSON schema (an object), but the "
                                   "string is not JSON"),
    ({"guided_json": "[1, 2]"}, "guided_json must be a JSON schema"),
    ({"guided_json": {"default": {1, 2}}}, "guided_json is not serialisable as JSON"),
    ({"guided_choice": []}, "guided_choice must have at least one choice"),
    ({"guided_choice": "yes"}, "guided_choice must be a list of strings, got 'yes' (str)"),
    ({"guided_choice": ["yes", 3]}, "guided_choice[1] must be a non-empty string, got 3 (int)"),
    ({"guided_choice": ["yes", ""]}, "guided_choice[1] must be a non-empty string"),
    ({"guided_json_object": "yes"}, "guided_json_object must be a bool, got 'yes' (str)"),
    ({"guided_regex": "a" * (MAX_SPEC_BYTES + 1)}, f"guided_regex is {MAX_SPEC_BYTES + 1} "
                                                   f"bytes; the limit is {MAX_SPEC_BYTES}"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"},
     "at most one of guided_json, guided_regex, guided_choice, guided_grammar, "
     "guided_json_object may be set; got guided_json, guided_regex"),
    ({"guided_choice": ["a"], "guided_json_object": True},
     "at most one of guided_json, guided_regex, guided_choice, guided_grammar, "
     "guided_json_object may be set; got guided_choice, guided_json_object"),
])
def test_bad_guided_fields_are_refused_by_name(fields, message):
    with pytest.raises(ValueError) as e:
        StructuredOutput.from_guided(**fields)
    assert str(e.value).startswith(message), str(e.value)


def test_guided_fields_become_canonical_specs():
    assert StructuredOutput.from_guided() is None
    assert StructuredOutput.from_guided(guided_json_object=False) is None
    assert StructuredOutput.from_guided(guided_json_object=True) == StructuredOutput(
        "json_object", "")
    from_dict = StructuredOutput.from_guided(guided_json={"type": "object", "required": []})
    from_text = StructuredOutput.from_guided(guided_json='{ "type": "object", "required": [] }')
    # Compact, but in the schema's own key order (properties are generated in that order).
    assert from_dict == from_text == StructuredOutput("json", '{"type":"object","required":[]}')
    choice = StructuredOutput.from_guided(guided_choice=("oui", "non"))
    assert choice == StructuredOutput("choice", '["oui", "non"]')
    assert {so.field_name() for so in (from_dict, choice)} == {"guided_json", "guided_choice"}
    for so in (from_dict, choice, StructuredOutput("regex", "[0-9]+")):
        assert StructuredOutput.from_dict(json.loads(json.dumps(so.to_dict()))) == so


def test_direct_construction_is_checked_too():
    with pytest.raises(ValueError, match="kind must be one of json, regex, choice"):
        StructuredOutput("yaml", "a")
    with pytest.raises(ValueError, match="^guided_json_object takes no spec"):
        StructuredOutput("json_object", "{}")
    with pytest.raises(ValueError, match="^structured output must be an object with exactly"):
        StructuredOutput.from_dict({"kind": "regex", "spec": "a", "extra": 1})


# --- compiling ------------------------------------------------------------------------------
@pytest.mark.parametrize("so, field, compiler_text", [
    (StructuredOutput("regex", "("), "guided_regex", "unclosed group"),
    (StructuredOutput.from_guided(guided_json={"type": "nonsense"}), "guided_json",
     "Invalid type: nonsense"),
    (StructuredOutput.from_guided(guided_json={"type": "integer", "minimum": 5, "maximum": 2}),
     "guided_json", "minimum (5) is greater than maximum (2)"),
    (StructuredOutput("grammar", "start: undefined_rule"), "guided_grammar",
     'unknown name: "undefined_rule"'),
    (StructuredOutput("grammar", "root ::= ((("), "guided_grammar", "GBNF"),
])
def test_a_spec_that_does_not_compile_raises_naming_the_field(compiler, so, field,
                                                                compiler_text):
    with pytest.raises(ValueError) as e:
        compiler.compile(so)
    assert str(e.value).startswith(f"{field}: "), str(e.value)
    assert compiler_text in str(e.value)


def test_compiler_errors_are_cut(compiler):
    with pytest.raises(ValueError) as e:
        compiler.compile(StructuredOutput("regex", "(" + "ab|" * 2000))
    assert len(str(e.value)) <= len("guided_regex: ") + MAX_ERROR_CHARS


def test_the_cache_compiles_each_spec_once_and_stays_bounded(engine_dir):
    compiler = make_compiler(engine_dir, cache_size=2)
    compiler.compile(StructuredOutput.from_guided(guided_json=PET_SCHEMA))
    # Another spelling of the same schema is the same entry.
    compiler.compile(StructuredOutput.from_guided(guided_json=json.dumps(PET_SCHEMA, indent=1)))
    assert (compiler.cache_misses, compiler.cache_hits) == (1, 1)
    for pattern in ("a+", "b+", "a+", "c+"):  # a+ is used again, so b+ is the oldest
        compiler.compile(StructuredOutput("regex", pattern))
        assert compiler.cache_len <= 2
    compiler.compile(StructuredOutput("regex", "a+"))
    assert (compiler.cache_misses, compiler.cache_hits) == (4, 3)
    compiler.compile(StructuredOutput("regex", "b+"))
    assert compiler.cache_misses == 5
    for _ in range(2):  # failures are not cached
        with pytest.raises(ValueError):
            compiler.compile(StructuredOutput("regex", "("))
    assert compiler.cache_misses == 7 and compiler.cache_len == 2


def test_compiles_from_many_threads_at_once(engine_dir, tokenizer):
    compiler = make_compiler(engine_dir, cache_size=4)
    so = StructuredOutput("regex", "[0-9]{4}")
    grammars: list[Grammar] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(5):
                grammars.append(compiler.compile(so))
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(grammars) == 20
    assert compiler.cache_hits + compiler.cache_misses == 20 and compiler.cache_len == 1
    assert all(g.accept(ids(tokenizer, "1")[0]) for g in grammars)


# --- constrained decoding -------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_regex_output_matches(compiler, tokenizer, seed):
    grammar = compiler.compile(StructuredOutput("regex", "[a-z]{3}-[0-9]{2}"))
    text = generate(compiler, tokenizer, grammar, seed)
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", text), text


@pytest.mark.parametrize("seed", range(3))
def test_choice_output_is_one_of_the_choices(compiler, tokenizer, seed):
    choices = ["positive", "negative", "neutral", "Ünïcode \"quoted\""]
    grammar = compiler.compile(StructuredOutput.from_guided(guided_choice=choices))
    assert generate(compiler, tokenizer, grammar, seed) in choices


@pytest.mark.parametrize("seed", range(3))
def test_json_output_validates_against_its_schema(compiler, tokenizer, seed):
    grammar = compiler.compile(StructuredOutput.from_guided(guided_json=PET_SCHEMA))
    text = generate(compiler, tokenizer, grammar, seed)
    jsonschema.validate(json.loads(text), PET_SCHEMA)


@pytest.mark.parametrize("seed", range(3))
def test_json_is_compact_with_json_dumps_separators(compiler, tokenizer, seed):
    schema = {"type": "object", "additionalProperties": False, "required": ["n", "k", "l"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                             "k": {"enum": ["x", "y"]},
                             "l": {"type": "array", "items": {"type": "boolean"},
                                   "minItems": 2, "maxItems": 2}}}
    # A schema's own x-guidance cannot turn flexible whitespace back on.
    schema_asking_for_whitespace = {**schema, "x-guidance": {"whitespace_flexible": True}}
    grammar = compiler.compile(StructuredOutput.from_guided(
        guided_json=schema_asking_for_whitespace))
    text = generate(compiler, tokenizer, grammar, seed)
    assert text == json.dumps(json.loads(text)), text


def test_any_json_object(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutput.from_guided(guided_json_object=True))
    assert grammar.accept(ids(tokenizer, "{")[0]) and not grammar.is_accepting
    for token in ids(tokenizer, '"a": [1, {"b": null}]}'):
        assert grammar.accept(token), grammar.error
    assert grammar.is_accepting and grammar.is_stopped


def test_eos_is_allowed_exactly_when_the_grammar_accepts(compiler, tokenizer):
    eos = compiler.eos_token_ids[0]
    bitmask = allocate_bitmask(1, compiler.vocab_size)

    def eos_allowed(g: Grammar) -> bool:
        g.fill_bitmask(bitmask, 0)
        return bool((bitmask[0, eos // 32] >> (eos % 32)) & 1)

    grammar = compiler.compile(StructuredOutput("regex", "[a-z]+"))
    assert not grammar.is_accepting and not eos_allowed(grammar)
    assert not grammar.accept(eos) and grammar.is_error and grammar.is_stopped
    assert grammar.error is not None

    grammar = compiler.compile(StructuredOutput("regex", "[a-z]+"))
    assert grammar.accept(ids(tokenizer, "hello")[0])
    # Accepting, but more letters could follow: EOS is one of the choices, not the only one.
    assert grammar.is_accepting and not grammar.is_stopped and eos_allowed(grammar)
    assert grammar.accept(eos) and grammar.is_stopped and not grammar.is_error


def test_a_rejected_token_puts_the_grammar_in_error(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutput("regex", "[a-z]+"))
    assert grammar.error is None
    assert not grammar.accept(ids(tokenizer, "7")[0])
    assert grammar.is_error and grammar.is_stopped and "doesn't satisfy the grammar" in (
        grammar.error or "")
    # A failed grammar allows EOS only, so that the sampler never sees an all -inf row.
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))
    assert allowed.tolist() == list(compiler.eos_token_ids)


def test_a_forked_grammar_advances_independently(compiler, tokenizer):
    parent = compiler.compile(StructuredOutput("regex", "[a-z]{3}-[0-9]{2}"))
    assert parent.accept(ids(tokenizer, "a")[0])
    child = parent.fork()
    for token in ids(tokenizer, "bc-12"):
        assert child.accept(token), child.error
    assert child.is_stopped and not child.is_error
    assert not parent.is_stopped and not parent.is_accepting
    for token in ids(tokenizer, "xy-99"):
        assert parent.accept(token), parent.error
    assert parent.is_stopped
    sibling = compiler.compile(StructuredOutput("regex", "[a-z]{3}-[0-9]{2}")).fork()
    assert not sibling.accept(ids(tokenizer, "-")[0])
    assert not parent.is_error and not child.is_error


def test_a_batch_masks_only_its_constrained_rows(compiler, tokenizer):
    specs = [StructuredOutput("regex", "[0-9]{3}"), StructuredOutput("regex", "[a-z]{2}"),
             StructuredOutput.from_guided(guided_choice=["alpha", "beta"])]
    grammars = [compiler.compile(so) for so in specs]
    rows = [4, 0, 2]  # rows of the batch that are constrained, in grammar order
    rng = np.random.default_rng(7)
    texts: list[list[int]] = [[] for _ in grammars]
    for _ in range(20):
        live = [i for i, g in enumerate(grammars) if not g.is_stopped]
        if not live:
            break
        bitmask = allocate_bitmask(len(live), compiler.vocab_size)
        fill_bitmasks([grammars[i] for i in live], bitmask)
        logits = rng.standard_normal((6, compiler.vocab_size)).astype(np.float32)
        before = logits.copy()
        apply_bitmask(logits, bitmask, rows=[rows[i] for i in live])
        free = [r for r in range(6) if r not in {rows[i] for i in live}]
        assert np.array_equal(logits[free], before[free])
        for i in live:
            token = int(np.argmax(logits[rows[i]]))
            assert grammars[i].accept(token), grammars[i].error
            if token not in compiler.eos_token_ids:
                texts[i].append(token)
    else:
        pytest.fail("the batch did not finish in 20 steps")
    out = [tokenizer.decode(t) for t in texts]
    assert re.fullmatch("[0-9]{3}", out[0]) and re.fullmatch("[a-z]{2}", out[1]), out
    assert out[2] in ("alpha", "beta")


# --- apply_bitmask --------------------------------------------------------------------------
def naive_apply(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    out = logits.copy()
    for r in range(out.shape[0]):
        for t in range(out.shape[1]):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[r, word]) >> (t % 32)) & 1
            if not allowed:
                out[r, t] = -np.inf
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("vocab, mask_vocab", [(1000, 1000), (1024, 1024), (999, 1010),
                                               (1010, 990)])
def test_apply_bitmask_equals_a_per_token_reference(vocab, mask_vocab, dtype):
    rng = np.random.default_rng(vocab + mask_vocab)
    bitmask = allocate_bitmask(5, mask_vocab)
    bitmask[:] = rng.integers(-(2**31), 2**31, size=bitmask.shape, dtype=np.int64)
    bitmask[1] = 0  # nothing allowed
    bitmask[2, 3] = 1 << 31 | 1  # the sign bit is a token too
    logits = rng.standard_normal((5, vocab)).astype(dtype)
    logits[0, :4] = [np.inf, -np.inf, np.nan, -0.0]  # kept exactly where allowed
    expected = naive_apply(logits, bitmask)
    apply_bitmask(logits, bitmask)
    np.testing.assert_array_equal(logits, expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_apply_bitmask_to_some_rows_of_a_batch(dtype):
    rng = np.random.default_rng(3)
    bitmask = allocate_bitmask(3, 1000)
    bitmask[:] = rng.integers(-(2**31), 2**31, size=bitmask.shape, dtype=np.int64)
    batch = rng.standard_normal((7, 1000)).astype(dtype)
    rows = [5, 0, 3]
    expected = batch.copy()
    expected[rows] = naive_apply(batch[rows], bitmask)
    apply_bitmask(batch, bitmask, rows=rows)
    np.testing.assert_array_equal(batch, expected)


def test_bitmask_shapes_are_checked(compiler):
    with pytest.raises(ValueError, match="logits has 2 rows; the bitmask has 3"):
        apply_bitmask(np.zeros((2, 64), np.float32), allocate_bitmask(3, 64))
    with pytest.raises(ValueError, match="rows has 1 entries; the bitmask has 3 rows"):
        apply_bitmask(np.zeros((4, 64), np.float32), allocate_bitmask(3, 64), rows=[0])
    with pytest.raises(ValueError, match="rows must index the 4 rows of logits"):
        apply_bitmask(np.zeros((4, 64), np.float32), allocate_bitmask(1, 64), rows=[4])
    grammars = [compiler.compile(StructuredOutput("regex", "a+")) for _ in range(2)]
    words = (compiler.vocab_size + 31) // 32
    with pytest.raises(ValueError, match=f"at least 2 rows of {words} words"):
        fill_bitmasks(grammars, allocate_bitmask(1, compiler.vocab_size))
    with pytest.raises(ValueError, match=f"at least 1 rows of {words} words"):
        grammars[0].fill_bitmask(allocate_bitmask(1, 64), 0)
