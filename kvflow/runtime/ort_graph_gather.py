"""The embedding lookup over the quantized LM head, for :mod:`kvflow.runtime.ort_graph`.

A tied model's build keeps the fp32 table (``lm_head.weight``) for the embedding ``Gather`` and
quantizes the LM head (``lm_head.weight.q`` + ``.scale`` [+ minimum]). Once the head is a
``kvflow::MatMulQ`` (:func:`~kvflow.runtime.ort_graph_linear.native_matmuls`), the ``Gather``
becomes ``kvflow::GatherQ`` over the same packed blocks: each token's row dequantized on the
fly, so the fp32 table is never read at run time. Only when the table *is* the dequantized head:
checked on sampled rows (a model quantized by ``--quantize`` keeps its original fp32
embeddings, which the head's quantization rounds; those keep the ``Gather``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from kvflow.plugins.op_names import ONNX_DOMAIN
from kvflow.runtime.ort_graph_edit import Graph
from kvflow.runtime.ort_graph_linear import NATIVE_BLOCK, NativeWeight
from kvflow.runtime.ort_weights import is_external

GATHER_Q = "gather_q"
GATHER_Q_OP_TYPE = "GatherQ"
CHECK_ROWS = 64  # table rows compared with the dequantized head
_gather_q: dict[Path, bool] = {}


def _dequantized_rows(g: Graph, weight: NativeWeight, rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` of the head's weight [N, K] as GatherQ computes them: fp16->fp32 d times
    the code (plus fp16->fp32 m), in fp32."""
    q = _code_columns(g, weight.codes, rows).astype(np.float32)  # [K, R]
    d = weight.scale(g)[:, rows].astype(np.float16).astype(np.float32)  # [K/32, R]
    w = np.repeat(d, NATIVE_BLOCK, axis=0) * q
    minimum = weight.minimum(g)
    if minimum is not None:
        m = minimum[:, rows].astype(np.float16).astype(np.float32)
        w = w + np.repeat(m, NATIVE_BLOCK, axis=0)
    return w.T


def _code_columns(g: Graph, name: str, columns: np.ndarray) -> np.ndarray:
    """Columns of a codes initializer [K, N]; of mapped 4-bit codes, only their bytes are read
    (not the whole table unpacked)."""
    t = g.inits[name]
    if t.data_type == TensorProto.UINT4 and is_external(t) and name not in g.deferred:
        assert g.weights is not None
        raw = g.weights.raw(t)
        k, n = list(t.dims)
        flat = (np.arange(k)[:, None] * n + columns[None, :]).ravel()
        nibbles = np.asarray(raw[flat // 2])
        values = np.where(flat % 2 == 0, nibbles & 0x0F, nibbles >> 4)
        return values.reshape(k, len(columns))
    codes = g.const(name)
    assert codes is not None
    return np.asarray(codes[:, columns]).astype(np.int32)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def gather_quantized_rows(g: Graph) -> tuple[Counter, Counter]:
    """Each axis-0 ``Gather`` over an fp32 table that equals a packed LM head's dequantized
    weight becomes ``kvflow::GatherQ`` over those blocks."""
    applied: Counter = Counter()
    skipped: Counter = Counter()
    for node in [n for n in g.nodes if n.op_type == "Gather"]:
        table = node.input[0]
        packed = g.packed.get(f"{table}.q")
        t = g.inits.get(table)
        if packed is None or t is None or t.data_type != TensorProto.FLOAT or \
                _attrs(node).get("axis", 0) != 0:
            continue
        blocks, weight = packed
        if list(t.dims) != [weight.n, weight.k]:
            skipped[GATHER_Q] += 1
            continue
        rows = np.unique(np.linspace(0, weight.n - 1, CHECK_ROWS).astype(np.int64))
        values = g.const(table)
        assert values is not None
        if not np.array_equal(np.asarray(values[rows]), _dequantized_rows(g, weight, rows)):
            skipped[GATHER_Q] += 1
            continue
        g.replace([node], [g.node(GATHER_Q_OP_TYPE, [blocks, node.input[1]], list(node.output),
                                  domain=ONNX_DOMAIN, bits=weight.bits, K=weight.k,
                                  N=weight.n)])
        applied[GATHER_Q] += 1
    return applied, skipped


def gather_q_available(library: Path | None) -> bool:
    """Whether the native library registers ``kvflow::GatherQ`` (a session of one node
    loads)."""
    if library is None:
        return False
    if library not in _gather_q:
        from onnxruntime import InferenceSession, SessionOptions

        node = helper.make_node(GATHER_Q_OP_TYPE, ["blocks", "ids"], ["rows"],
                                domain=ONNX_DOMAIN, bits=8, K=32, N=2)
        graph = helper.make_graph(
            [node], "probe",
            [helper.make_tensor_value_info("blocks", onnx.TensorProto.UINT8, [2, 34]),
             helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1])],
            [helper.make_tensor_value_info("rows", onnx.TensorProto.FLOAT, [1, 32])])
        probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid(ONNX_DOMAIN, 1)])
        opts = SessionOptions()
        opts.register_custom_ops_library(str(library))
        try:
            InferenceSession(probe.SerializeToString(), opts,
                             providers=["CPUExecutionProvider"])
            _gather_q[library] = True
        except Exception:  # noqa: BLE001  (ORT: no such op in the library)
            _gather_q[library] = False
    return _gather_q[library]
