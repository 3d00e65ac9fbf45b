"""kvflow's weight names: HF's, except where a family's checkpoint is not what the graph runs.

kvflow's state dict is the HF state dict with three differences (contract of issue 45, §2):

- Phi-3: ``self_attn.qkv_proj.weight`` is split into ``q_proj`` / ``k_proj`` / ``v_proj`` (rows
  q, k, v) and ``mlp.gate_up_proj.weight`` into ``gate_proj`` (first half of the rows) and
  ``up_proj``, so the graph has the Llama layer's linears.
- Gemma 2/3: every RMSNorm weight is stored as ``1 + w`` (HF's Gemma norm multiplies by
  ``1 + w``), so the graph has plain RMSNorms. llama.cpp's converter writes them +1 already.
- Everything else keeps its HF name and value (Qwen3 / Gemma 3 q/k norms are
  ``model.layers.N.self_attn.q_norm.weight`` and ``...k_norm.weight``); a Gemma 3 multimodal
  checkpoint's text decoder is named as Gemma3ForCausalLM's, its other towers dropped.

:func:`weight_parts` says, for one HF tensor, which kvflow tensors it becomes (a row range and
whether 1 is added), so that the streaming build can read a range of rows without the whole
tensor; :func:`to_kvflow_names` applies it to tensors in memory (torch or numpy).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from kvflow.model.config import ModelConfig

T = TypeVar("T")  # a torch.Tensor or a numpy array: both slice rows and add a scalar

GEMMA_ARCHITECTURES = ("gemma2", "gemma3")


@dataclass(frozen=True)
class WeightPart:
    """One kvflow tensor made from one HF tensor.

    Attributes:
        name: its kvflow name.
        rows: ``(start, stop)`` rows of the HF tensor, or None for all of it.
        plus_one: the value is ``1 + w`` (a Gemma RMSNorm weight).
    """

    name: str
    rows: tuple[int, int] | None = None
    plus_one: bool = False


def is_gemma_norm(cfg: ModelConfig, name: str) -> bool:
    """Whether HF tensor ``name`` is a Gemma RMSNorm weight (stored ``1 + w`` by kvflow)."""
    return cfg.architecture in GEMMA_ARCHITECTURES and name.endswith("norm.weight")


# A Gemma 3 multimodal checkpoint's text decoder, as saved by transformers 4 and 5: kvflow runs
# it alone, named as Gemma3ForCausalLM's (its config is the text_config).
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                 "model.multi_modal_projector.")


def text_decoder_name(name: str) -> str | None:
    """A multimodal (Gemma 3) checkpoint's tensor as its text decoder's, or None for a tensor
    of another tower; any other name unchanged."""
    if name.startswith(_OTHER_TOWERS):
        return None
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def weight_parts(cfg: ModelConfig, name: str, rows: int) -> list[WeightPart]:
    """The kvflow tensors HF tensor ``name`` (with ``rows`` rows) becomes ([] for a vision
    tower's tensor of a Gemma 3 multimodal checkpoint)."""
    if cfg.architecture == "gemma3":
        text = text_decoder_name(name)
        if text is None:
            return []
        name = text
    if cfg.architecture == "phi3":
        prefix, _, tail = name.rpartition(".self_attn.qkv_proj.")
        if prefix:
            q = cfg.num_attention_heads * cfg.head_dim
            kv = cfg.num_key_value_heads * cfg.head_dim
            if rows != q + 2 * kv:
                raise ValueError(f"{name}: {rows} rows, expected q {q} + k {kv} + v {kv}")
            return [WeightPart(f"{prefix}.self_attn.q_proj.{tail}", (0, q)),
                    WeightPart(f"{prefix}.self_attn.k_proj.{tail}", (q, q + kv)),
                    WeightPart(f"{prefix}.self_attn.v_proj.{tail}", (q + kv, q + 2 * kv))]
        prefix, _, tail = name.rpartition(".mlp.gate_up_proj.")
        if prefix:
            inter = cfg.intermediate_size
            if rows != 2 * inter:
                raise ValueError(f"{name}: {rows} rows, expected 2 * intermediate_size "
                                 f"({2 * inter})")
            return [WeightPart(f"{prefix}.mlp.gate_proj.{tail}", (0, inter)),
                    WeightPart(f"{prefix}.mlp.up_proj.{tail}", (inter, 2 * inter))]
    return [WeightPart(name, None, is_gemma_norm(cfg, name))]


def apply_part(part: WeightPart, value: T) -> T:
    """``value`` (the whole HF tensor) made into ``part`` (a ``1 + w`` in fp32)."""
    out = value if part.rows is None else value[part.rows[0]:part.rows[1]]  # type: ignore[index]
    if part.plus_one:
        # In fp32, as HF's Gemma norm computes 1 + w.float(): 1 + w in bf16 would round.
        wide = out.float() if hasattr(out, "float") else out.astype("float32")  # type: ignore
        out = 1 + wide
    return out


def to_kvflow_names(cfg: ModelConfig, items: Iterable[tuple[str, T]]) -> Iterator[tuple[str, T]]:
    """HF-named tensors (torch tensors or numpy arrays) as kvflow's state dict items.

    Apply it once, to tensors read from a HF checkpoint or a transformers model: the Gemma
    ``1 + w`` is not idempotent. ``kvflow.model.loader.open_checkpoint`` already gives kvflow
    names (a GGUF's and a HF folder's alike).
    """
    for name, value in items:
        rows = int(value.shape[0]) if len(value.shape) else 0  # type: ignore[attr-defined]
        for part in weight_parts(cfg, name, rows):
            yield part.name, apply_part(part, value)
