"""Export the step model to ONNX: one ``kvflow::PagedAttention`` node per layer.

The graph's inputs and outputs are the engine I/O contract (docs/design.md). Dynamic dimensions:
``num_tokens`` (packed new tokens), ``num_seqs``, ``max_blocks`` (block-table width) and
``num_logits``. Weights go to one external data file beside the graph.

Two ways in: :func:`export_onnx` exports a model holding real weights (tests, benchmarks on
random weights); :func:`export_graph` exports a model built under ``FakeTensorMode``
(:func:`weightless_model`), whose parameters have shapes and dtypes but no storage, and returns
the graph with every weight as a placeholder (:data:`PLACEHOLDER` external data) for
:mod:`kvflow.build.stream` to fill from the checkpoint tensor by tensor.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from kvflow.model.config import ModelConfig
from kvflow.model.llama import LlamaForCausalLM
from kvflow.plugins.torch_op import ONNX_DOMAIN, ONNX_OP_TYPE, onnx_translation_table

INPUT_NAMES = [
    "input_ids", "positions", "kv_cache_ptrs", "slot_mapping", "block_tables", "seq_lens",
    "query_start_loc", "logits_indices",
]
OUTPUT_NAMES = ["logits"]
ONNX_OPSET = 18
# Where a weight not yet written points (export_graph): a file name no engine folder holds.
PLACEHOLDER = "kvflow-weight-not-yet-written"
_NOWHERE = "/nonexistent-kvflow-placeholder"
# Initializers the exporter's optimizer deduplicates by value (onnx_ir's
# DeduplicateInitializersPass size limit): export_graph gives them their values.
SMALL_ELEMENTS = 1024


def example_inputs(model: LlamaForCausalLM, block_size: int) -> tuple[torch.Tensor, ...]:
    """A small valid step (two sequences, one prefilling, one decoding) to trace with."""
    layers = model.config.num_hidden_layers
    seq_lens = torch.tensor([5, 3], dtype=torch.int32)
    q_lens = [3, 1]
    positions = torch.tensor([2, 3, 4, 2], dtype=torch.int64)
    return (
        torch.tensor([1, 2, 3, 4], dtype=torch.int64),  # input_ids
        positions,
        torch.zeros(layers, 2, dtype=torch.int64),  # kv_cache_ptrs (never dereferenced here)
        torch.tensor([2, 3, 4, block_size + 2], dtype=torch.int64),  # slot_mapping
        torch.tensor([[1, 0, 0], [2, 0, 0]], dtype=torch.int32),  # block_tables
        seq_lens,
        torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32),  # query_start_loc
        torch.tensor([2, 3], dtype=torch.int64),  # logits_indices
    )


def _dynamic_shapes() -> tuple:
    tokens = torch.export.Dim("num_tokens", min=1, max=1 << 20)
    seqs = torch.export.Dim("num_seqs", min=1, max=1 << 16)
    blocks = torch.export.Dim("max_blocks", min=1, max=1 << 20)
    logits = torch.export.Dim("num_logits", min=1, max=1 << 16)
    return (
        {0: tokens}, {0: tokens}, None, {0: tokens}, {0: seqs, 1: blocks}, {0: seqs},
        {0: torch.export.Dim("num_seqs_plus_one", min=2, max=(1 << 16) + 1)}, {0: logits},
    )


def _export(model: LlamaForCausalLM, inputs: tuple, optimize: bool) -> Any:
    # The exporter's own progress chatter would drown our progress bar.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model,
            inputs,
            dynamo=True,
            input_names=INPUT_NAMES,
            output_names=OUTPUT_NAMES,
            dynamic_shapes=_dynamic_shapes(),
            custom_translation_table=onnx_translation_table(),
            opset_version=ONNX_OPSET,
            verbose=False,
            optimize=optimize,
        )
    assert program is not None  # dynamo=True always returns an ONNXProgram
    return program


def _check_layers(graph: onnx.ModelProto, layers: int) -> None:
    count = sum(n.op_type == ONNX_OP_TYPE and n.domain == ONNX_DOMAIN for n in graph.graph.node)
    if count != layers:
        raise RuntimeError(f"export produced {count} {ONNX_DOMAIN}::{ONNX_OP_TYPE} nodes, "
                           f"expected {layers}")


def export_onnx(model: LlamaForCausalLM, block_size: int, out_path: Path) -> onnx.ModelProto:
    """Export ``model`` to ``out_path`` (+ ``.data`` external weights); returns the graph only."""
    program = _export(model, example_inputs(model, block_size), optimize=True)
    program.save(str(out_path), external_data=True)
    graph = onnx.load(str(out_path), load_external_data=False)
    _check_layers(graph, model.config.num_hidden_layers)
    return graph


def weightless_model(cfg: ModelConfig, block_size: int, max_positions: int,
                     dtype: str = "float32") -> tuple[LlamaForCausalLM, tuple]:
    """``LlamaForCausalLM`` in ``dtype`` and example inputs, all made under ``FakeTensorMode``:
    every parameter and buffer has a shape and a dtype, and no storage."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        net = LlamaForCausalLM(cfg, block_size, max_positions).eval()
        if dtype != "float32":
            # Module.to() cannot swap fake parameters in place: cast each one (ties survive,
            # since a tied parameter is one object, cast once).
            cast: dict[int, torch.nn.Parameter] = {}
            for module in net.modules():
                for name, p in module._parameters.items():
                    if p is not None:
                        if id(p) not in cast:
                            cast[id(p)] = torch.nn.Parameter(p.to(getattr(torch, dtype)),
                                                             requires_grad=False)
                        module._parameters[name] = cast[id(p)]
                for name, b in module._buffers.items():
                    if b is not None and b.is_floating_point():
                        module._buffers[name] = b.to(getattr(torch, dtype))
        inputs = example_inputs(net, block_size)
    return net, inputs


def is_weightless(model: torch.nn.Module) -> bool:
    """True when no parameter or buffer of ``model`` holds data (all are fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensor

    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(isinstance(t, FakeTensor) for t in tensors)


def export_graph(model: LlamaForCausalLM, inputs: tuple,
                 known_value: Callable[[str], np.ndarray]) -> onnx.ModelProto:
    """The engine graph of a weightless ``model`` (:func:`weightless_model`), in memory.

    Every parameter and buffer is an initializer whose data is a :data:`PLACEHOLDER` (external
    data at a location that does not exist, its ``length`` the byte size), except those of at
    most :data:`SMALL_ELEMENTS` elements (the norms) and the buffers (the RoPE tables, computed,
    not read), which ``known_value(name)`` supplies: the exporter's optimizer deduplicates
    equal small initializers and folds the tables' transposes, and must see the values it saw
    when the model held its weights, for the graph to be the same. It treats a
    placeholder as an unknown value (no constant folding through it): the graph then reads
    every large weight by its state-dict name, which lets the build stream each one from the
    checkpoint. A model that holds real weights is refused: that is the copy this path avoids.
    """
    import onnx_ir as ir

    if not is_weightless(model):
        raise ValueError("export_graph takes a model without weights (weightless_model); "
                         "use export_onnx for a model holding them")
    program = _export(model, inputs, optimize=False)
    buffers = {name for name, _ in model.named_buffers()}
    for name, value in program.model.graph.initializers.items():
        raw = getattr(value.const_value, "raw", None)
        if not isinstance(raw, torch.Tensor):
            continue
        assert value.dtype is not None and value.shape is not None
        size = int(np.prod(value.shape.numpy(), dtype=np.int64))
        if size <= SMALL_ELEMENTS or name in buffers:
            array = np.asarray(known_value(name), dtype=value.dtype.numpy())
            if array.shape != tuple(value.shape.numpy()):
                raise ValueError(f"{name}: checkpoint shape {list(array.shape)} does not match "
                                 f"the model's {list(value.shape.numpy())}")
            value.const_value = ir.Tensor(array, name=name)
        else:
            value.const_value = ir.ExternalTensor(PLACEHOLDER, 0, size * value.dtype.itemsize,
                                                  value.dtype, shape=value.shape, name=name,
                                                  base_dir=_NOWHERE)
    # The optimizer logs each placeholder as "external data not available": expected here.
    logging.getLogger("onnxscript").setLevel(logging.ERROR)
    program.optimize()
    graph = program.model_proto
    _check_layers(graph, model.config.num_hidden_layers)
    return graph


def is_placeholder(tensor: onnx.TensorProto) -> bool:
    """True for an initializer :func:`export_graph` left for the stream to fill."""
    return any(e.key == "location" and e.value == PLACEHOLDER for e in tensor.external_data)


def save_graph(model: onnx.ModelProto, out_path: Path) -> None:
    """Write ``model`` as an exported engine graph is laid out: ``out_path`` and its weights in
    one external file beside it (``<name>.data``, replaced if present)."""
    data = out_path.with_name(out_path.name + ".data")
    data.unlink(missing_ok=True)
    onnx.save_model(model, str(out_path), save_as_external_data=True,
                    all_tensors_to_one_file=True, location=data.name, size_threshold=1024)
