"""Step-time cost models for the simulator: a fixed time, a roofline, and a calibrated fit.

A model maps the shape of one engine step (how many tokens, over which contexts) to seconds.
Pure Python: the simulator must not need any runtime.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.runtime.base import KV_CACHE_DTYPE_BYTES, StepInput, check_kv_cache_dtype


@dataclass(frozen=True)
class StepShape:
    """What a step costs depends on: new tokens per sequence and each sequence's length."""

    new_tokens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_logits: int

    @classmethod
    def of(cls, step: StepInput) -> StepShape:
        qsl = step.query_start_loc.tolist()  # NOTE: every simulated step: lists, not numpy
        return cls(tuple([b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)]),
                   tuple(step.seq_lens.tolist()), int(step.logits_indices.shape[0]))

    @property
    def num_tokens(self) -> int:
        return sum(self.new_tokens)

    @property
    def num_seqs(self) -> int:
        return len(self.new_tokens)

    @property
    def num_first_chunks(self) -> int:
        """Sequences whose chunk starts at position 0 (requests starting this step)."""
        return sum(1 for n, length in zip(self.new_tokens, self.seq_lens, strict=True)
                   if n == length)

    @property
    def context_tokens(self) -> int:
        """KV positions the step's attention reads, summed over sequences."""
        return sum(self.seq_lens)

    @property
    def attention_pairs(self) -> float:
        """(query, key) pairs of causal attention: a new token at position p sees p + 1."""
        return sum(n * (length - n) + n * (n + 1) / 2
                   for n, length in zip(self.new_tokens, self.seq_lens, strict=True))


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
    memory_bytes: float = 80e9

    def __post_init__(self) -> None:
        for name in ("peak_flops", "mem_bandwidth_bytes_s", "memory_bytes"):
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
    # The KV cache's element bytes (kv_cache_dtype; None: dtype_bytes, the weights').
    kv_dtype_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.kv_dtype_bytes is not None and self.kv_dtype_bytes < 1:
            raise ValueError(f"kv_dtype_bytes must be >= 1 (or none), got {self.kv_dtype_bytes}")
        if self.num_kv_heads % self.tp and self.tp % self.num_kv_heads:
            raise ValueError(f"tp={self.tp} does not divide num_kv_heads={self.num_kv_heads} "
                             "(nor the reverse)")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers (all devices together), in the KV dtype."""
        kv_bytes = self.kv_dtype_bytes or self.dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_bytes

    def kv_blocks_for(self, hw: HardwareSpec, block_size: int,
                      memory_utilization: float = 0.9) -> int:
        """KV blocks that fit on ``tp`` devices after the weights, using
        ``memory_utilization`` of each device's memory (as vLLM's gpu_memory_utilization)."""
        if not 0 < memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
        free = self.tp * hw.memory_bytes * memory_utilization - self.num_params * self.dtype_bytes
        blocks = int(free // (block_size * self.kv_bytes_per_token))
        if blocks < 2:
            raise ValueError(f"{self.name} (tp={self.tp}) does not fit on {hw.name}: "
                             f"{self.num_params * self.dtype_bytes / 1e9:.0f} GB of weights, "
                             f"{self.tp * hw.memory_bytes * memory_utilization / 1e9:.0f} GB "
                             "usable; raise --tp")
        return blocks


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
        return linear + per_pair * shape.attention_pairs

    def memory_bytes(self, shape: StepShape) -> float:
        m = self.model
        weights = m.num_params * m.dtype_bytes
        kv_read = shape.context_tokens * m.kv_bytes_per_token
        kv_write = shape.num_tokens * m.kv_bytes_per_token
        return weights + kv_read + kv_write

    def step_time_s(self, shape: StepShape) -> float:
        hw, tp = self.hw, self.model.tp
        compute = self.compute_flops(shape) / (tp * hw.peak_flops * hw.flops_efficiency)
        memory = self.memory_bytes(shape) / (tp * hw.mem_bandwidth_bytes_s * hw.mem_efficiency)
        return max(compute, memory) + hw.step_overhead_s


HARDWARE = {
    "H100": HardwareSpec("H100 SXM", 989e12, 3.35e12, step_overhead_s=4e-3, memory_bytes=80e9),
    "H200": HardwareSpec("H200", 989e12, 4.8e12, step_overhead_s=4e-3, memory_bytes=141e9),
    "A100": HardwareSpec("A100 80GB", 312e12, 2.0e12, step_overhead_s=5e-3, memory_bytes=80e9),
    "L40S": HardwareSpec("L40S", 362e12, 0.864e12, step_overhead_s=5e-3, memory_bytes=48e9),
    # This 2-core CPU in fp32, roughly: about 50 GFLOP/s achieved, about 20 GB/s.
    "CPU": HardwareSpec("this CPU (fp32)", 100e9, 25e9, 0.5, 0.8, step_overhead_s=5e-3,
                        memory_bytes=24 * 2**30),
}

MODELS = {
    "llama-3-8b": ModelSpec("Llama-3-8B", 8.03e9, 32, 4096, 32, 8, 128, 128256),
    "llama-3-70b": ModelSpec("Llama-3-70B", 70.6e9, 80, 8192, 64, 8, 128, 128256),
    "qwen2-7b": ModelSpec("Qwen2-7B", 7.62e9, 28, 3584, 28, 4, 128, 152064),
    "smollm2-135m": ModelSpec("SmolLM2-135M", 134.5e6, 30, 576, 9, 3, 64, 49152,
                              dtype_bytes=4),
}


def model_spec(name: str, tp: int = 1, kv_cache_dtype: str = "auto") -> ModelSpec:
    """:data:`MODELS` ``name`` on ``tp`` devices with its KV cache in ``kv_cache_dtype`` (an
    ``EngineOptions.kv_cache_dtype`` choice; auto: the model's own dtype)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    kv_bytes = None if kv_cache_dtype == "auto" else KV_CACHE_DTYPE_BYTES[kv_cache_dtype]
    return replace(MODELS[name], tp=tp, kv_dtype_bytes=kv_bytes)


ENGINE_FEATURES = ("step", "tokens", "seqs", "attention_pairs", "context_tokens")
LINEAR_FEATURES = (*ENGINE_FEATURES, "first_chunks")


def linear_features(shape: StepShape) -> tuple[float, ...]:
    """The terms a measured step time is fitted on, in :data:`LINEAR_FEATURES` order: a fixed
    cost per step, per new token (the linear layers), per sequence (its logits row, sampling
    and bookkeeping), per causal attention pair, per context token read; and per request
    starting in this step (its first chunk), which only serving makes costly (accepting the
    request, tokenizing, opening its response stream)."""
    return (1.0, float(shape.num_tokens), float(shape.num_seqs), shape.attention_pairs,
            float(shape.context_tokens), float(shape.num_first_chunks))


@dataclass(frozen=True)
class LinearCostModel(CostModel):
    """Step time as a non-negative linear combination of :func:`linear_features`, fitted to a
    real engine's measured steps by ``kvflow simulate calibrate``. ``meta`` records where it
    came from (engine, runner, grid, fit error)."""

    coefficients: dict[str, float]
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        missing = set(LINEAR_FEATURES) - set(self.coefficients)
        if missing:
            raise ValueError(f"coefficients lack {sorted(missing)}")
        negative = [k for k, v in self.coefficients.items() if v < 0]
        if negative:
            raise ValueError(f"coefficients must be >= 0, negative: {negative}")
        object.__setattr__(self, "_coef", tuple(self.coefficients[k] for k in LINEAR_FEATURES))

    def step_time_s(self, shape: StepShape) -> float:
        coef: tuple[float, ...] = self._coef  # type: ignore[attr-defined]
        return sum(c * x for c, x in zip(coef, linear_features(shape), strict=True))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"kind": "linear", "coefficients": self.coefficients,
                                          "meta": self.meta}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> LinearCostModel:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"cost model {path} not found; make one with `kvflow "
                                    "simulate calibrate --engine DIR`") from None
        if data.get("kind") != "linear":
            raise ValueError(f"{path}: not a calibrated cost model (kind {data.get('kind')!r})")
        return cls(dict(data["coefficients"]), data.get("meta", {}))


def fit_nonnegative(rows: list[tuple[float, ...]], times_s: list[float],
                    relative: bool = True) -> list[float]:
    """Least squares with every coefficient >= 0 (features with a negative solution are
    dropped and the rest refitted, until none is negative). ``relative`` weighs each row by
    1/time, so that short decode steps count as much as long prefills."""
    x = np.asarray(rows, dtype=np.float64)
    y = np.asarray(times_s, dtype=np.float64)
    if x.ndim != 2 or len(x) != len(y) or len(y) < x.shape[1]:
        raise ValueError(f"need at least {x.shape[-1]} measured rows, got {len(y)}")
    w = 1.0 / y if relative else np.ones_like(y)
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq((x[:, active] / scale[active]) * w[:, None], y * w,
                                  rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol / scale[active]
            break
        active = [a for a, v in zip(active, sol, strict=True) if v >= 0]
    return coef.tolist()
