"""HF transformers' own model on the same weights: the numerical reference and the baseline."""

from __future__ import annotations

from kvflow.model.loader import resolve_model


def load_hf_reference(model: str):
    """``transformers.AutoModelForCausalLM`` in fp32, loaded by transformers itself.

    For a GGUF file transformers dequantizes it with its own code, independent of kvflow's
    loader, so agreement checks both.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model(model)
    if path.is_dir():
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32)
    return hf.eval()
