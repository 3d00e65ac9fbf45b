"""Export the step model to ONNX: one ``kvflow::PagedAttention`` node per layer.

The graph's inputs and outputs are the engine I/O contract (docs/design.md). Dynamic dimensions:
``num_tokens`` (packed new tokens), ``num_seqs``, ``max_blocks`` (block-table width) and
``num_logits``. Weights go to one external data file beside the graph.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import onnx
import torch

from kvflow.model.llama import LlamaForCausalLM
from kvflow.plugins.torch_op import ONNX_DOMAIN, ONNX_OP_TYPE, onnx_translation_table

INPUT_NAMES = [
    "input_ids", "positions", "kv_cache_ptrs", "slot_mapping", "block_tables", "seq_lens",
    "query_start_loc", "logits_indices",
]
OUTPUT_NAMES = ["logits"]
ONNX_OPSET = 18


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


def export_onnx(model: LlamaForCausalLM, block_size: int, out_path: Path) -> onnx.ModelProto:
    """Export ``model`` to ``out_path`` (+ ``.data`` external weights); returns the graph only."""
    tokens = torch.export.Dim("num_tokens", min=1, max=1 << 20)
    seqs = torch.export.Dim("num_seqs", min=1, max=1 << 16)
    blocks = torch.export.Dim("max_blocks", min=1, max=1 << 20)
    logits = torch.export.Dim("num_logits", min=1, max=1 << 16)
    dynamic_shapes = (
        {0: tokens}, {0: tokens}, None, {0: tokens}, {0: seqs, 1: blocks}, {0: seqs},
        {0: torch.export.Dim("num_seqs_plus_one", min=2, max=(1 << 16) + 1)}, {0: logits},
    )
    # The exporter's own progress chatter would drown our progress bar.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model,
            example_inputs(model, block_size),
            dynamo=True,
            input_names=INPUT_NAMES,
            output_names=OUTPUT_NAMES,
            dynamic_shapes=dynamic_shapes,
            custom_translation_table=onnx_translation_table(),
            opset_version=ONNX_OPSET,
            verbose=False,
            optimize=True,
        )
    assert program is not None  # dynamo=True always returns an ONNXProgram
    program.save(str(out_path), external_data=True)
    graph = onnx.load(str(out_path), load_external_data=False)
    count = sum(n.op_type == ONNX_OP_TYPE and n.domain == ONNX_DOMAIN for n in graph.graph.node)
    if count != model.config.num_hidden_layers:
        raise RuntimeError(
            f"export produced {count} {ONNX_DOMAIN}::{ONNX_OP_TYPE} nodes, expected "
            f"{model.config.num_hidden_layers}"
        )
    return graph


def save_graph(model: onnx.ModelProto, out_path: Path) -> None:
    """Write ``model`` as an exported engine graph is laid out: ``out_path`` and its weights in
    one external file beside it (``<name>.data``, replaced if present)."""
    data = out_path.with_name(out_path.name + ".data")
    data.unlink(missing_ok=True)
    onnx.save_model(model, str(out_path), save_as_external_data=True,
                    all_tensors_to_one_file=True, location=data.name, size_threshold=1024)
