"""Put block-quantized weights into the exported ONNX graph, in the standard form.

Each linear layer the exporter wrote as ``Gemm(x, W, transB=1)`` whose ``W`` has a
:class:`~kvflow.model.quant.QuantizedWeight` becomes::

    y = MatMul(x, DequantizeLinear(q, scale, zero_point, axis=0, block_size=B))   (opset 21)
      [ + ReduceSum(Reshape(x, [-1, K/B, B]), axis=-1) @ minimum ]  (Q4_1 only: one Gemm)

Blocked ``DequantizeLinear`` + ``MatMul`` is the weight-only quantization that every ONNX
consumer reads: ONNX Runtime's CPU provider fuses it into ``MatMulNBits`` at load time (the
codes stay packed, 4 or 8 bits per weight), and TensorRT reads it as INT4/INT8 weight-only
quantization. Q4_1's per-block minimum ``m`` is not an integer zero point: ``d*q + m`` would need
the float zero point ``-m/d``, which rounds, and which no fused kernel of TensorRT takes. It is
instead exact in the algebra: ``sum_k x_k (d q_k + m) = sum_k x_k d q_k + m sum_k x_k``, so the
minima cost one small ``[T, K/B] x [K/B, N]`` Gemm over the block sums of ``x`` (computed once
per input, shared by the layers that read it), whose ``C`` is the main product.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvflow.model.quant import QuantizedWeight

QUANT_OPSET = 21  # blocked DequantizeLinear and 4-bit tensors
QUANT_IR_VERSION = 10


@dataclass
class QuantizeReport:
    """What :func:`quantize_graph` did: layers per scheme, and the weight bytes before/after."""

    schemes: Counter = field(default_factory=Counter)
    fp32_bytes: int = 0
    quantized_bytes: int = 0


def _packed_tensor(name: str, codes: np.ndarray, bits: int, signed: bool) -> TensorProto:
    if bits == 8:
        return numpy_helper.from_array(np.ascontiguousarray(codes.astype(
            np.int8 if signed else np.uint8)), name)
    flat = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    packed = (flat[0::2] & 0x0F) | (flat[1::2] << 4)  # element 2i in the low nibble
    return helper.make_tensor(name, TensorProto.UINT4, list(codes.shape), packed.tobytes(),
                              raw=True)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def quantize_graph(model: onnx.ModelProto,
                   weights: dict[str, QuantizedWeight]) -> QuantizeReport:
    """Rewrite ``model`` in place (weights loaded) so that every ``Gemm`` whose weight is in
    ``weights`` reads it block-quantized; fp32 initializers nobody reads any more are dropped."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    report = QuantizeReport()
    new_nodes: list[onnx.NodeProto] = []
    new_inits: list[TensorProto] = []
    block_sums: dict[tuple[str, int, int], str] = {}
    for node in graph.node:
        name = node.input[1] if len(node.input) > 1 else ""
        if node.op_type != "Gemm" or name not in weights or name not in inits:
            new_nodes.append(node)
            continue
        a = _attrs(node)
        if a.get("transB", 0) != 1 or a.get("transA", 0) or a.get("alpha", 1.0) != 1.0 \
                or a.get("beta", 1.0) != 1.0:
            new_nodes.append(node)
            continue
        w = weights[name]
        out_features, in_features = w.shape
        if tuple(inits[name].dims) != (out_features, in_features):
            raise ValueError(f"{name}: graph weight {list(inits[name].dims)} does not match "
                             f"the quantized weight {list(w.shape)}")
        x, y = node.input[0], node.output[0]
        signed = w.q.dtype == np.int8
        dq_inputs = [f"{name}.q", f"{name}.scale"]
        new_inits += [_packed_tensor(dq_inputs[0], w.q.T, w.bits, signed),
                      numpy_helper.from_array(np.ascontiguousarray(w.scale.T), dq_inputs[1])]
        if w.zero_point is not None:
            dq_inputs.append(f"{name}.zero_point")
            new_inits.append(_packed_tensor(dq_inputs[2], w.zero_point.T, w.bits, False))
        new_nodes.append(helper.make_node("DequantizeLinear", dq_inputs, [f"{name}.dq"],
                                          name=f"{name}.DequantizeLinear", axis=0,
                                          block_size=w.block_size))
        has_bias = len(node.input) > 2 and bool(node.input[2])
        product = y if w.minimum is None and not has_bias else f"{name}.matmul"
        new_nodes.append(helper.make_node("MatMul", [x, f"{name}.dq"], [product],
                                          name=f"{name}.MatMul"))
        if has_bias:
            biased = y if w.minimum is None else f"{name}.biased"
            new_nodes.append(helper.make_node("Add", [product, node.input[2]], [biased]))
            product = biased
        if w.minimum is not None:
            key = (x, in_features, w.block_size)
            if key not in block_sums:
                block_sums[key] = _block_sum(x, in_features, w.block_size, new_nodes, new_inits)
            new_inits.append(numpy_helper.from_array(np.ascontiguousarray(w.minimum.T),
                                                     f"{name}.minimum"))
            # y = block_sums @ minimum + product: one Gemm, its C the main product.
            new_nodes.append(helper.make_node("Gemm", [block_sums[key], f"{name}.minimum",
                                                       product], [y],
                                              name=f"{name}.MinimumGemm"))
        report.schemes[w.scheme] += 1
        report.fp32_bytes += out_features * in_features * 4
        report.quantized_bytes += w.nbytes
    graph.ClearField("node")
    graph.node.extend(new_nodes)
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in used]
    graph.ClearField("initializer")
    graph.initializer.extend(kept + new_inits)
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, QUANT_OPSET)
    model.ir_version = max(model.ir_version, QUANT_IR_VERSION)
    return report


def _block_sum(x: str, in_features: int, block_size: int, nodes: list[onnx.NodeProto],
               inits: list[TensorProto]) -> str:
    """Nodes for ``sum over each block of x``: ``[T, K]`` -> ``[T, K/B]``; returns its name."""
    tag = f"{x}.block_sum_{block_size}"
    shape = f"{tag}.shape"
    inits += [numpy_helper.from_array(np.array([-1, in_features // block_size, block_size],
                                               dtype=np.int64), shape),
              numpy_helper.from_array(np.array([-1], dtype=np.int64), f"{tag}.axes")]
    nodes.append(helper.make_node("Reshape", [x, shape], [f"{tag}.blocks"]))
    nodes.append(helper.make_node("ReduceSum", [f"{tag}.blocks", f"{tag}.axes"], [tag],
                                  keepdims=0))
    return tag
