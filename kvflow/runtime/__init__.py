"""Runners behind one interface; :func:`create_runner` picks one by name."""

from __future__ import annotations

from pathlib import Path

from kvflow.build.engine_config import EngineConfig
from kvflow.runtime.base import (
    KV_CACHE_DTYPES,
    QUANTIZED_MATMUL_MODES,
    RUNNERS,
    ModelRunner,
    StepInput,
    resolve_kv_cache_dtype,
)

__all__ = ["KV_CACHE_DTYPES", "QUANTIZED_MATMUL_MODES", "RUNNERS", "ModelRunner", "StepInput",
           "create_runner"]


def create_runner(name: str | None, engine_dir: str | Path, num_blocks: int,
                  num_host_blocks: int = 0, cuda_graphs: bool | None = None,
                  quantized_matmul: str = "fp32", kv_cache_dtype: str = "auto",
                  max_loras: int = 0, max_lora_rank: int = 16) -> ModelRunner:
    """The runner ``name`` (default: the engine's backend) over a pool of ``num_blocks`` blocks
    and a host swap pool of ``num_host_blocks``. ``cuda_graphs``: the triton runner's decode
    graphs (default: on a CUDA GPU); the other runners have none. ``quantized_matmul``: how the
    onnxruntime runner multiplies by quantized weights (``auto``, ``int8`` or ``fp32``).
    ``kv_cache_dtype``: the KV pool's element type (one of :data:`KV_CACHE_DTYPES`; auto as
    :func:`~kvflow.runtime.base.resolve_kv_cache_dtype` says); a runner that cannot hold it
    refuses it here. ``max_loras`` > 0: a LoRA slot pool of that many adapters of rank up to
    ``max_lora_rank`` (:meth:`ModelRunner.load_lora`; the onnxruntime runner's graph gets its
    LoRA nodes at load, so the pool is sized here); a runner without LoRA refuses it."""
    if max_loras < 0 or (max_loras and max_lora_rank < 1):
        raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1, got {max_loras} and "
                         f"{max_lora_rank}")
    engine = EngineConfig.load(engine_dir)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, engine, name)
    name = name or engine.backend
    if name == "onnxruntime":
        from kvflow.runtime.ort_runner import OnnxRuntimeRunner

        return OnnxRuntimeRunner(engine_dir, engine, num_blocks, num_host_blocks,
                                 quantized_matmul=quantized_matmul, kv_cache_dtype=kv_dtype,
                                 max_loras=max_loras, max_lora_rank=max_lora_rank)
    if name == "torch":
        from kvflow.runtime.torch_runner import TorchRunner

        return TorchRunner(engine_dir, engine, num_blocks, num_host_blocks,
                           kv_cache_dtype=kv_dtype, max_loras=max_loras,
                           max_lora_rank=max_lora_rank)
    if name == "triton":
        from kvflow.runtime.triton_runner import TritonRunner

        return TritonRunner(engine_dir, engine, num_blocks, num_host_blocks,
                            cuda_graphs=cuda_graphs, kv_cache_dtype=kv_dtype,
                            max_loras=max_loras, max_lora_rank=max_lora_rank)
    if name == "tensorrt":
        if max_loras:
            raise ValueError("the tensorrt runner does not serve LoRA adapters (max_loras > 0); "
                             "use the onnxruntime, torch or triton runner")
        from kvflow.build.builder import tensorrt_available

        reason = tensorrt_available()
        if reason:
            raise RuntimeError(f"the TensorRT runner cannot run here: {reason}")
        from kvflow.runtime.tensorrt_runner import TensorRTRunner

        return TensorRTRunner(engine_dir, engine, num_blocks, num_host_blocks,
                              kv_cache_dtype=kv_dtype)
    raise ValueError(f"runner must be one of {RUNNERS}, got {name!r}")
