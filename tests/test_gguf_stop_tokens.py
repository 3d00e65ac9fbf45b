"""A GGUF keeps one eos id; the families whose chat turn ends on another control token get
it by its text, as llama.cpp marks end-of-generation tokens (model/gguf_config._eos_ids)."""

from __future__ import annotations

import pytest

gguf = pytest.importorskip("gguf")

from kvflow.model.gguf_config import _eos_ids  # noqa: E402

TOKENS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "hello", "<|im_end|>",
          "<|eot_id|>"]
CONTROL, NORMAL = 3, 1


def _reader(tmp_path, types, tokens=TOKENS):
    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


@pytest.mark.parametrize("arch,expected", [
    ("gemma3", [1, 4, 6, 7]),  # <eos> first, then the control tokens that end a turn
    ("phi3", [1, 4, 6, 7]),
    ("qwen2", 1),              # names <|im_end|> as its eos: unchanged
    ("llama", [1, 4, 6, 7]),   # Llama 3 (it has <|eot_id|>)
])
def test_turn_ends_join_the_eos_by_family(tmp_path, arch, expected):
    types = [CONTROL] * len(TOKENS)
    types[TOKENS.index("hello")] = NORMAL
    assert _eos_ids(_reader(tmp_path, types), arch, 1) == expected


def test_a_plain_token_reading_like_a_turn_end_ends_nothing(tmp_path):
    types = [NORMAL] * len(TOKENS)
    types[TOKENS.index("<eos>")] = CONTROL
    assert _eos_ids(_reader(tmp_path, types), "gemma3", 1) == [1]


def test_a_llama_gguf_without_llama3_tokens_keeps_its_one_eos(tmp_path):
    tokens = [t for t in TOKENS if t != "<|eot_id|>"]  # SmolLM2 / Llama 2
    assert _eos_ids(_reader(tmp_path, [CONTROL] * len(tokens), tokens), "llama", 1) == 1
