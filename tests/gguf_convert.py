"""A HF folder written as a GGUF the way llama.cpp's converter (convert_hf_to_gguf.py and its
conversion/*.py) writes it, for the families kvflow reads: the tests' stand-in for running the
converter, which is not installed. It follows the converter's choices per family:

- tensor names from gguf-py's own map (``gguf.get_tensor_name_map``), as ``map_tensor_name``;
- llama: Q/K rows permuted (``LlamaModel.permute``), ``vocab_size`` and
  ``rope.dimension_count`` written, Llama 3 rope scaling as a ``rope_freqs`` tensor;
- gemma2 / gemma3: ``norm.weight`` + 1; gemma2 drops ``lm_head``; gemma2 writes its own keys
  (softcaps, sliding window), gemma3 the generic ones plus the final softcap and the window;
- phi3: fused ``qkv_proj`` / ``gate_up_proj`` kept (``attn_qkv`` / ``ffn_up``), its own keys
  (rotated dims, original context, window 0 when none), longrope factors as F32 tensors;
- 1-D tensors F32; 2-D ones F32 (``--outtype f32``) or Q8_0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
         "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
         "Phi3ForCausalLM": "phi3"}


def _rope(hp: dict[str, Any]) -> dict[str, Any]:
    """The converter's ``rope_parameters`` (ModelBase.__init__): v5's dict, v4's keys filled in."""
    params = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    if "full_attention" not in params and "sliding_attention" not in params:
        if hp.get("rope_local_base_freq") is not None:
            params["sliding_attention"] = {"rope_theta": hp["rope_local_base_freq"]}
        params.setdefault("rope_theta", hp.get("rope_theta"))
        for key in ("partial_rotary_factor", "original_max_position_embeddings"):
            if key not in params and hp.get(key) is not None:
                params[key] = hp[key]
    return params


def _generic_keys(w: Any, hp: dict[str, Any], rope: dict[str, Any]) -> None:
    """TextModel.set_gguf_parameters."""
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    full = rope.get("full_attention", rope)
    kind = full.get("rope_type")
    if kind == "linear":
        w.add_rope_scaling_type(_gguf().RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif kind == "longrope":
        w.add_rope_scaling_type(_gguf().RopeScalingType.LONGROPE)
    if full.get("rope_theta") is not None:
        w.add_rope_freq_base(full["rope_theta"])
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])


def _gguf() -> Any:
    import gguf

    return gguf


def _family_keys(arch: str, w: Any, hp: dict[str, Any], rope: dict[str, Any]) -> None:
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters (no generic keys)
        w.add_context_length(hp["max_position_embeddings"])
        w.add_embedding_length(hp["hidden_size"])
        w.add_block_count(hp["num_hidden_layers"])
        w.add_feed_forward_length(hp["intermediate_size"])
        w.add_head_count(hp["num_attention_heads"])
        w.add_head_count_kv(hp["num_key_value_heads"])
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
        w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        w.add_sliding_window(hp["sliding_window"])
    elif arch == "phi3":  # Phi3MiniModel.set_gguf_parameters (no generic keys)
        n_embd, n_head = hp["hidden_size"], hp["num_attention_heads"]
        w.add_context_length(hp["max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(hp["intermediate_size"])
        w.add_block_count(hp["num_hidden_layers"])
        w.add_head_count(n_head)
        w.add_head_count_kv(hp["num_key_value_heads"])
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(hp.get("sliding_window") or 0)
    else:
        _generic_keys(w, hp, rope)
        if arch == "llama":  # LlamaModel.set_gguf_parameters
            w.add_vocab_size(hp["vocab_size"])
            w.add_rope_dimension_count(hp.get("head_dim")
                                       or hp["hidden_size"] // hp["num_attention_heads"])
        if arch == "gemma3":  # Gemma3Model.set_gguf_parameters, after the generic keys
            if hp.get("final_logit_softcapping"):
                w.add_final_logit_softcapping(hp["final_logit_softcapping"])
            if hp.get("sliding_window_pattern") != 1:
                w.add_sliding_window(hp["sliding_window"])


def _extra_tensors(arch: str, w: Any, hp: dict[str, Any], rope: dict[str, Any]) -> None:
    """generate_extra_tensors: Llama 3's rope_freqs, Phi-3's longrope factors."""
    full = rope.get("full_attention", rope)
    if arch == "llama" and full.get("rope_type") == "llama3":
        from kvflow.model.gguf_config import llama3_rope_factors

        dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(
            full.get("rope_theta", 10000.0), dim, full.get("factor", 8.0),
            full.get("low_freq_factor", 1.0), full.get("high_freq_factor", 4.0),
            full.get("original_max_position_embeddings", 8192)))
    if arch == "phi3" and rope.get("long_factor"):
        original = rope["original_max_position_embeddings"]
        scale = hp["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))


def _tokenizer_keys(w: Any, folder: Path, hp: dict[str, Any]) -> None:
    """A byte-level BPE vocabulary (tokenizer.json's), padded to vocab_size as the converter
    pads, with the special ids."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [f"[PAD{i}]" for i in range(hp["vocab_size"])]
    types = [1] * hp["vocab_size"]
    for text, i in vocab.items():
        tokens[i] = text
    for t in tok["added_tokens"]:
        types[t["id"]] = 3  # CONTROL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores([0.0] * hp["vocab_size"])  # no merges: transformers derives none
    w.add_token_merges([])
    w.add_bos_token_id(hp["bos_token_id"])
    w.add_eos_token_id(hp["eos_token_id"])


def convert(folder: Path, out: Path, outtype: str = "F32") -> Path:
    """Write HF folder ``folder`` as GGUF ``out`` (2-D weights in ``outtype``: F32 or Q8_0)."""
    import torch
    from gguf import GGMLQuantizationType, GGUFWriter, get_tensor_name_map
    from gguf.constants import MODEL_ARCH_NAMES
    from gguf.quants import quantize
    from safetensors.torch import load_file

    hp = json.loads((folder / "config.json").read_text())
    arch = ARCHS[hp["architectures"][0]]
    rope = _rope(hp)
    w = GGUFWriter(str(out), arch)
    _family_keys(arch, w, hp, rope)
    _tokenizer_keys(w, folder, hp)
    _extra_tensors(arch, w, hp, rope)
    model_arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    names = get_tensor_name_map(model_arch, hp["num_hidden_layers"])
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    for name, value in state.items():
        data = value.to(torch.float32)
        if arch == "gemma2" and name == "lm_head.weight":
            continue
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            data = data + 1
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hp["num_attention_heads"]
            if name.endswith("k_proj.weight"):
                heads = hp["num_key_value_heads"]
            data = (data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:])
                    .swapaxes(1, 2).reshape(data.shape))
        new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise ValueError(f"the converter cannot map {name} for {arch}")
        array = data.numpy()
        if array.ndim == 2 and outtype == "Q8_0":
            q = quantize(array, GGMLQuantizationType.Q8_0)
            w.add_tensor(new_name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(new_name, np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
