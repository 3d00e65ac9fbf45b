"""Adapters made locally, for tests and benchmarks: a PEFT LoRA adapter with random nonzero
weights for a HF checkpoint (torch and peft imported inside), and any adapter written as a GGUF
LoRA file in the layout of llama.cpp's ``convert_lora_to_gguf.py`` (gguf-py, no torch)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.lora.adapter import LORA_MODULES, LoraAdapter, LoraAdapterError
from kvflow.model.config import ModelConfig
from kvflow.model.gguf_config import _LAYER_NAMES, PERMUTED_ARCHITECTURES

# kvflow / HF module -> the GGUF tensor kind llama.cpp's converter names it (the base model's
# map, inverted), and Phi-3's fused modules.
GGUF_KINDS = {hf.split(".")[-1]: kind for kind, hf in _LAYER_NAMES.items()
              if hf.split(".")[-1] in LORA_MODULES}
PHI3_FUSED = {"qkv_proj": ("attn_qkv", ("q_proj", "k_proj", "v_proj")),
              "gate_up_proj": ("ffn_up", ("gate_proj", "up_proj"))}


def make_peft_adapter(hf_model_dir: str | Path, out_dir: str | Path, *, rank: int = 8,
                      alpha: float = 16, targets: Sequence[str] | str = LORA_MODULES,
                      seed: int = 0, use_rslora: bool = False, scale: float = 0.05,
                      **lora_config: Any) -> Path:
    """A PEFT LoRA adapter for the HF checkpoint in ``hf_model_dir``, random nonzero A and B
    (B is zero at PEFT init: both are filled here with seeded normal * ``scale``), saved with
    ``save_pretrained``; returns ``out_dir``.

    ``targets``: kvflow module names (on a fused checkpoint, Phi-3, q/k/v become ``qkv_proj``
    and gate/up ``gate_up_proj``), or a regex string passed to PEFT as is. ``lora_config``:
    further ``LoraConfig`` fields (``rank_pattern``, ``layers_to_transform``, ...).
    """
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_model_dir),
                                                              dtype=torch.float32)
    if not isinstance(targets, str):
        targets = _model_targets(model, targets)
    # PEFT types lora_alpha int, and computes with any number.
    fields = {"lora_dropout": 0.0, "bias": "none", **lora_config}
    config = LoraConfig(r=rank, lora_alpha=alpha,  # type: ignore[arg-type]
                        target_modules=targets, use_rslora=use_rslora, **fields)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    out = Path(out_dir)
    peft_model.save_pretrained(str(out))
    return out


def _model_targets(model: Any, targets: Sequence[str]) -> list[str]:
    """``targets`` as the model's own linear names (Phi-3's fused ones where it has them)."""
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    out: list[str] = []
    for t in targets:
        fused = next((f for f, (_, parts) in PHI3_FUSED.items() if t in parts and f in names),
                     None)
        name = t if t in names else fused
        if name is None:
            raise ValueError(f"targets: the model has no module {t!r}")
        if name not in out:
            out.append(name)
    return out


def permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (LlamaModel.permute): HF's half-split RoPE rows to
    interleaved pairs; :func:`kvflow.model.checkpoint_tensors.unpermute_rope` undoes it."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf_lora(adapter: LoraAdapter | str | Path, out_path: str | Path,
                    config: ModelConfig) -> Path:
    """The adapter as a GGUF LoRA file in ``convert_lora_to_gguf.py``'s layout; returns
    ``out_path``.

    From a PEFT folder it writes what the converter writes: A and B unscaled, named after the
    base model's GGUF tensors, Llama / Mistral Q and K rows of B permuted, Phi-3's fused
    modules kept, ``adapter.lora.alpha = lora_alpha`` (and refuses rslora and rank / alpha
    patterns by name, which the format cannot carry and the converter drops). From a
    :class:`LoraAdapter` (B already scaled) it writes B as it is, with ``alpha = r`` so that
    llama.cpp's ``alpha / r`` is 1 (0, llama.cpp's "unscaled", when ranks differ: Phi-3's
    q/k/v with different A's are fused block-diagonally, rank r per part).
    """
    from gguf import GGUFType, GGUFWriter

    arch = config.architecture
    if isinstance(adapter, LoraAdapter):
        tensors, alpha, base = _from_adapter(adapter, config), None, adapter.base_model
    else:
        tensors, alpha, base = _from_peft(Path(adapter), config)
    ranks = {a.shape[0] for a, _ in tensors.values()}
    if alpha is None:
        alpha = float(ranks.pop()) if len(ranks) == 1 else 0.0
    out = Path(out_path)
    writer = GGUFWriter(str(out), arch)
    writer.add_type(GGUFType.ADAPTER)
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(alpha))
    if base:
        writer.add_base_model_count(1)
        writer.add_base_model_name(0, str(base))
    for name, (a, b) in tensors.items():
        if arch in PERMUTED_ARCHITECTURES and (".attn_q." in name or ".attn_k." in name):
            heads = (config.num_attention_heads if ".attn_q." in name
                     else config.num_key_value_heads)
            b = permute_rope(b, heads)
        writer.add_tensor(f"{name}.lora_a", np.ascontiguousarray(a, np.float32))
        writer.add_tensor(f"{name}.lora_b", np.ascontiguousarray(b, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _from_peft(folder: Path, config: ModelConfig
               ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], float, str | None]:
    from kvflow.lora.peft_format import check_lora_config, read_safetensors

    lcfg = json.loads((folder / "adapter_config.json").read_text())
    check_lora_config(lcfg, config, folder / "adapter_config.json")
    for key in ("use_rslora", "rank_pattern", "alpha_pattern"):
        if lcfg.get(key):
            raise LoraAdapterError(f"{folder}: {key} = {lcfg[key]!r}: a GGUF LoRA carries one "
                                   "alpha / r scaling (llama.cpp's converter drops it)")
    raw = read_safetensors(folder / "adapter_model.safetensors")
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for key in sorted(raw):
        if ".lora_A." not in key:
            continue
        module_key = key.split(".lora_A.")[0]  # base_model.model.model.layers.N.group.module
        parts = module_key.split(".")
        layer, module = int(parts[-3]), parts[-1]
        kind = PHI3_FUSED[module][0] if module in PHI3_FUSED else GGUF_KINDS.get(module)
        if kind is None:
            raise LoraAdapterError(f"{folder}: {key}: no GGUF tensor for module {module!r}")
        out[f"blk.{layer}.{kind}.weight"] = (raw[key], raw[key.replace(".lora_A.", ".lora_B.")])
    base = lcfg.get("base_model_name_or_path")
    return out, float(lcfg["lora_alpha"]), str(base) if base else None


def _from_adapter(adapter: LoraAdapter, config: ModelConfig
                  ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from kvflow.lora.adapter import module_shape

    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    layers = sorted({layer for layer, _ in adapter.weights})
    for layer in layers:
        mods = {m: w for (i, m), w in adapter.weights.items() if i == layer}
        if config.architecture == "phi3":
            for kind, parts in PHI3_FUSED.values():
                present = [p for p in parts if p in mods]
                if present:
                    out[f"blk.{layer}.{kind}.weight"] = _fuse(
                        [(module_shape(config, p)[0], mods.get(p)) for p in parts])
                for p in parts:
                    mods.pop(p, None)
        for module, (a, b) in mods.items():
            out[f"blk.{layer}.{GGUF_KINDS[module]}.weight"] = (a, b)
    return out


def _fuse(parts: list[tuple[int, tuple[np.ndarray, np.ndarray] | None]]
          ) -> tuple[np.ndarray, np.ndarray]:
    """One LoRA pair for a fused linear whose row blocks are ``parts`` (rows, pair or None):
    A shared when every part has the same A, else stacked (B block-diagonal)."""
    present = [w for _, w in parts if w is not None]
    shared = len(present) == len(parts) and all(np.array_equal(w[0], present[0][0])
                                                 for w in present)
    a = present[0][0] if shared else np.concatenate([w[0] for w in present])
    b = np.zeros((sum(rows for rows, _ in parts), a.shape[0]), np.float32)
    row = col = 0
    for rows, w in parts:
        if w is not None:
            r = w[0].shape[0]
            cols = slice(0, r) if shared else slice(col, col + r)
            b[row:row + rows, cols] = w[1]
            col += r
        row += rows
    return a, b
