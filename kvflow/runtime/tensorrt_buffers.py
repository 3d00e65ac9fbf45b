"""The TensorRT runner's buffers, planned once from the optimization profile (NumPy only).

Every step input gets a slot in one staging area, sized for the profile's maximum shape and
aligned to 256 bytes (TensorRT's I/O alignment). A step packs its inputs one after another into
the pinned host copy of that area (:meth:`BufferPlan.pack`), so that one host-to-device copy
moves them all; the engine is then given each input's shape and its address inside the
device copy. The logits buffer holds the profile's most rows. ``kv_cache_ptrs`` is not staged:
the runner writes it once, when it allocates the KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kvflow.build.engine_config import BuildLimits
from kvflow.build.profile import INPUT_DTYPES, LOGITS_DTYPE, logits_max_shape, profile_shapes
from kvflow.model.config import ModelConfig
from kvflow.runtime.base import StepInput

ALIGNMENT = 256  # bytes; TensorRT warns on (and may copy) I/O tensors less aligned
# The step inputs the runner copies each step, in StepInput's order.
STEP_INPUTS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
               "query_start_loc", "logits_indices")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class TensorSlot:
    """One engine tensor's buffer: its element type and the largest shape the profile allows."""

    name: str
    dtype: np.dtype
    max_shape: tuple[int, ...]

    @property
    def max_nbytes(self) -> int:
        return int(np.prod(self.max_shape)) * self.dtype.itemsize


@dataclass(frozen=True)
class PackedStep:
    """Where a packed step's inputs lie in the staging area: ``offsets[name]`` (bytes) and
    ``shapes[name]``; ``nbytes`` is how much of the area the one copy must move.
    ``num_logits``: the rows of logits the step wants (the engine is asked for at least one)."""

    shapes: dict[str, tuple[int, ...]]
    offsets: dict[str, int]
    nbytes: int
    num_logits: int


@dataclass(frozen=True)
class BufferPlan:
    """The runner's buffers for one engine: the staged step inputs, ``kv_cache_ptrs`` and the
    logits, each at the profile's maximum shape."""

    inputs: dict[str, TensorSlot]
    kv_cache_ptrs: TensorSlot
    logits: TensorSlot

    @property
    def staging_nbytes(self) -> int:
        """The staging area (host and device): every step input at its largest, aligned."""
        return sum(_aligned(s.max_nbytes) for s in self.inputs.values())

    @property
    def device_nbytes(self) -> int:
        """Device memory for I/O, the KV pool aside."""
        return (self.staging_nbytes + _aligned(self.kv_cache_ptrs.max_nbytes)
                + self.logits.max_nbytes)

    def step_arrays(self, step: StepInput) -> dict[str, np.ndarray]:
        """The step's inputs as the engine takes them: the contract's types, C order. A step
        that samples nothing (middle prefill chunks) still asks for row 0: the profile's
        smallest ``logits_indices`` is one row."""
        if not len(step.logits_indices):
            step = replace(step, logits_indices=np.zeros(1, np.int64))
        arrays = {}
        for name, slot in self.inputs.items():
            a = np.ascontiguousarray(getattr(step, name), dtype=slot.dtype)
            if a.ndim != len(slot.max_shape) or any(
                    d > m for d, m in zip(a.shape, slot.max_shape, strict=True)):
                raise ValueError(f"step input {name} of shape {a.shape} is outside the engine's "
                                 f"optimization profile (at most {slot.max_shape}, from its "
                                 "build limits)")
            arrays[name] = a
        return arrays

    def pack(self, step: StepInput, staging: np.ndarray) -> PackedStep:
        """Write ``step``'s inputs one after another into ``staging`` (uint8, at least
        :attr:`staging_nbytes`), each at a 256-byte boundary; returns where they went."""
        arrays = self.step_arrays(step)
        offsets, shapes, offset = {}, {}, 0
        for name, a in arrays.items():
            staging[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
            offsets[name], shapes[name] = offset, a.shape
            offset += _aligned(a.nbytes)
        return PackedStep(shapes, offsets, offset, len(step.logits_indices))


def plan_buffers(limits: BuildLimits, cfg: ModelConfig) -> BufferPlan:
    """The buffers an engine built for ``limits`` needs (the maximum of its profile)."""
    shapes = profile_shapes(limits, cfg)
    inputs = {name: TensorSlot(name, INPUT_DTYPES[name], shapes[name][2])
              for name in STEP_INPUTS}
    return BufferPlan(inputs,
                      TensorSlot("kv_cache_ptrs", INPUT_DTYPES["kv_cache_ptrs"],
                                 shapes["kv_cache_ptrs"][2]),
                      TensorSlot("logits", LOGITS_DTYPE, logits_max_shape(limits, cfg)))


def unpack(packed: PackedStep, staging: np.ndarray, plan: BufferPlan) -> dict[str, np.ndarray]:
    """The arrays :meth:`BufferPlan.pack` wrote (what the engine will read); for tests and
    for checking a staging area."""
    return {name: staging[off:off + int(np.prod(packed.shapes[name]))
                          * plan.inputs[name].dtype.itemsize]
            .view(plan.inputs[name].dtype).reshape(packed.shapes[name])
            for name, off in packed.offsets.items()}
