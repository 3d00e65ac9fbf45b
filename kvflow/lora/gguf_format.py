"""A GGUF LoRA file, as llama.cpp's ``convert_lora_to_gguf.py`` writes it, read into
:class:`~kvflow.lora.adapter.ModuleLora` entries.

The layout (llama.cpp's converter and ``src/llama-adapter.cpp``):

- metadata ``general.type = "adapter"``, ``adapter.type = "lora"``, ``adapter.lora.alpha``
  (float32), ``general.architecture`` the base model's llama.cpp architecture;
- per adapted weight two tensors named after the base model's GGUF tensor,
  ``blk.N.attn_q.weight.lora_a`` (ggml ne ``[in, r]``: numpy ``[r, in]``, PEFT's A) and
  ``...lora_b`` (ne ``[r, out]``: numpy ``[out, r]``, PEFT's B, unscaled);
- the converter's per-family changes applied to B as to the base weight: Llama / Mistral Q and K
  rows permuted for interleaved RoPE, Phi-3's fused ``attn_qkv`` and ``ffn_up`` (gate, up) kept;
- llama.cpp scales by ``alpha / r`` (r = B's columns), and by 1 when alpha is 0. The converter
  drops PEFT's rslora, rank_pattern and alpha_pattern: a file carries one alpha.

Names map to kvflow's through the base model's map (:func:`kvflow.model.gguf_config
.kvflow_parts`), and Q/K rows are un-permuted as the model reader does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvflow.lora.adapter import LORA_MODULES, LoraAdapterError, ModuleLora, kvflow_module
from kvflow.model.checkpoint_tensors import unpermute_rope
from kvflow.model.config import ModelConfig, UnsupportedModelError
from kvflow.model.gguf_config import PERMUTED_ARCHITECTURES, gguf_field, kvflow_parts

GGUF_MAGIC = b"GGUF"


def is_gguf(path: Path) -> bool:
    """Whether ``path`` starts with the GGUF magic."""
    with open(path, "rb") as fh:
        return fh.read(4) == GGUF_MAGIC


def read_gguf_lora(path: Path, config: ModelConfig
                   ) -> tuple[list[ModuleLora], float, str | None]:
    """The file's modules (unscaled A, B and llama.cpp's scaling), its alpha and the base
    model it names."""
    from gguf import GGUFReader

    if not is_gguf(path):
        raise LoraAdapterError(f"{path}: neither a PEFT folder nor a GGUF file")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf-py raises ValueError, struct.error, ... on a broken file
        raise LoraAdapterError(f"{path}: not a readable GGUF file: {e}") from e
    kind, adapter = gguf_field(reader, "general.type"), gguf_field(reader, "adapter.type")
    if kind != "adapter" or adapter != "lora":
        raise LoraAdapterError(f"{path}: general.type = {kind!r}, adapter.type = {adapter!r}: "
                               "a GGUF LoRA has 'adapter' and 'lora'")
    arch = gguf_field(reader, "general.architecture")
    if not _same_graph(arch, config.architecture):
        raise LoraAdapterError(f"{path}: general.architecture {arch!r} does not fit the base "
                               f"model's {config.architecture!r}")
    if reader.fields.get("adapter.alora.invocation_tokens") is not None:
        raise LoraAdapterError(f"{path}: adapter.alora.invocation_tokens: kvflow does not "
                               "serve activated LoRA (aLoRA)")
    alpha = float(gguf_field(reader, "adapter.lora.alpha", 0.0))
    pairs = _pairs(reader, path)
    names = set(pairs)
    out: list[ModuleLora] = []
    for base_name, (a, b) in pairs.items():
        r = int(b.shape[1]) if b.ndim == 2 else 0
        scale = alpha / r if alpha and r else 1.0  # llama_adapter_lora_weight::get_scale
        out.extend(_modules(arch, config, base_name, a, b, scale, names, path))
    return out, alpha, _base_model(reader)


def _same_graph(arch: Any, family: str) -> bool:
    # llama.cpp converts a Mistral HF checkpoint as 'llama': the same graph and row permutation.
    if arch in PERMUTED_ARCHITECTURES and family in PERMUTED_ARCHITECTURES:
        return True
    return bool(arch == family)


def _pairs(reader: Any, path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """base tensor name -> (A [r, in], B [out, r]) in fp32."""
    from gguf.quants import dequantize

    halves: dict[str, dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        name = str(t.name)
        base, dot, half = name.rpartition(".")
        if not dot or half not in ("lora_a", "lora_b"):
            if name.endswith("_norm.weight"):
                raise LoraAdapterError(f"{path}: tensor {name}: a trained norm weight, which "
                                       "kvflow does not serve (only lora_a / lora_b pairs)")
            raise LoraAdapterError(f"{path}: tensor {name}: not a .lora_a / .lora_b tensor")
        shape = tuple(int(d) for d in reversed(t.shape))
        try:
            values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError as e:
            raise LoraAdapterError(f"{path}: tensor {name}: type {t.tensor_type.name} is not "
                                   f"one gguf-py decodes: {e}") from e
        halves.setdefault(base, {})[half] = values.reshape(shape)
    out = {}
    for base, ab in halves.items():
        if set(ab) != {"lora_a", "lora_b"}:
            raise LoraAdapterError(f"{path}: {base} has {sorted(ab)[0]} without its pair")
        out[base] = (ab["lora_a"], ab["lora_b"])
    return out


def _modules(arch: str, config: ModelConfig, base_name: str, a: np.ndarray, b: np.ndarray,
             scale: float, names: set[str], path: Path) -> list[ModuleLora]:
    source = f"{base_name}.lora_a / .lora_b"
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise LoraAdapterError(f"{path}: {source}: lora_a {list(a.shape)} and lora_b "
                               f"{list(b.shape)} are not a [r, in] / [out, r] pair")
    if base_name in ("token_embd.weight", "output.weight"):
        what = "embed_tokens" if base_name.startswith("token") else "lm_head"
        raise LoraAdapterError(f"{path}: {source}: a LoRA on {what}, which kvflow does not "
                               f"serve (target modules must be in {list(LORA_MODULES)})")
    try:
        parts = kvflow_parts(arch, config, base_name, int(b.shape[0]), names)
    except (UnsupportedModelError, ValueError) as e:
        raise LoraAdapterError(f"{path}: {source}: lora_b {list(b.shape)} does not fit the "
                               f"base model: {e}") from e
    out = []
    for part in parts:
        found = kvflow_module(part.name)
        if found is None:
            raise LoraAdapterError(f"{path}: {source}: {part.name} is not a module kvflow "
                                   f"adapts (target modules must be in {list(LORA_MODULES)})")
        layer, module = found
        part_b = b if part.rows is None else b[part.rows[0]:part.rows[1]]
        heads = _permuted_heads(arch, config, module)
        if heads and part_b.shape[0] % (2 * heads) == 0:  # a misfit is refused by its shape
            part_b = unpermute_rope(part_b, heads)
        out.append(ModuleLora(layer, module, a, part_b, scale, source))
    return out


def _permuted_heads(arch: str, config: ModelConfig, module: str) -> int | None:
    """Heads of a Q or K whose B rows llama.cpp's converter permuted, else None."""
    if arch not in PERMUTED_ARCHITECTURES:
        return None
    return {"q_proj": config.num_attention_heads,
            "k_proj": config.num_key_value_heads}.get(module)


def _base_model(reader: Any) -> str | None:
    for key in ("general.base_model.0.name", "general.base_model.0.repo_url",
                "general.basename", "general.name"):
        value = gguf_field(reader, key)
        if value:
            return str(value)
    return None
