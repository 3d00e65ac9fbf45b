"""The references ``kvflow check-engine`` compares an engine with.

- ``torch``: the PyTorch step model (:class:`~kvflow.runtime.torch_runner.TorchRunner`) in
  fp32 on the CPU, with the weights of the checkpoint the engine was built from (checked
  against the SHA-256 the engine folder records), quantized as the engine's were: it checks
  the engine's weights and its arithmetic.
- ``onnxruntime``: the engine's own ``model.onnx`` on ONNX Runtime with exact arithmetic (fp32
  multiplies, fp32 KV); a fp16 or bf16 graph (a TensorRT engine's) is first cast up to fp32
  (:func:`upcast_to_fp32`). It checks the arithmetic that ran the graph (TensorRT's kernels and
  plugin, or the onnxruntime runner's fused and quantized paths), not the weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvflow.build.engine_config import EngineConfig, checkpoint_source

if TYPE_CHECKING:
    import onnx

    from kvflow.model.llama import LlamaForCausalLM
    from kvflow.runtime.base import ModelRunner

REFERENCES = ("torch", "onnxruntime")


def checkpoint_for(engine: EngineConfig, model: str | None) -> str:
    """``--model``, else the packaged default model when the engine was built from it."""
    from kvflow.model.loader import DEFAULT_MODEL_FILE

    if model:
        return model
    if engine.source.get("name") == DEFAULT_MODEL_FILE:
        return "default"
    raise ValueError(f"--model: the engine was built from {engine.source.get('name')!r}; name "
                     "that checkpoint (a HF folder or GGUF file) with --model for the torch "
                     "reference, or use --reference onnxruntime")


def checkpoint_model(engine: EngineConfig, model: str) -> LlamaForCausalLM:
    """The fp32 step model of ``model``, which must be the engine's own checkpoint, with its
    weights quantized as the engine's were (``--quantize``; a GGUF's quantized blocks are
    already exact in the fp32 weights)."""
    import torch

    from kvflow.model.llama import LlamaForCausalLM
    from kvflow.model.loader import load_checkpoint, resolve_model

    path = resolve_model(model)
    source = checkpoint_source(path)
    if source["sha256"] != engine.source.get("sha256"):
        raise ValueError(f"--model {model}: not the checkpoint this engine was built from "
                         f"({engine.source.get('name')}, SHA-256 "
                         f"{str(engine.source.get('sha256'))[:12]}...; this one is "
                         f"{source['sha256'][:12]}...)")
    ckpt = load_checkpoint(model)
    state = ckpt.state_dict
    scheme = engine.quantization or ""
    if scheme.startswith(("int4-g", "int8-g")):  # round to nearest, as build-engine did
        from kvflow.build.builder import _quantized_weights
        from kvflow.model.quant import dequantize

        name, group = scheme.split("-g")
        state = dict(state)
        for key, w in _quantized_weights(ckpt, name, int(group)).items():
            state[key] = torch.from_numpy(dequantize(w).astype(np.float32))
    net = LlamaForCausalLM(ckpt.config, engine.limits.block_size, engine.limits.max_model_len)
    net.load_hf_state_dict(state)
    return net.eval()


def upcast_to_fp32(model: onnx.ModelProto) -> int:
    """Cast a fp16/bf16 graph up to fp32 in place: weights, constants, casts and declared
    types. Returns how many tensors and nodes changed. The graph then computes what it did,
    in fp32 (its weights keep the half-precision values they were rounded to)."""
    import onnx
    from onnx import numpy_helper

    half = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    changed = 0

    def upcast_tensor(t: onnx.TensorProto) -> None:
        nonlocal changed
        if t.data_type in half:
            t.CopyFrom(numpy_helper.from_array(
                numpy_helper.to_array(t).astype(np.float32), t.name))
            changed += 1

    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        for t in graph.initializer:
            upcast_tensor(t)
        for node in graph.node:
            for attr in node.attribute:
                if node.op_type == "Cast" and attr.name == "to" and attr.i in half:
                    attr.i = onnx.TensorProto.FLOAT
                    changed += 1
                elif attr.type == onnx.AttributeProto.TENSOR:
                    upcast_tensor(attr.t)
                elif attr.type == onnx.AttributeProto.GRAPH:
                    graphs.append(attr.g)
        for vi in (*graph.input, *graph.output, *graph.value_info):
            if vi.type.tensor_type.elem_type in half:
                vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
                changed += 1
    return changed


def fp32_engine(engine_dir: Path, engine: EngineConfig, out: Path) -> Path:
    """An onnxruntime engine folder at ``out`` holding ``engine_dir``'s graph cast up to fp32
    (:func:`upcast_to_fp32`)."""
    import onnx

    from kvflow.build.export import save_graph

    model = onnx.load(str(engine_dir / engine.files.get("onnx", "model.onnx")))
    upcast_to_fp32(model)
    out.mkdir(parents=True, exist_ok=True)
    save_graph(model, out / "model.onnx")
    dataclasses.replace(engine, backend="onnxruntime", dtype="float32",
                        files={"onnx": "model.onnx", "onnx_data": "model.onnx.data"}).save(out)
    return out


def reference_runner(kind: str, engine_dir: Path, engine: EngineConfig, num_blocks: int,
                     model: str | None, scratch: Path) -> ModelRunner:
    """The ``kind`` reference (see the module doc) over a pool of ``num_blocks``; ``scratch``:
    a folder for a cast-up graph."""
    if kind == "torch":
        from kvflow.runtime.torch_runner import TorchRunner

        net = checkpoint_model(engine, checkpoint_for(engine, model))
        return TorchRunner(engine_dir, engine, num_blocks, kv_cache_dtype="fp32", model=net)
    if kind == "onnxruntime":
        from kvflow.runtime.ort_runner import OnnxRuntimeRunner

        if engine.dtype != "float32":
            engine_dir = fp32_engine(engine_dir, engine, scratch / "fp32-reference")
            engine = EngineConfig.load(engine_dir)
        return OnnxRuntimeRunner(engine_dir, engine, num_blocks, quantized_matmul="fp32",
                                 kv_cache_dtype="fp32")
    raise ValueError(f"--reference must be one of {REFERENCES}, got {kind!r}")
