"""How the ONNX Runtime runner executes a graph: one session, or segments around the attention.

:class:`OneSession` runs the whole step graph in one ORT session, ``kvflow::PagedAttention``
included, through the native custom op (:mod:`kvflow.plugins.ort_custom_ops`).

:class:`Segmented` is the fallback when that library cannot be built or loaded: the graph is cut
at its PagedAttention nodes into ``num_layers + 1`` ORT sessions and kvflow's compiled host
kernel (:mod:`kvflow.plugins.paged_attention_native`) runs between them, with the tensors
crossing a cut kept on the host.

Both take the same feeds (the engine I/O contract) and return the one output asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeAlias

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from kvflow.plugins.op_names import ONNX_DOMAIN, ONNX_OP_TYPE
from kvflow.plugins.paged_attention_native import paged_attention_native
from kvflow.runtime.ort_weights import MappedWeights

ARGMAX_OUTPUT = "kvflow_argmax"
INT8_ACCURACY_LEVEL = 4  # MatMulNBits: int8 activations (ORT's levels 0-1 are fp32, but slow)


def session_options(threads: int, spinning: bool, int8_activations: bool,
                    custom_ops_library: Path | None = None,
                    prepacking: bool = True) -> ort.SessionOptions:
    """ORT options for one of the runner's sessions.

    ``int8_activations``: blocked DequantizeLinear + MatMul (quantized engines) becomes
    MatMulNBits with activations quantized to int8 per block and int32 accumulation; otherwise
    ORT folds each DequantizeLinear of constant codes into an fp32 weight at load, so that the
    MatMuls are exactly those of the dequantized checkpoint. ``prepacking``: False keeps
    ORT from repacking constant fp32 matmul weights into private copies (mapped weights stay
    the file's pages; :mod:`kvflow.runtime.ort_weights`).
    """
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if int8_activations:
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level",
                                      str(INT8_ACCURACY_LEVEL))
    else:
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
    if not prepacking:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    if custom_ops_library is not None:
        opts.register_custom_ops_library(str(custom_ops_library))
    return opts


Options: TypeAlias = "ort.SessionOptions | Callable[[], ort.SessionOptions]"


def _session(model: onnx.ModelProto, options: Options,
             weights: MappedWeights | None) -> ort.InferenceSession:
    # NOTE: options given to ORT keep the external initializers added to them, so that the
    # segments of a graph (each with its own) need options of their own: a factory.
    opts = options() if callable(options) else options
    if weights is not None:
        weights.apply(opts, model)
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


def with_argmax(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` plus an output ``kvflow_argmax``: the greedy rows' argmax taken inside the graph,
    so that no vocabulary-wide row leaves ORT (OnnxRuntimeRunner.execute_argmax)."""
    model.graph.node.append(helper.make_node("ArgMax", ["logits"], [ARGMAX_OUTPUT], axis=1,
                                             keepdims=0))
    model.graph.output.append(helper.make_tensor_value_info(
        ARGMAX_OUTPUT, onnx.TensorProto.INT64, ["num_logits"]))
    return model


def attention_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node
            if n.op_type == ONNX_OP_TYPE and n.domain == ONNX_DOMAIN]


class Executor(Protocol):
    """Runs the step graph: feeds by input name -> the output ``want``."""

    def run(self, feeds: dict[str, np.ndarray], want: str) -> np.ndarray: ...


class OneSession:
    """The whole graph in one ORT session; PagedAttention runs as ORT's own kernel.
    ``weights``: how a graph read without its weights gets them (mapped)."""

    def __init__(self, model: onnx.ModelProto, opts: Options,
                 weights: MappedWeights | None = None) -> None:
        self.session = _session(model, opts, weights)
        self.input_names = [i.name for i in self.session.get_inputs()]

    def run(self, feeds: dict[str, np.ndarray], want: str) -> np.ndarray:
        return self.session.run([want], {n: feeds[n] for n in self.input_names})[0]


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


class Segmented:
    """The graph cut at its PagedAttention nodes into ORT sessions, kvflow's compiled host
    kernel running between them (the fallback: see the module doc)."""

    def __init__(self, model: onnx.ModelProto, opts: Options,
                 weights: MappedWeights | None = None) -> None:
        self.segments = build_segments(model, opts, weights)

    def run(self, feeds: dict[str, np.ndarray], want: str) -> np.ndarray:
        values = dict(feeds)
        last = self.segments[-1]
        for seg in self.segments:
            if seg.session is not None:
                names = [want] if seg is last else seg.output_names
                outs = seg.session.run(names, {n: values[n] for n in seg.input_names})
                values.update(zip(names, outs, strict=True))
            if seg.attention is not None:
                a, attrs = seg.attention, seg.attention_attrs
                values[a.output[0]] = paged_attention_native(
                    *(values[x] for x in a.input), layer_idx=attrs["layer_idx"],
                    num_heads=attrs["num_heads"], num_kv_heads=attrs["num_kv_heads"],
                    head_dim=attrs["head_dim"], scale=attrs["scale"],
                    sliding_window=attrs.get("sliding_window", 0),
                    logit_softcap=attrs.get("logit_softcap", 0.0))
        return values[want]


def build_segments(model: onnx.ModelProto, opts: Options,
                   weights: MappedWeights | None = None) -> list[_Segment]:
    """Cut ``model`` at its PagedAttention nodes into ORT sessions (see module doc).
    ``opts``: options, or (with ``weights`` given as OrtValues) a function making them."""
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
            session = _session(seg_model, opts, weights)
        attrs = {a.name: helper.get_attribute_value(a) for a in attn.attribute} if attn else {}
        segments.append(_Segment(session, seg_inputs, seg_outputs, attn, attrs))
    return segments


def _value_info(known: dict, name: str) -> onnx.ValueInfoProto:
    if name in known:
        return known[name]
    # Type unknown to the exporter's value_info: leave it to ORT's inference.
    return helper.make_empty_tensor_value_info(name)
