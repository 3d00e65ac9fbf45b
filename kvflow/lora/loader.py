"""An adapter's files -> :class:`LoraAdapter`: a PEFT folder or a GGUF LoRA file, by what the
path is (the formats' readers in :mod:`.peft_format` and :mod:`.gguf_format`)."""

from __future__ import annotations

import os
from pathlib import Path

from kvflow.lora.adapter import LoraAdapter, LoraAdapterError, build_adapter
from kvflow.lora.gguf_format import read_gguf_lora
from kvflow.lora.peft_format import read_peft_folder
from kvflow.model.config import ModelConfig


def load_lora_adapter(name: str, path: str | os.PathLike, config: ModelConfig,
                      max_rank: int) -> LoraAdapter:
    """Read the LoRA adapter at ``path`` for the base model ``config``.

    ``path`` is a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``; a
    pickled ``adapter_model.bin`` is refused by name) or a GGUF LoRA file as llama.cpp's
    ``convert_lora_to_gguf.py`` writes it. Every shape is checked against ``config``;
    refused with :class:`LoraAdapterError`, by name: rank > ``max_rank``, ``modules_to_save``,
    target modules other than the attention and MLP projections (``embed_tokens``,
    ``lm_head``), DoRA (``use_dora``), ``bias`` other than ``"none"``, and a tensor whose shape
    does not fit the base. A fused module (Phi-3's ``qkv_proj`` / ``gate_up_proj``) is split
    into its parts (A shared, B's rows split).
    """
    p = Path(path)
    if p.is_dir():
        modules, alpha, base_model = read_peft_folder(p, config)
    elif p.is_file():
        modules, alpha, base_model = read_gguf_lora(p, config)
    else:
        raise LoraAdapterError(f"lora path {str(p)!r}: no such file or folder")
    return build_adapter(name, str(p), config, max_rank, modules, alpha, base_model)
