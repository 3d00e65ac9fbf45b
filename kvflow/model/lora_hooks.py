"""LoRA on the step model's linears, as forward hooks (the PyTorch runners' multi-LoRA).

:class:`~kvflow.model.llama.LlamaForCausalLM` itself knows nothing of LoRA: its code, and so
the ONNX graph ``kvflow build-engine`` exports from it, stay exactly what they are without
adapters. A runner that enables LoRA adds a hook to each target linear (:func:`add_lora_hooks`)
that passes the linear's input and output to the runner's ``delta``, which returns the output
with each token's adapter product added (or None to keep it), and removes the hooks on close.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvflow.model.llama import LlamaForCausalLM

# The linears a LoRA adapter may target (kvflow.lora.LORA_MODULES), by the submodule holding each.
_LORA_PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                 "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# (layer, module, x, y) -> the linear's new output, or None to keep y.
LoraDelta = Callable[[int, str, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def lora_linears(model: LlamaForCausalLM) -> dict[tuple[int, str], nn.Linear]:
    """The linears a LoRA adapter may target, by ``(layer, module)`` (HF's module names)."""
    return {(i, name): getattr(getattr(layer, parent), name)
            for i, layer in enumerate(model.model.layers) for name, parent in _LORA_PARENTS.items()}


def add_lora_hooks(model: LlamaForCausalLM,
                   delta: LoraDelta) -> list[torch.utils.hooks.RemovableHandle]:
    """Route every LoRA target linear's output through ``delta(layer, module, x, y)`` (a forward
    hook; returning None keeps ``y``); remove them with the handles returned."""
    handles = []
    for (layer, module), linear in lora_linears(model).items():
        def hook(_mod: nn.Module, args: tuple, y: torch.Tensor, layer: int = layer,
                 module: str = module) -> torch.Tensor | None:
            return delta(layer, module, args[0], y)
        handles.append(linear.register_forward_hook(hook))
    return handles
