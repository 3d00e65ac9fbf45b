"""The engine's ONNX graph and weights, made without ever holding the model.

1. :func:`weight_plan`: which weights become block-quantized, and how (the GGUF's own blocks,
   or ``--quantize int4|int8``), from the checkpoint's metadata alone.
2. :func:`~kvflow.build.export.export_graph` of a model built under ``FakeTensorMode``: the
   graph, every weight a placeholder.
3. :func:`~kvflow.build.quantize.quantize_graph` with the plan's specs: the rewrite, structure
   only.
4. :func:`~kvflow.build.stream.write_weights`: each placeholder filled from the checkpoint, one
   tensor at a time, into ``model.onnx.data``; then ``model.onnx`` (the graph, a few MB).

The result equals, node for node and byte for byte in every initializer, what exporting a
model holding the checkpoint's weights gives (tests/test_build_stream.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from kvflow.build.quantize import QuantizeReport, QuantSpec, quantize_graph
from kvflow.build.stream import ProgressFn, WeightPlan, cast_array, write_weights
from kvflow.model.checkpoint_tensors import CheckpointTensors

LINEAR_PARTS = (".self_attn.", ".mlp.")


def rtn_names(source: CheckpointTensors) -> list[str]:
    """The checkpoint weights ``--quantize`` rounds: every linear layer's, and the LM head's
    (the embedding table when tied)."""
    names = [k for k in source.names()
             if len(source.shape(k)) == 2 and k.endswith(".weight")
             and any(p in k for p in LINEAR_PARTS)]
    names.append("model.embed_tokens.weight" if source.config.tie_word_embeddings
                 else "lm_head.weight")
    return names


def weight_plan(source: CheckpointTensors, dtype: str, quantize: str | None, group_size: int,
                keep_gguf_quantization: bool) -> WeightPlan:
    """Where each graph weight comes from, and which are block-quantized (graph names: a tied
    table is quantized as ``lm_head.weight``, the name the exporter gives it)."""
    tied = source.config.tie_word_embeddings
    specs: dict[str, QuantSpec] = {}
    if quantize:
        for name in rtn_names(source):
            specs[name] = QuantSpec.of(quantize, source.shape(name), group_size)  # type: ignore[arg-type]
    elif keep_gguf_quantization:
        for name in source.names():
            scheme = source.gguf_scheme(name)
            if scheme is not None:
                specs[name] = QuantSpec.of(scheme, source.shape(name))  # type: ignore[arg-type]
    if tied and "model.embed_tokens.weight" in specs:
        # The exporter names the tied matrix lm_head.weight; its Gather keeps the fp32 copy.
        specs["lm_head.weight"] = specs.pop("model.embed_tokens.weight")
    return WeightPlan(dtype, specs, group_size, tied)


def quantization_name(plan: WeightPlan, quantize: str | None, group_size: int) -> str | None:
    """The engine config's ``quantization``: ``int4-g32``, ``Q4_1+Q8_0``, or None."""
    if not plan.quantized:
        return None
    if quantize:
        return f"{quantize}-g{group_size}"
    return "+".join(sorted({s.scheme for s in plan.quantized.values()}))


def write_streamed_graph(source: CheckpointTensors, plan: WeightPlan, block_size: int,
                         max_positions: int, out: Path,
                         progress: ProgressFn) -> QuantizeReport | None:
    """``out/model.onnx`` and ``out/model.onnx.data`` of ``source``, streamed (module doc);
    returns what the quantization rewrite did (None when nothing is quantized)."""
    from kvflow.build.export import export_graph, weightless_model
    from kvflow.model.llama import computed_buffers

    cfg = source.config
    net, inputs = weightless_model(cfg, block_size, max_positions, plan.dtype)
    buffers: dict[str, np.ndarray] = {}

    def known_value(name: str) -> np.ndarray:
        if not buffers:
            buffers.update({k: v.numpy() for k, v in computed_buffers(cfg, max_positions).items()})
        if name in buffers:  # RoPE tables, Gemma's embedding multiplier: from the config
            return cast_array(buffers[name], plan.dtype)
        return cast_array(source.fp32(plan.source_name(name)), plan.dtype)

    progress(f"      graph exported from a model without weights ({len(list(net.parameters()))} "
             "parameters, none materialised)")
    graph = export_graph(net, inputs, known_value)
    del net, inputs
    report = None
    if plan.quantized:
        report = quantize_graph(graph, plan.quantized)
        schemes = ", ".join(f"{n} {s}" for s, n in report.schemes.most_common())
        progress(f"      quantized weights: {schemes} layers, {report.fp32_bytes / 1e6:.0f} MB "
                 f"-> {report.quantized_bytes / 1e6:.0f} MB")
    total = write_weights(graph, source, plan, out / "model.onnx.data", progress)
    onnx.save_model(graph, str(out / "model.onnx"))
    progress(f"      model.onnx.data: {total / 1e6:.0f} MB, each tensor aligned to 4096 bytes")
    return report
