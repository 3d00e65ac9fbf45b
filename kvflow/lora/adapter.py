"""A LoRA adapter as kvflow serves it: per (layer, module), A [r, in] and B [out, r] in fp32 with
the scaling folded into B, checked against the base model's shapes.

Two sources read into the same :class:`LoraAdapter` (equal to fp32 rounding for the same
adapter): a PEFT folder (:mod:`kvflow.lora.peft_format`) and a GGUF LoRA file as llama.cpp's
``convert_lora_to_gguf.py`` writes it (:mod:`kvflow.lora.gguf_format`). Both reduce to a list of
:class:`ModuleLora` (one module's A, B and scale, already in kvflow's module names, Phi-3's fused
linears split), which :func:`build_adapter` checks and folds. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from kvflow.model.config import ModelConfig

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The HF linear each kvflow module sits under (model.layers.N.<group>.<module>).
MODULE_GROUPS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                 "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class LoraAdapterError(ValueError):
    """A bad adapter: message names the field/file and the limit."""


@dataclass(frozen=True)
class LoraAdapter:
    """One LoRA adapter, ready for a runner's slot pool.

    Attributes:
        name: the name requests select it by.
        path: the PEFT folder or GGUF file it was read from.
        rank: r of the adapter (the largest of its modules' ranks; a module of a smaller rank,
            from PEFT's ``rank_pattern``, is padded with zero rows of A / columns of B, which
            add nothing to the product).
        alpha: ``lora_alpha`` as the file gives it (informational: the scaling is in B).
        weights: ``(layer, module) -> (A float32 [rank, in_features], B float32
            [out_features, rank])``, B already multiplied by the module's scaling, so that the
            adapted linear is ``W x + B (A x)``. Modules the adapter leaves out are absent.
        digest: sha256 hex over the canonical weights: two adapters with the same digest
            compute the same thing (the prefix cache's key).
        base_model: the base model the file names (``base_model_name_or_path`` or the GGUF's
            base model); recorded, never checked: the shapes decide whether it fits.
    """

    name: str
    path: str
    rank: int
    alpha: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    digest: str
    base_model: str | None

    @property
    def nbytes(self) -> int:
        """Bytes of the A and B arrays together."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


@dataclass(frozen=True)
class ModuleLora:
    """One module's low-rank pair as a file holds it, before scaling.

    Attributes:
        layer: the decoder layer index.
        module: one of :data:`LORA_MODULES`.
        a: ``[r, in_features]`` (any float dtype).
        b: ``[out_features, r]``.
        scale: what B is multiplied by (``alpha / r``, or ``alpha / sqrt(r)`` with rslora).
        source: the tensor names it came from, for error messages.
    """

    layer: int
    module: str
    a: np.ndarray
    b: np.ndarray
    scale: float
    source: str


MAX_LORA_NAME_CHARS = 256
_NAME_FORBIDDEN = frozenset('"{}\\=')


def check_lora_name(name: object) -> str:
    """An adapter's name, refused (ValueError naming ``lora_name``) unless it is 1 to 256
    printable characters without spaces or any of ``" { } \\ =``: it travels in metric labels,
    ``NAME=PATH`` flags and JSON, where those would be misread."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"lora_name must be a non-empty string, got {name!r}")
    if len(name) > MAX_LORA_NAME_CHARS:
        raise ValueError(f"lora_name is {len(name)} characters; the limit is "
                         f"{MAX_LORA_NAME_CHARS}")
    if not name.isprintable() or any(c.isspace() or c in _NAME_FORBIDDEN for c in name):
        raise ValueError(f"lora_name {name[:60]!r} must be printable, without spaces or any of "
                         f"\" {{ }} \\ =")
    return name


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """``(out_features, in_features)`` of the base model's linear ``module``."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}[module]


def build_adapter(name: str, path: str, config: ModelConfig, max_rank: int,
                  modules: list[ModuleLora], alpha: float,
                  base_model: str | None) -> LoraAdapter:
    """Check ``modules`` against ``config`` and ``max_rank``; fold each scale into B; pad to
    one rank; hash."""
    if not modules:
        raise LoraAdapterError(f"{path}: the adapter has no LoRA weights")
    seen: dict[tuple[int, str], str] = {}
    for m in sorted(modules, key=_module_order):  # the first misfit in the model's order
        _check_module(path, config, max_rank, m)
        key = (m.layer, m.module)
        if key in seen:
            raise LoraAdapterError(f"{path}: layer {m.layer} {m.module} given twice "
                                   f"({seen[key]} and {m.source})")
        seen[key] = m.source
    rank = max(int(m.a.shape[0]) for m in modules)
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    for m in sorted(modules, key=_module_order):
        a = np.asarray(m.a, dtype=np.float32)
        # NOTE: B * scale in fp32, as PEFT's (B @ A) * scaling multiplies fp32 by a Python float.
        b = np.asarray(m.b, dtype=np.float32) * np.float32(m.scale)
        r = a.shape[0]
        if r < rank:
            a = np.concatenate([a, np.zeros((rank - r, a.shape[1]), np.float32)])
            b = np.concatenate([b, np.zeros((b.shape[0], rank - r), np.float32)], axis=1)
        # NOTE: copies, read-only: a GGUF's arrays are views of its memory map (a file written
        # over would change them), and runners share one adapter's arrays.
        a, b = np.array(a, np.float32, order="C"), np.array(b, np.float32, order="C")
        a.setflags(write=False)
        b.setflags(write=False)
        weights[(m.layer, m.module)] = (a, b)
    return LoraAdapter(name=name, path=path, rank=rank, alpha=float(alpha), weights=weights,
                       digest=weights_digest(weights), base_model=base_model)


def _module_order(m: ModuleLora) -> tuple[int, int]:
    return m.layer, LORA_MODULES.index(m.module) if m.module in LORA_MODULES else -1


def _check_module(path: str, config: ModelConfig, max_rank: int, m: ModuleLora) -> None:
    if m.module not in LORA_MODULES:
        raise LoraAdapterError(f"{path}: {m.source}: module {m.module!r} is not one kvflow "
                               f"adapts (target modules must be in {list(LORA_MODULES)})")
    if not 0 <= m.layer < config.num_hidden_layers:
        raise LoraAdapterError(f"{path}: {m.source}: layer {m.layer} is past the base model's "
                               f"{config.num_hidden_layers} layers")
    if m.a.ndim != 2 or m.b.ndim != 2:
        raise LoraAdapterError(f"{path}: {m.source}: A and B must be 2-D, got shapes "
                               f"{list(m.a.shape)} and {list(m.b.shape)}")
    r = int(m.a.shape[0])
    if r > max_rank:
        raise LoraAdapterError(f"{path}: {m.source}: rank {r} is over max_lora_rank "
                               f"{max_rank}")
    out_f, in_f = module_shape(config, m.module)
    want_a, want_b = (r, in_f), (out_f, r)
    if tuple(m.a.shape) != want_a or tuple(m.b.shape) != want_b:
        raise LoraAdapterError(
            f"{path}: {m.source}: shapes A {list(m.a.shape)}, B {list(m.b.shape)} do not fit "
            f"the base model's layer {m.layer} {m.module} (in {in_f}, out {out_f}): expected "
            f"A {list(want_a)}, B {list(want_b)}")
    if not np.isfinite(m.scale) or not (np.all(np.isfinite(m.a)) and np.all(np.isfinite(m.b))):
        raise LoraAdapterError(f"{path}: {m.source}: non-finite values or scaling")


def weights_digest(weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]) -> str:
    """sha256 hex over each module's key, shapes and fp32 little-endian bytes, in layer and
    :data:`LORA_MODULES` order."""
    h = hashlib.sha256(b"kvflow-lora-v1")
    for (layer, module) in sorted(weights, key=lambda k: (k[0], LORA_MODULES.index(k[1]))):
        a, b = weights[(layer, module)]
        h.update(f"{layer}.{module}:{a.shape}:{b.shape};".encode())
        h.update(np.ascontiguousarray(a, dtype="<f4").tobytes())
        h.update(np.ascontiguousarray(b, dtype="<f4").tobytes())
    return h.hexdigest()


def kvflow_module(name: str) -> tuple[int, str] | None:
    """``(layer, module)`` of a kvflow weight name ``model.layers.N.<group>.<module>.weight``,
    or None for any other tensor (embeddings, lm_head, norms)."""
    parts = name.split(".")
    if (len(parts) != 6 or parts[:2] != ["model", "layers"] or not parts[2].isdigit()
            or parts[5] != "weight" or MODULE_GROUPS.get(parts[4]) != parts[3]):
        return None
    return int(parts[2]), parts[4]
