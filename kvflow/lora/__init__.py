"""LoRA adapters: read (PEFT folders, GGUF LoRA files), checked against the base model, and
ready for a runner's slot pool (kvflow/lora/adapter.py). No torch at import."""

from kvflow.lora.adapter import LORA_MODULES, LoraAdapter, LoraAdapterError
from kvflow.lora.loader import load_lora_adapter

__all__ = ["LORA_MODULES", "LoraAdapter", "LoraAdapterError", "load_lora_adapter"]
