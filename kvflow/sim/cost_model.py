"""Step-time cost models for the simulator: a fixed time, and a roofline.

A model maps the shape of one engine step (how many tokens, over which contexts) to seconds.
Pure Python: the simulator must not need any runtime.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from kvflow.runtime.base import StepInput


@dataclass(frozen=True)
class StepShape:
    """What a step costs depends on: new tokens per sequence and each sequence's length."""

    new_tokens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_logits: int

    @classmethod
    def of(cls, step: StepInput) -> StepShape:
        qsl = step.query_start_loc.astype(np.int64)
        return cls(tuple(int(x) for x in qsl[1:] - qsl[:-1]),
                   tuple(int(x) for x in step.seq_lens), int(step.logits_indices.shape[0]))

    @property
    def num_tokens(self) -> int:
        return sum(self.new_tokens)


class CostModel(ABC):
    """Seconds one step takes."""

    @abstractmethod
    def step_time_s(self, shape: StepShape) -> float: ...


@dataclass(frozen=True)
class FixedCostModel(CostModel):
    """Every step takes ``step_s`` seconds, whatever it holds (for hand-checkable tests)."""

    step_s: float

    def step_time_s(self, shape: StepShape) -> float:
        return self.step_s


@dataclass(frozen=True)
class HardwareSpec:
    """A device: peak dense FLOP/s at the model's dtype, memory bandwidth, and how much of each
    a real step achieves."""

    name: str
    peak_flops: float
    mem_bandwidth_bytes_s: float
    flops_efficiency: float = 0.6
    mem_efficiency: float = 0.8
    step_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("peak_flops", "mem_bandwidth_bytes_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("flops_efficiency", "mem_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder's size as the roofline sees it (``tp``: tensor-parallel degree)."""

    name: str
    num_params: float
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int = 2
    tp: int = 1

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


class RooflineCostModel(CostModel):
    """Step time = max(compute time, memory time) + a fixed overhead.

    Compute: ``2 * num_params`` FLOPs per new token (the linear layers, lm_head included, as a
    dense forward pass), plus attention's ``4 * layers * heads * head_dim`` FLOPs per (new
    token, context token) pair. Memory: all weights once per step, the KV of every context
    read, the new tokens' KV written. Both are split over ``tp`` devices.
    """

    def __init__(self, hardware: HardwareSpec, model: ModelSpec) -> None:
        self.hw, self.model = hardware, model

    def compute_flops(self, shape: StepShape) -> float:
        m = self.model
        linear = 2.0 * m.num_params * shape.num_tokens
        per_pair = 4.0 * m.num_layers * m.num_heads * m.head_dim
        # A new token at position p attends to p + 1 context tokens.
        pairs = sum(n * (length - n) + n * (n + 1) / 2
                    for n, length in zip(shape.new_tokens, shape.seq_lens, strict=True))
        return linear + per_pair * pairs

    def memory_bytes(self, shape: StepShape) -> float:
        m = self.model
        weights = m.num_params * m.dtype_bytes
        kv_read = sum(shape.seq_lens) * m.kv_bytes_per_token
        kv_write = shape.num_tokens * m.kv_bytes_per_token
        return weights + kv_read + kv_write

    def step_time_s(self, shape: StepShape) -> float:
        hw, tp = self.hw, self.model.tp
        compute = self.compute_flops(shape) / (tp * hw.peak_flops * hw.flops_efficiency)
        memory = self.memory_bytes(shape) / (tp * hw.mem_bandwidth_bytes_s * hw.mem_efficiency)
        return max(compute, memory) + hw.step_overhead_s


HARDWARE = {
    "H100": HardwareSpec("H100 SXM", 989e12, 3.35e12, step_overhead_s=4e-3),
    "H200": HardwareSpec("H200", 989e12, 4.8e12, step_overhead_s=4e-3),
    "A100": HardwareSpec("A100 80GB", 312e12, 2.0e12, step_overhead_s=5e-3),
    "L40S": HardwareSpec("L40S", 362e12, 0.864e12, step_overhead_s=5e-3),
    # This 2-core CPU in fp32, roughly: about 50 GFLOP/s achieved, about 20 GB/s.
    "CPU": HardwareSpec("this CPU (fp32)", 100e9, 25e9, 0.5, 0.8, step_overhead_s=5e-3),
}

MODELS = {
    "llama-3-8b": ModelSpec("Llama-3-8B", 8.03e9, 32, 4096, 32, 8, 128, 128256),
    "llama-3-70b": ModelSpec("Llama-3-70B", 70.6e9, 80, 8192, 64, 8, 128, 128256),
    "qwen2-7b": ModelSpec("Qwen2-7B", 7.62e9, 28, 3584, 28, 4, 128, 152064),
    "smollm2-135m": ModelSpec("SmolLM2-135M", 134.5e6, 30, 576, 9, 3, 64, 49152,
                              dtype_bytes=4),
}
