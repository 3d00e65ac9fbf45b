"""The ONNX Runtime runner: the engine's ONNX graph on ORT's CPU provider.

ORT executes every node of the graph except ``kvflow::PagedAttention``, which kvflow executes
on the host with its compiled kernel (:mod:`kvflow.plugins.paged_attention_native`). At load
time the graph is cut at its PagedAttention nodes into ``num_layers + 1`` segments; a step runs
segment, attention, segment, ... with the tensors crossing a cut kept on the host. (ORT's Python
package ships no C headers to compile a native custom-op library against; the cut keeps the one
graph as the single artifact.) Quantized engines' blocked ``DequantizeLinear`` + ``MatMul``
pairs become ORT's ``MatMulNBits`` at load time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from kvflow.build.engine_config import EngineConfig
from kvflow.plugins.paged_attention_native import paged_attention_native
from kvflow.plugins.torch_op import ONNX_DOMAIN, ONNX_OP_TYPE
from kvflow.runtime.base import (
    QUANTIZED_MATMUL_MODES,
    PoolRunner,
    StepInput,
    kv_cache_numpy_dtype,
)
from kvflow.runtime.kv_cache import HostKVPool

ONNX_FILE = "model.onnx"
ARGMAX_OUTPUT = "kvflow_argmax"
# quantized_matmul=auto: the most tokens a step may have to run on MatMulNBits. Measured with
# benchmarks/cpu_step.py on this AVX2 CPU: 4-bit decode steps win up to 16 sequences (24 vs 58 ms
# at 1, 123 vs 150 at 16) and lose at 32 (210 vs 156).
AUTO_INT8_MAX_TOKENS = 16
INT8_ACCURACY_LEVEL = 4  # MatMulNBits: int8 activations (ORT's levels 0-1 are fp32, but slow)


@dataclass
class _Segment:
    session: ort.InferenceSession | None
    input_names: list[str]
    output_names: list[str]
    attention: onnx.NodeProto | None  # the PagedAttention node that follows this segment
    attention_attrs: dict


_Piece = tuple[list[onnx.NodeProto], onnx.NodeProto | None]


def _split_at_attention(model: onnx.ModelProto) -> list[_Piece]:
    pieces: list[_Piece] = []
    current: list[onnx.NodeProto] = []
    for node in model.graph.node:
        if node.op_type == ONNX_OP_TYPE and node.domain == ONNX_DOMAIN:
            pieces.append((current, node))
            current = []
        else:
            current.append(node)
    pieces.append((current, None))
    return pieces


def build_segments(model: onnx.ModelProto, threads: int | None = None,
                   int8_activations: bool = False) -> list[_Segment]:
    """Cut ``model`` at its PagedAttention nodes into ORT sessions (see module doc)."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    value_info = {v.name: v for v in (*graph.input, *graph.value_info, *graph.output)}
    pieces = _split_at_attention(model)
    # Which tensors does anything at or after piece i consume? (graph outputs count as consumed)
    consumed_after: list[set[str]] = [set() for _ in pieces]
    later: set[str] = {o.name for o in graph.output}
    for i in range(len(pieces) - 1, -1, -1):
        nodes, attn = pieces[i]
        if attn is not None:
            later |= set(attn.input)
        consumed_after[i] = set(later)
        for n in nodes:
            later |= set(n.input)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # ORT threads spin after each run by default, stealing the cores the host attention
    # between segments needs.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        opts.intra_op_num_threads = threads
    if int8_activations:
        # Blocked DequantizeLinear + MatMul (quantized engines) becomes MatMulNBits at this
        # accuracy level: activations quantized to int8 per block, int32 accumulation.
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level",
                                      str(INT8_ACCURACY_LEVEL))
    else:
        # No QDQ fusion: ORT folds each DequantizeLinear of constant codes into an fp32 weight
        # at load, so the MatMuls are exactly those of the dequantized checkpoint.
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
    # The greedy rows' argmax, taken inside the graph (see OnnxRuntimeRunner.execute_argmax).
    last_nodes = [*pieces[-1][0], helper.make_node("ArgMax", ["logits"], [ARGMAX_OUTPUT],
                                                   axis=1, keepdims=0)]
    pieces[-1] = (last_nodes, None)
    consumed_after[-1].add(ARGMAX_OUTPUT)
    value_info[ARGMAX_OUTPUT] = helper.make_tensor_value_info(
        ARGMAX_OUTPUT, onnx.TensorProto.INT64, ["num_logits"])
    segments = []
    for i, (nodes, attn) in enumerate(pieces):
        produced = {o for n in nodes for o in n.output}
        needed = [x for n in nodes for x in n.input if x and x not in produced]
        seg_inputs = list(dict.fromkeys(x for x in needed if x not in inits))
        seg_inits = [inits[x] for x in dict.fromkeys(needed) if x in inits]
        seg_outputs = [o for n in nodes for o in n.output if o in consumed_after[i]]
        session = None
        if nodes:
            g = helper.make_graph(
                nodes, f"segment_{i}",
                [_value_info(value_info, x) for x in seg_inputs],
                [_value_info(value_info, x) for x in seg_outputs],
                seg_inits,
            )
            seg_model = helper.make_model(g, opset_imports=[
                o for o in model.opset_import if o.domain != ONNX_DOMAIN])
            seg_model.ir_version = model.ir_version
            session = ort.InferenceSession(seg_model.SerializeToString(), opts,
                                           providers=["CPUExecutionProvider"])
        attrs = {a.name: helper.get_attribute_value(a) for a in attn.attribute} if attn else {}
        segments.append(_Segment(session, seg_inputs, seg_outputs, attn, attrs))
    return segments


def _value_info(known: dict, name: str) -> onnx.ValueInfoProto:
    if name in known:
        return known[name]
    # Type unknown to the exporter's value_info: leave it to ORT's inference.
    return helper.make_empty_tensor_value_info(name)


class OnnxRuntimeRunner(PoolRunner):
    """Executes the engine's ONNX graph with ONNX Runtime over a host KV pool."""

    pool: HostKVPool

    name = "onnxruntime"

    def __init__(self, engine_dir: str | Path, engine: EngineConfig, num_blocks: int,
                 num_host_blocks: int = 0, threads: int | None = None,
                 quantized_matmul: str = "fp32", kv_cache_dtype: str = "fp32") -> None:
        super().__init__(engine, num_blocks, num_host_blocks)
        path = Path(engine_dir) / engine.files.get("onnx", ONNX_FILE)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: the ONNX Runtime runner needs an engine built with "
                "--backend onnxruntime"
            )
        if quantized_matmul not in QUANTIZED_MATMUL_MODES:
            raise ValueError(f"quantized_matmul must be one of {QUANTIZED_MATMUL_MODES}, got "
                             f"{quantized_matmul!r}")
        model = onnx.load(str(path))
        int8 = engine.quantization is not None and quantized_matmul != "fp32"
        self.segments = build_segments(model, threads, int8_activations=int8)
        # auto: MatMulNBits (int8 activations) reads a quarter of the bytes but multiplies
        # slower than fp32 GEMM once a step has more than a few tokens; big steps (prefill,
        # large decode batches) run on the weights dequantized at load instead.
        self.large_segments = (build_segments(model, threads, int8_activations=False)
                               if int8 and quantized_matmul == "auto" else None)
        kv_dtype = kv_cache_numpy_dtype(kv_cache_dtype)
        m = engine.model
        self.pool = HostKVPool(m.num_hidden_layers, num_blocks, engine.limits.block_size,
                               m.num_key_value_heads, m.head_dim, kv_dtype, num_host_blocks)
        self.kv_cache_dtype = kv_cache_dtype

    def execute(self, step: StepInput) -> np.ndarray:
        return self._run(step, "logits")

    def execute_argmax(self, step: StepInput) -> np.ndarray:
        """The step's argmax rows from the graph's own ArgMax: the logits stay inside ORT."""
        return self._run(step, ARGMAX_OUTPUT)

    def _run(self, step: StepInput, want: str) -> np.ndarray:
        values: dict[str, np.ndarray] = {
            "input_ids": step.input_ids, "positions": step.positions,
            "kv_cache_ptrs": self.pool.ptrs, "slot_mapping": step.slot_mapping,
            "block_tables": step.block_tables, "seq_lens": step.seq_lens,
            "query_start_loc": step.query_start_loc, "logits_indices": step.logits_indices,
        }
        segments = self.segments
        if self.large_segments is not None and step.num_tokens > AUTO_INT8_MAX_TOKENS:
            segments = self.large_segments
        last = segments[-1]
        for seg in segments:
            if seg.session is not None:
                names = [want] if seg is last else seg.output_names
                outs = seg.session.run(names, {n: values[n] for n in seg.input_names})
                values.update(zip(names, outs, strict=True))
            if seg.attention is not None:
                a = seg.attention
                values[a.output[0]] = paged_attention_native(
                    *(values[x] for x in a.input),
                    layer_idx=seg.attention_attrs["layer_idx"],
                    num_heads=seg.attention_attrs["num_heads"],
                    num_kv_heads=seg.attention_attrs["num_kv_heads"],
                    head_dim=seg.attention_attrs["head_dim"],
                    scale=seg.attention_attrs["scale"],
                )
        return values[want]
