"""The default model (SmolLM2-135M-Instruct, GGUF): greedy tokens equal HF transformers'."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tokenizers import Tokenizer  # noqa: E402

from kvflow.runtime import create_runner  # noqa: E402
from tests.helpers import assert_same_or_near_tie, greedy_generate  # noqa: E402

pytestmark = pytest.mark.slow  # the default model, against HF transformers

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CHAT = [{"role": "user", "content": "Give me one tip for writing clear code."}]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompts_ids(default_engines) -> list[list[int]]:
    from transformers import AutoTokenizer

    folder = default_engines["torch"]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = [tok.encode(p).ids for p in PROMPTS]
    text = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system")
    ids.append(tok.encode(text, add_special_tokens=False).ids)
    return ids


@pytest.fixture(scope="module")
def hf_greedy(default_hf, prompts_ids):
    out = []
    for ids in prompts_ids:
        with torch.no_grad():
            gen = default_hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                      do_sample=False, output_logits=True,
                                      return_dict_in_generate=True, eos_token_id=None,
                                      pad_token_id=0, min_new_tokens=NEW_TOKENS)
        tokens = gen.sequences[0, len(ids):].tolist()
        logits = [step[0].float().numpy() for step in gen.logits]
        out.append((tokens, logits))
    return out


@pytest.mark.parametrize("runner_name", ["onnxruntime", "torch"])
def test_greedy_tokens_equal_hf_transformers(default_engines, prompts_ids, hf_greedy,
                                             runner_name):
    # The onnxruntime engine keeps the GGUF's 4-bit weights; in fp32 mode it multiplies by
    # their exact dequantization, which is what HF loads.
    runner = create_runner(runner_name, default_engines[runner_name], 64,
                           quantized_matmul="fp32")
    try:
        for ids, (ref_tokens, ref_logits) in zip(prompts_ids, hf_greedy, strict=True):
            ours, _ = greedy_generate(runner, ids, NEW_TOKENS, chunk=None)
            assert len(ref_tokens) == NEW_TOKENS
            assert_same_or_near_tie(ours, ref_tokens, ref_logits)
    finally:
        runner.close()


def test_engine_folder_has_everything_a_server_needs(default_engines):
    import json

    for backend, folder in default_engines.items():
        config = json.loads((folder / "engine_config.json").read_text())
        assert config["model"]["num_hidden_layers"] == 30
        assert config["model"]["eos_token_ids"] == [2]
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
        template = tok_cfg.get("chat_template") or (folder / "chat_template.jinja").read_text()
        assert "<|im_start|>" in template
        assert (folder / "tokenizer.json").is_file()
        artifact = "model.onnx" if backend == "onnxruntime" else "weights.safetensors"
        assert (folder / artifact).is_file()
