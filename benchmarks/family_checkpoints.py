"""Random-weight checkpoints of each model family's real shape, and their GGUFs (issue 45).

A family's checkpoint is a HF folder made offline by ``transformers`` from the family's real
``config.json`` values (random initialisation, bf16 safetensors) with the tokenizer of kvflow's
default model, and the GGUF that llama.cpp's own ``convert_hf_to_gguf.py`` writes from it
(llama.cpp's checkout under ``reports/peers/llama.cpp/src``, the one benchmarks/peers.py builds),
then quantized to Q4_1 by ``llama-quantize`` as benchmarks/model_sizes.py does. Nothing is
downloaded. Families without a member near 1B parameters (Phi-4-mini, Mistral 7B) keep their
real layer shape with fewer layers; :data:`FAMILIES` says which.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_GEMMA3_LAYERS = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                       for i in range(26))


@dataclass(frozen=True)
class Family:
    """One family's shape: its HF ``config.json`` (without the tokenizer ids) and what it is."""

    name: str
    what: str
    config: dict[str, Any] = field(default_factory=dict)

    def hf_config(self, bos: int, eos: int, vocab: int | None = None) -> dict[str, Any]:
        cfg = {**self.config, "bos_token_id": bos, "eos_token_id": eos,
               "pad_token_id": None, "torch_dtype": "bfloat16"}
        if vocab:
            cfg["vocab_size"] = vocab
        return cfg

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def kv_heads(self) -> int:
        return int(self.config["num_key_value_heads"])

    @property
    def head_dim(self) -> int:
        c = self.config
        return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])


FAMILIES = {
    "llama3": Family("llama3", "Llama-3.2-1B shape, llama3 rope scaling", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "hidden_act": "silu"}),
    "qwen3": Family("qwen3", "Qwen3-1.7B shape", {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "hidden_act": "silu", "attention_bias": False}),
    "gemma3": Family("gemma3", "Gemma-3-1B shape: 5 local (512-token window) : 1 global", {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "vocab_size": 262144, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 512,
        "layer_types": list(_GEMMA3_LAYERS), "query_pre_attn_scalar": 256,
        "max_position_embeddings": 32768, "hidden_activation": "gelu_pytorch_tanh"}),
    "gemma2": Family("gemma2", "Gemma-2-2B shape: alternating 4096-token window, soft-caps", {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 2304,
        "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 256000,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "sliding_window": 4096, "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "max_position_embeddings": 8192, "hidden_activation": "gelu_pytorch_tanh"}),
    "phi4mini": Family("phi4mini", "Phi-4-mini layer shape (longrope, partial rotary 0.75), "
                       "8 of its 32 layers", {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 8, "num_attention_heads": 24,
        "num_key_value_heads": 8, "vocab_size": 200064, "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "rope_scaling": {"type": "longrope",
                         "short_factor": [1.0 + 0.05 * i for i in range(48)],
                         "long_factor": [1.0 + 0.5 * i for i in range(48)]},
        "original_max_position_embeddings": 4096, "max_position_embeddings": 131072,
        "hidden_act": "silu", "sliding_window": 262144}),
    "mistral": Family("mistral", "Mistral-7B layer shape, 4096-token window, 4 of its 32 "
                      "layers, a 131k vocabulary (Mistral NeMo's: kvflow's test tokenizer has "
                      "49k tokens, more than Mistral-7B's 32k)", {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 4, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "sliding_window": 4096, "max_position_embeddings": 32768, "hidden_act": "silu"}),
}
# Every stage in a minute: the same families at 2 layers, hidden 256, SmolLM2's vocabulary.
SMOKE = {k: Family(k, f"{f.what} (smoke: 2 layers, hidden 256)", {
    **f.config, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 49152,
    **({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}
       if k == "gemma3" else {}),
    **({"rope_scaling": {**f.config["rope_scaling"],
                         "short_factor": [1.0] * 24, "long_factor": [2.0] * 24}}
       if k == "phi4mini" else {})}) for k, f in FAMILIES.items()}


def write_hf(family: Family, tokenizer_dir: Path, out: Path) -> None:
    """The family's HF folder at ``out``: config, kvflow's default tokenizer, random bf16
    weights (transformers' own initialisation, seeded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    raw = family.hf_config(tok.bos_token_id, tok.eos_token_id)
    cfg = AutoConfig.for_model(raw.pop("model_type"), **{k: v for k, v in raw.items()
                                                          if k != "architectures"})
    cfg.architectures = family.config["architectures"]
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), max_shard_size="2GB")
    tok.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}))
    del model


_CONVERT = """
import sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py"]
sys.argv = ["convert_hf_to_gguf.py", *{argv!r}]
import convert_hf_to_gguf as c
from conversion import gemma, phi
from conversion.base import TextModel
# kvflow's default tokenizer is a GPT-2 BPE (no tokenizer.model): read it as such everywhere.
TextModel._set_vocab_sentencepiece = TextModel._set_vocab_gpt2
for cls in (gemma.GemmaModel, gemma.Gemma2Model, phi.Phi3MiniModel):
    cls.set_vocab = TextModel._set_vocab_gpt2
# Gemma 3's converter cuts the embedding to the tokenizer's tokens (a real Gemma 3 tokenizer
# has all 262,144); the vocabulary here is padded to the shape's, so keep every row.
_gemma3_tensors = gemma.Gemma3Model.modify_tensors


def _keep_embedding(self, data_torch, name, bid):
    if "embed_tokens.weight" in name:
        return super(gemma.Gemma3Model, self).modify_tensors(data_torch, name, bid)
    return _gemma3_tensors(self, data_torch, name, bid)


gemma.Gemma3Model.modify_tensors = _keep_embedding
c.main()
"""


def convert(src: Path, hf: Path, out: Path, log: Path) -> None:
    """llama.cpp's converter, HF folder -> F16 GGUF."""
    code = _CONVERT.format(src=str(src.resolve()),
                           argv=[str(hf), "--outfile", str(out), "--outtype", "f16"])
    with log.open("w") as f:
        r = subprocess.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT,
                           env={**os.environ, "NO_LOCAL_GGUF": ""}, check=False)
    if r.returncode:
        raise RuntimeError(f"convert_hf_to_gguf failed ({r.returncode}): "
                           f"{log.read_text()[-1500:]}")
