"""What an engine folder promises: ``engine_config.json``, read by every runner and the server.

Pure Python (no torch) so that the orchestrator and the simulator can read it too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvflow.model.config import ModelConfig

ENGINE_CONFIG_FILE = "engine_config.json"
BACKENDS = ("onnxruntime", "torch", "tensorrt")
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
# What each backend can execute on its device; the build refuses anything else.
BACKEND_DTYPES = {
    "onnxruntime": ("float32",),
    # float16 / bfloat16 torch engines are for the Triton runner on a GPU.
    "torch": ("float32", "float16", "bfloat16"),
    "tensorrt": ("float16", "bfloat16"),
}
# Where block-quantized weights run today (TensorRT reads the same graph form; its build does
# not take it yet).
QUANTIZED_BACKENDS = ("onnxruntime",)


class EngineConfigError(ValueError):
    """A build argument or engine config value is out of range; the message names it."""


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class BuildLimits:
    """The engine's static limits, fixed at build time (TensorRT profiles are sized from them)."""

    max_model_len: int
    max_num_tokens: int
    max_batch_size: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_tokens", "max_batch_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EngineConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value!r}")
        if not _is_pow2(self.block_size) or self.block_size > 256:
            raise EngineConfigError(
                f"--block-size must be a power of two in [1, 256], got {self.block_size}"
            )
        if self.max_num_tokens < self.block_size:
            raise EngineConfigError(
                f"--max-num-tokens ({self.max_num_tokens}) must be >= --block-size "
                f"({self.block_size})"
            )


def checkpoint_source(path: str | Path) -> dict[str, str]:
    """What an engine records of its checkpoint: its name and the SHA-256 of its contents (a
    file's bytes; for a folder, each file's name and bytes in name order). No absolute path:
    an engine folder says the same on every machine."""
    path = Path(path)
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        if f is not path:
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return {"name": path.name, "sha256": h.hexdigest()}


@dataclass(frozen=True)
class EngineConfig:
    """Everything a server needs to know about an engine folder besides its files."""

    model: ModelConfig
    backend: str
    dtype: str
    limits: BuildLimits
    # The checkpoint it was built from, portably: {"name": file or folder name, "sha256"}.
    source: dict[str, str]
    files: dict[str, str]
    kvflow_version: str = "0.1.0"
    # Block-quantized weights, if any: the schemes kept (``Q4_1+Q8_0`` from a GGUF, ``int4-g32``
    # by --quantize); None for weights in ``dtype``. Activations are ``dtype``; the KV cache is
    # the runner's (EngineOptions.kv_cache_dtype; kvflow.runtime.base.kv_bytes_per_block).
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.quantization and self.backend not in QUANTIZED_BACKENDS:
            raise EngineConfigError(f"quantized weights ({self.quantization}) need --backend "
                                    f"in {QUANTIZED_BACKENDS}, got {self.backend!r}")
        if self.backend not in BACKENDS:
            raise EngineConfigError(f"--backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.dtype not in BACKEND_DTYPES[self.backend]:
            raise EngineConfigError(
                f"--dtype {self.dtype!r} is not supported by --backend {self.backend} "
                f"(supported: {BACKEND_DTYPES[self.backend]})"
            )

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kvflow_version": self.kvflow_version,
            "backend": self.backend,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "limits": asdict(self.limits),
            "source": self.source,
            "files": dict(self.files),
            "model": self.model.to_dict(),
        }

    def save(self, folder: Path) -> None:
        (folder / ENGINE_CONFIG_FILE).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> EngineConfig:
        path = Path(folder) / ENGINE_CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{folder} is not an engine folder ({ENGINE_CONFIG_FILE} is missing); "
                "build one with `kvflow build-engine`"
            )
        d = json.loads(path.read_text())
        return cls(
            model=ModelConfig.from_dict(d["model"]),
            backend=d["backend"],
            dtype=d["dtype"],
            limits=BuildLimits(**d["limits"]),
            source=d["source"] if isinstance(d.get("source"), dict) else {},
            files=d.get("files", {}),
            kvflow_version=d.get("kvflow_version", "0.1.0"),
            quantization=d.get("quantization"),
        )
