"""A GGUF as llama.cpp's converter (convert_hf_to_gguf.py) writes it: its metadata read into a
:class:`ModelConfig`, and its tensor names mapped to kvflow's weight names.

The converter's per-family choices this undoes (llama.cpp, conversion/*.py and src/models/*):

- llama / mistral: Q and K rows permuted for interleaved RoPE (undone by the reader); Llama 3's
  RoPE scaling written as a ``rope_freqs`` tensor of per-frequency divisors, read back into
  ``rope_scaling`` when it is the ``llama3`` rule.
- qwen2 / qwen3 / gemma2 / gemma3 / phi3: NEOX RoPE, rows as in HF (no permutation).
- gemma2 / gemma3: every ``*norm.weight`` written ``1 + w`` (kvflow's form already);
  ``ffn_norm`` is the MLP's input norm (``pre_feedforward_layernorm``), ``post_attention_norm``
  and ``post_ffw_norm`` the sandwich norms. The attention scale is not written: llama.cpp uses
  ``head_dim`` except for the 27B models (``hidden_size / heads``), and so does kvflow. Gemma 2's
  sliding layers alternate (every 2nd is full), Gemma 3's every 6th is full, unless the file
  has ``attention.sliding_window_pattern``.
- phi3: fused ``attn_qkv`` (rows q, k, v) and ``ffn_up`` (gate rows, then up rows);
  ``rope.dimension_count`` is the rotated dims (partial rotary); longrope's factors are the
  ``rope_factors_short`` / ``rope_factors_long`` tensors (fp32 in the file).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.model.config import ModelConfig, UnsupportedModelError
from kvflow.model.weight_names import WeightPart

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                    "phi3": "Phi3ForCausalLM"}
PERMUTED_ARCHITECTURES = ("llama", "mistral")  # the converter permutes their Q/K rows
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
_FIXED_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                "output.weight": "lm_head.weight", "output_norm.weight": "model.norm.weight"}
# Layer counts of the 27B Gemmas, whose attention scale llama.cpp takes as hidden / heads.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """A GGUF metadata value, or ``default`` when the key is absent. A float32 value comes back
    as the shortest decimal that is that float32: the value the converter was given (1e-06, not
    9.99999997e-07), so that the config equals the HF folder's."""
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if field.types and field.types[0].name == "FLOAT32" and isinstance(value, float):
        return f32_decimal(value)
    return value


def f32_decimal(value: float) -> float:
    """The shortest decimal that rounds to the float32 ``value``, as a Python float."""
    return float(str(np.float32(value)))


def kvflow_parts(arch: str, cfg: ModelConfig, gguf_name: str, rows: int,
                 names: set[str]) -> list[WeightPart]:
    """The kvflow tensors GGUF tensor ``gguf_name`` (``rows`` rows) holds; [] for one kvflow
    does not read as a weight (``rope_freqs``, ``rope_factors_*``: read into the config).
    ``names``: every tensor name in the file (Phi-3's ``ffn_up`` is fused when there is no
    ``ffn_gate``)."""
    if gguf_name in _FIXED_NAMES:
        return [WeightPart(_FIXED_NAMES[gguf_name])]
    if not gguf_name.startswith("blk."):
        return []
    _, layer, kind, suffix = gguf_name.split(".", 3)
    prefix = f"model.layers.{layer}"
    if arch == "phi3" and kind == "attn_qkv":
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        _check_rows(gguf_name, rows, q + 2 * kv, "q + k + v rows")
        return [WeightPart(f"{prefix}.self_attn.{p}.{suffix}", r) for p, r in
                (("q_proj", (0, q)), ("k_proj", (q, q + kv)), ("v_proj", (q + kv, q + 2 * kv)))]
    if arch == "phi3" and kind == "ffn_up" and f"blk.{layer}.ffn_gate.{suffix}" not in names:
        inter = cfg.intermediate_size
        _check_rows(gguf_name, rows, 2 * inter, "2 * feed_forward_length rows (gate, up)")
        return [WeightPart(f"{prefix}.mlp.gate_proj.{suffix}", (0, inter)),
                WeightPart(f"{prefix}.mlp.up_proj.{suffix}", (inter, 2 * inter))]
    table = _GEMMA_LAYER_NAMES if arch in ("gemma2", "gemma3") else _LAYER_NAMES
    if kind not in table:
        raise UnsupportedModelError(f"GGUF tensor {gguf_name}: kvflow does not know "
                                    f"{kind!r} for architecture {arch!r}")
    return [WeightPart(f"{prefix}.{table[kind]}.{suffix}")]


def _check_rows(name: str, rows: int, want: int, what: str) -> None:
    if rows != want:
        raise UnsupportedModelError(f"GGUF tensor {name}: {rows} rows, expected {want} ({what})")


def gguf_config(reader: Any, path: Path) -> tuple[ModelConfig, str]:
    """The model's config from a GGUF's metadata (and its RoPE factor tensors), and its
    llama.cpp architecture name."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in HF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"--model {path}: unknown architecture {arch!r} (kvflow runs "
            f"{sorted(HF_ARCHITECTURES)})")

    def meta(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    layers = int(meta("block_count"))
    rope_dims = meta("rope.dimension_count")
    if meta("attention.key_length") is not None:
        head_dim = int(meta("attention.key_length"))
    elif arch == "phi3" or rope_dims is None:  # Phi-3's rope dims are the rotated ones
        head_dim = hidden // heads
    else:
        head_dim = int(rope_dims)
    # The embedding's rows are the vocabulary llama.cpp runs: its Gemma 3 converter drops the
    # rows past the tokenizer's tokens while the metadata may keep the config's vocab_size.
    embd = tensors.get("token_embd.weight")
    vocab = (int(embd.shape[-1]) if embd is not None else None) or meta("vocab_size") or len(
        gguf_field(reader, "tokenizer.ggml.tokens"))
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    hf: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta("rope.freq_base", 1_000_000.0 if arch == "gemma3"
                                 else 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(reader, arch, eos),
    }
    if arch == "phi3" and rope_dims is not None:
        hf["partial_rotary_factor"] = int(rope_dims) / head_dim
    window = meta("attention.sliding_window")
    if arch in ("mistral", "phi3", "gemma3") or window is not None:
        # Absent from a Gemma 2 file: llama.cpp's default, which is HF's (4096).
        hf["sliding_window"] = int(window) if window else None
    if arch in ("gemma2", "gemma3"):
        hf.update(_gemma_keys(arch, meta, hf))
    rope_scaling = _rope_scaling(arch, meta, tensors, hf)
    if rope_scaling is not None:
        hf["rope_scaling"] = rope_scaling
    return ModelConfig.from_hf_config(hf), arch


def _gemma_keys(arch: str, meta: Any, hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2/3's keys that the converter writes, or that llama.cpp derives."""
    out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh"}
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    big = layers == _GEMMA_27B_LAYERS[arch]
    out["query_pre_attn_scalar"] = hf["hidden_size"] // heads if big else hf["head_dim"]
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = meta(key)
        if value is not None:  # absent: HF's (and llama.cpp's) family default
            out[key] = float(value)
        elif arch == "gemma3":
            out[key] = None
    if arch == "gemma3":
        out["rope_local_base_freq"] = float(meta("rope.freq_base_swa", 10000.0))
    if hf.get("sliding_window", arch == "gemma2"):
        pattern = meta("attention.sliding_window_pattern", _GEMMA_WINDOW_PATTERN[arch])
        if isinstance(pattern, list):  # one bool per layer: True = sliding
            sliding = [bool(p) for p in pattern]
        else:  # llama.cpp's set_swa_pattern: layer i is sliding when i % n < n - 1
            n = int(pattern)
            sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
        out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    return out


def _rope_scaling(arch: str, meta: Any, tensors: dict[str, Any],
                  hf: dict[str, Any]) -> dict[str, Any] | None:
    kind = meta("rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    if "rope_factors_long.weight" in tensors:  # Phi-3 longrope
        original = int(meta("rope.scaling.original_context_length"))
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "short_factor": _floats(tensors["rope_factors_short.weight"]),
            "long_factor": _floats(tensors["rope_factors_long.weight"]),
            "original_max_position_embeddings": original,
        }
        factor = hf["max_position_embeddings"] / original
        default = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        written = meta("rope.scaling.attn_factor")
        # HF computes this same default when the config has none: keep only another value.
        if written is not None and not math.isclose(float(written), default, rel_tol=1e-6):
            scaling["attention_factor"] = float(written)
        return scaling
    if "rope_freqs.weight" in tensors and arch in PERMUTED_ARCHITECTURES:
        return _llama3_scaling(np.asarray(tensors["rope_freqs.weight"].data, np.float64),
                               hf["rope_theta"], hf["head_dim"],
                               meta("rope.scaling.original_context_length"))
    if kind not in (None, "none"):
        raise UnsupportedModelError(
            f"{arch}.rope.scaling.type {kind!r}: kvflow reads 'linear' and Phi-3's longrope")
    return None


def _floats(tensor: Any) -> list[float]:
    return [f32_decimal(x) for x in np.asarray(tensor.data, np.float32).reshape(-1)]


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                        original: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as ``rope_freqs`` for Llama 3's
    rope scaling (LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs.astype(np.float64):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _llama3_scaling(written: np.ndarray, theta: float, head_dim: int,
                    original: int | None) -> dict[str, Any]:
    """``rope_scaling`` for a ``rope_freqs`` tensor: the llama3 rule with Llama 3.1/3.2's
    parameters (low 1, high 4, the original context 8192 unless the file names it) and the
    largest divisor as the factor, checked to give the file's divisors."""
    factor = float(written.max())
    context = int(original or 8192)
    want = llama3_rope_factors(theta, head_dim, factor, 1.0, 4.0, context)
    if want.shape != written.shape or not np.allclose(want, written, rtol=1e-6, atol=0):
        raise UnsupportedModelError(
            "GGUF tensor rope_freqs.weight: its divisors are not Llama 3's rope scaling "
            f"(factor {factor}, low 1, high 4, original context {context}); kvflow cannot "
            "run them")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": context}


# Families whose GGUF eos is not the token that ends a chat turn (Gemma's <eos>, Phi's
# <|endoftext|>, Qwen3's and Llama 3's text end): their turn ends are added by text, as
# llama.cpp marks end-of-generation tokens. SmolLM2's and Qwen2's GGUFs name <|im_end|>.
_TURN_END_BY_TEXT = ("gemma2", "gemma3", "phi3", "qwen3")


def _eos_ids(reader: Any, arch: str, eos: Any) -> list[int] | int | None:
    """The GGUF's eos id, and (for :data:`_TURN_END_BY_TEXT` and Llama 3) its control tokens
    that end a turn (:func:`kvflow.text.stop_tokens.end_of_turn_ids`)."""
    from kvflow.text.stop_tokens import end_of_turn_ids

    first = None if eos is None else int(eos)
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    types = gguf_field(reader, "tokenizer.ggml.token_type")
    if not tokens or not types:
        return first
    llama3 = arch == "llama" and "<|eot_id|>" in tokens
    if arch not in _TURN_END_BY_TEXT and not llama3:
        return first
    control = 3  # gguf.TokenType.CONTROL
    ends = end_of_turn_ids((i, t) for i, (t, ty) in enumerate(zip(tokens, types, strict=False))
                           if ty == control)
    ids = [first] if first is not None else []
    return ids + [i for i in ends if i != first] or None
