"""Run llama.cpp's own convert_hf_to_gguf.py (a source checkout) on a tiny HF folder, with one
change: the vocabulary is written from tokenizer.json as tests/gguf_convert.py writes it (the
tiny byte-level tokenizer is not one the converter recognises). Everything else (metadata,
tensor names and values) is the converter's.

Usage: python tests/llama_cpp_convert.py LLAMA_CPP_SRC HF_FOLDER OUT.gguf
It runs in its own process: it puts the checkout's gguf-py first on the import path.
"""

from __future__ import annotations

import json
import runpy
import sys
from typing import Any


def _set_vocab(self: Any) -> None:
    tok = json.loads((self.dir_model / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    n = self.hparams["vocab_size"]
    tokens, types = [f"[PAD{i}]" for i in range(n)], [1] * n
    for text, i in vocab.items():
        tokens[i] = text
    for t in tok["added_tokens"]:
        types[t["id"]] = 3
    w = self.gguf_writer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores([0.0] * n)
    w.add_token_merges([])
    w.add_bos_token_id(self.hparams["bos_token_id"])
    w.add_eos_token_id(self.hparams["eos_token_id"])


def main(src: str, folder: str, out: str) -> None:
    sys.path.insert(0, src)
    sys.path.insert(1, f"{src}/gguf-py")
    import conversion  # the checkout's (model classes are imported when first asked for)

    get = conversion.get_model_class

    def get_model_class(*args: Any, **kwargs: Any) -> Any:
        cls = get(*args, **kwargs)
        for c in cls.__mro__:
            if "set_vocab" in c.__dict__:
                c.set_vocab = _set_vocab
        return cls

    conversion.get_model_class = get_model_class
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", "f32", "--outfile", out]
    runpy.run_path(f"{src}/convert_hf_to_gguf.py", run_name="__main__")


if __name__ == "__main__":
    main(*sys.argv[1:4])
