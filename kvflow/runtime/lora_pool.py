"""The LoRA slot pool: ``max_loras`` resident adapters of rank at most ``max_rank``, in arrays
whose shapes never change as adapters come and go (so neither does the engine graph).

The pool is laid out by *target group*: linears that read one input and whose products the
runner computes together. The ONNX Runtime runner's graph fuses Q/K/V and gate/up into one
matmul each (:mod:`kvflow.runtime.ort_graph_linear`), so its groups are ``qkv = (q, k, v)``,
``o``, ``gate_up = (gate, up)`` and ``down`` (:func:`fused_groups`); the PyTorch runners' linears
are separate, one group per module (:func:`module_groups`). Per layer and group:

- ``A``: ``[slots, parts, max_rank, in_features]``, each part's LoRA A;
- ``Bt``: ``[slots, max_rank, out_features]``, the parts' B (scaling folded in by the adapter
  loader) transposed and side by side, in the group's column order;
- ``ranks``: int32 ``[slots, parts]``, each part's rank (0: the slot leaves that module alone).

A and Bt are float32, or float16 where the runner's matmuls round anyway (the onnxruntime
runner with int8 activations: half the bytes each decode step reads). Rows past a part's rank
are zero. The product a token of slot ``s`` adds to its output row is
``sum_p (A[s, p] x) . Bt[s, :, cols_p]`` (``kvflow::LoraMatMul``, the reference
:func:`lora_reference`). The native op reads the arrays through their addresses
(:attr:`LoraPool.ptrs`, one row ``(A, Bt, ranks)`` per layer and group), so, as the KV pool's,
they are registered here by address while the pool lives, and :meth:`LoraPool.close` drops them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvflow.lora.adapter import LORA_MODULES, LoraAdapter, module_shape

if TYPE_CHECKING:
    from kvflow.model.config import ModelConfig

_lock = threading.Lock()
_registered: dict[int, np.ndarray] = {}


@dataclass(frozen=True)
class LoraGroup:
    """Linears of one layer that read the same input, their outputs side by side."""

    name: str
    modules: tuple[str, ...]
    in_features: int
    out_features: tuple[int, ...]  # per module

    @property
    def columns(self) -> int:
        return sum(self.out_features)

    def part_columns(self) -> list[tuple[int, int]]:
        """Each module's ``[start, end)`` columns of the group's output."""
        ends = np.cumsum((0, *self.out_features))
        return [(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:], strict=True)]


def _module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target module's ``(in_features, out_features)``."""
    return {m: module_shape(cfg, m)[::-1] for m in LORA_MODULES}


def pool_bytes(cfg: ModelConfig, max_loras: int, max_rank: int, itemsize: int = 4) -> int:
    """What a slot pool of ``max_loras`` x ``max_rank`` holds for ``cfg`` at ``itemsize`` bytes
    an element (fp32 by default: an upper bound for the fp16 pools), whatever its grouping:
    each module's A and B rows, every layer (the engine's memory budget counts it)."""
    per_rank = sum(k + n for k, n in _module_shapes(cfg).values())
    return cfg.num_hidden_layers * max_loras * max_rank * per_rank * itemsize


def fused_groups(cfg: ModelConfig) -> list[LoraGroup]:
    """The ONNX Runtime runner's groups: its graph's fused Q/K/V and gate/up matmuls."""
    shapes = _module_shapes(cfg)
    parts = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
             "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
    return [LoraGroup(name, mods, shapes[mods[0]][0], tuple(shapes[m][1] for m in mods))
            for name, mods in parts.items()]


def module_groups(cfg: ModelConfig) -> list[LoraGroup]:
    """One group per target module (the PyTorch model's separate linears)."""
    return [LoraGroup(m, (m,), k, (n,)) for m, (k, n) in _module_shapes(cfg).items()]


def lookup(addr: int) -> np.ndarray:
    """The pool array registered at ``addr`` (a live pool's ``A``, ``Bt`` or ``ranks``)."""
    try:
        return _registered[int(addr)]
    except KeyError:
        raise KeyError(f"lora_ptrs holds address {int(addr):#x}, which is no live LoRA pool "
                       "array (was the pool closed?)") from None


def registered_arrays() -> int:
    """How many pool arrays are registered now (0 once every pool is closed)."""
    return len(_registered)


def _register(array: np.ndarray) -> int:
    addr = int(array.__array_interface__["data"][0])
    with _lock:
        _registered[addr] = array
    return addr


class LoraPool:
    """``max_loras`` LoRA slots over ``groups`` of every one of ``num_layers`` layers (see the
    module doc for the layout), A and Bt in ``dtype`` (float32 or float16). Slots start empty
    (zeros: rank 0 everywhere)."""

    def __init__(self, groups: list[LoraGroup], num_layers: int, max_loras: int,
                 max_rank: int, dtype: np.dtype | type = np.float32) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_rank}")
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
            raise ValueError(f"a LoRA pool holds float32 or float16, got {self.dtype}")
        self.groups = {g.name: g for g in groups}
        self.num_layers, self.max_loras, self.max_rank = num_layers, max_loras, max_rank
        self._where = {(m): (g.name, p) for g in groups for p, m in enumerate(g.modules)}
        self.a: dict[str, np.ndarray] = {}
        self.bt: dict[str, np.ndarray] = {}
        self.ranks: dict[str, np.ndarray] = {}
        for g in groups:
            parts = len(g.modules)
            self.a[g.name] = np.zeros((num_layers, max_loras, parts, max_rank, g.in_features),
                                      self.dtype)
            self.bt[g.name] = np.zeros((num_layers, max_loras, max_rank, g.columns), self.dtype)
            self.ranks[g.name] = np.zeros((num_layers, max_loras, parts), np.int32)
        self._arrays = [x for g in groups for arr in (self.a, self.bt, self.ranks)
                        for x in arr[g.name]]
        rows = [[_register(self.a[g.name][i]), _register(self.bt[g.name][i]),
                 _register(self.ranks[g.name][i])]
                for i in range(num_layers) for g in groups]
        self.ptrs = np.array(rows, np.int64).reshape(len(rows), 3)
        self.slot_names: list[str | None] = [None] * max_loras

    def row(self, layer: int, group: str) -> int:
        """The row of :attr:`ptrs` holding ``group`` of ``layer`` (a LoraMatMul's ``module``)."""
        return layer * len(self.groups) + list(self.groups).index(group)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for arr in (self.a, self.bt, self.ranks) for x in arr.values())

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} is outside the pool's slots 0..{self.max_loras - 1}"
                             " (max_loras)")

    def clear(self, slot: int) -> None:
        """Zero slot ``slot``: its tokens get the base model's output."""
        self._check_slot(slot)
        for name in self.groups:
            self.a[name][:, slot] = 0
            self.bt[name][:, slot] = 0
            self.ranks[name][:, slot] = 0
        self.slot_names[slot] = None

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write ``adapter`` into ``slot``; what it leaves out is zeroed. Every shape is checked
        first (nothing is written for a bad adapter): an error names the adapter, the
        ``(layer, module)``, and the limit."""
        self._check_slot(slot)
        where = f"adapter {adapter.name!r}"
        for (layer, module), (a, b) in adapter.weights.items():
            if module not in self._where:
                raise ValueError(f"{where}: module {module!r} is no LoRA target of this runner "
                                 f"(targets: {', '.join(m for m in LORA_MODULES)})")
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"{where}: layer {layer} of {module} is outside the model's "
                                 f"{self.num_layers} layers")
            group = self.groups[self._where[module][0]]
            part = self._where[module][1]
            k, n = group.in_features, group.out_features[part]
            r = a.shape[0] if a.ndim == 2 else -1
            if a.shape != (r, k) or b.shape != (n, r):
                raise ValueError(f"{where}: layer {layer} {module} has A {tuple(a.shape)} and B "
                                 f"{tuple(b.shape)}; expected A [r, {k}] and B [{n}, r]")
            if r > self.max_rank:
                raise ValueError(f"{where}: layer {layer} {module} has rank {r}, above "
                                 f"max_lora_rank {self.max_rank}")
        self.clear(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            name, part = self._where[module]
            start, end = self.groups[name].part_columns()[part]
            r = a.shape[0]
            self.a[name][layer, slot, part, :r] = a
            self.bt[name][layer, slot, :r, start:end] = np.asarray(b).T
            self.ranks[name][layer, slot, part] = r
        self.slot_names[slot] = adapter.name

    def close(self) -> None:
        """Unregister and drop the arrays (the native op must not run on this pool again)."""
        with _lock:
            for x in self._arrays:
                _registered.pop(int(x.__array_interface__["data"][0]), None)
        self._arrays = []
        self.a, self.bt, self.ranks = {}, {}, {}
        self.ptrs = np.zeros((0, 3), np.int64)


def lora_reference(y: np.ndarray, x: np.ndarray, a: np.ndarray, bt: np.ndarray,
                   ranks: np.ndarray, slots: np.ndarray,
                   part_cols: list[tuple[int, int]]) -> np.ndarray:
    """What ``kvflow::LoraMatMul`` computes, in float64 NumPy: ``y`` ``[T, N]`` plus, for each
    token ``t`` of slot ``s = slots[t] >= 0``, ``(A[s, p, :r] x_t) . Bt[s, :r, cols_p]`` for each
    part ``p`` of rank ``r = ranks[s, p]``. ``a``, ``bt``, ``ranks``: one layer's group."""
    out = y.astype(np.float64).copy()
    for t, s in enumerate(slots):
        if s < 0:
            continue
        for p, (start, end) in enumerate(part_cols):
            r = int(ranks[s, p])
            if r:
                u = a[s, p, :r].astype(np.float64) @ x[t].astype(np.float64)
                out[t, start:end] += u @ bt[s, :r, start:end].astype(np.float64)
    return out
