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

The rewrite is structure only: it needs each weight's scheme and shape (a :class:`QuantSpec`),
not its bytes. Given a :class:`QuantSpec`, the new initializers are placeholders
(:func:`kvflow.build.export.is_placeholder`) that the streaming build fills tensor by tensor
with :func:`quantized_tensors`; given a :class:`QuantizedWeight`, they hold its values at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
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


@dataclass(frozen=True)
class QuantSpec:
    """What the graph rewrite needs of a block-quantized weight: its form, not its values.

    Attributes:
        scheme: ``Q4_0``, ``Q4_1``, ``Q8_0``, ``int4`` or ``int8``.
        bits: 4 or 8.
        block_size: elements per block along ``in``.
        shape: ``(out, in)``.
        zero_point: whether it has integer zero points (Q4_0, int4).
        minimum: whether it has float block minima (Q4_1).
    """

    scheme: str
    bits: int
    block_size: int
    shape: tuple[int, int]
    zero_point: bool = False
    minimum: bool = False

    @property
    def signed(self) -> bool:
        return self.bits == 8

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight, as :attr:`QuantizedWeight.nbytes` counts them."""
        out, cols = self.shape
        blocks = out * (cols // self.block_size)
        return (out * cols * self.bits // 8 + blocks * 4 + (blocks * self.bits // 8
                if self.zero_point else 0) + (blocks * 4 if self.minimum else 0))

    @classmethod
    def of(cls, scheme: str, shape: tuple[int, int], block_size: int = 32) -> QuantSpec:
        """The spec of a GGUF block type or a round-to-nearest scheme (``int4``/``int8``)."""
        forms = {"Q4_0": (4, True, False), "Q4_1": (4, False, True), "Q8_0": (8, False, False),
                 "int4": (4, True, False), "int8": (8, False, False)}
        if scheme not in forms:
            raise ValueError(f"quantization scheme must be one of {sorted(forms)}, got "
                             f"{scheme!r}")
        bits, zp, minimum = forms[scheme]
        return cls(scheme, bits, 32 if scheme.startswith("Q") else block_size,
                   (int(shape[0]), int(shape[1])), zp, minimum)

    @classmethod
    def of_weight(cls, w: QuantizedWeight) -> QuantSpec:
        return cls(w.scheme, w.bits, w.block_size, w.shape, w.zero_point is not None,
                   w.minimum is not None)


def quantized_tensors(name: str, w: QuantizedWeight) -> list[TensorProto]:
    """The initializers the rewrite reads for weight ``name``, with their values: codes
    (``.q``, transposed to ``[in, out]``), ``.scale``, and ``.zero_point`` / ``.minimum``."""
    out = [_packed_tensor(f"{name}.q", w.q.T, w.bits, w.q.dtype == np.int8),
           numpy_helper.from_array(np.ascontiguousarray(w.scale.T), f"{name}.scale")]
    if w.zero_point is not None:
        out.append(_packed_tensor(f"{name}.zero_point", w.zero_point.T, w.bits, False))
    if w.minimum is not None:
        out.append(numpy_helper.from_array(np.ascontiguousarray(w.minimum.T), f"{name}.minimum"))
    return out


def _placeholder(name: str, data_type: int, dims: list[int]) -> TensorProto:
    from kvflow.build.export import PLACEHOLDER

    t = TensorProto(name=name, data_type=data_type, dims=dims)
    t.data_location = TensorProto.EXTERNAL
    t.external_data.add(key="location", value=PLACEHOLDER)
    return t


def _spec_tensors(name: str, s: QuantSpec) -> list[TensorProto]:
    """:func:`quantized_tensors`'s initializers without values (placeholders)."""
    out, cols = s.shape
    nb = cols // s.block_size
    code = (TensorProto.INT8 if s.signed else TensorProto.UINT8) if s.bits == 8 \
        else TensorProto.UINT4
    tensors = [_placeholder(f"{name}.q", code, [cols, out]),
               _placeholder(f"{name}.scale", TensorProto.FLOAT, [nb, out])]
    if s.zero_point:
        tensors.append(_placeholder(f"{name}.zero_point",
                                    TensorProto.UINT4 if s.bits == 4 else TensorProto.UINT8,
                                    [nb, out]))
    if s.minimum:
        tensors.append(_placeholder(f"{name}.minimum", TensorProto.FLOAT, [nb, out]))
    return tensors


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
                   weights: Mapping[str, QuantizedWeight | QuantSpec]) -> QuantizeReport:
    """Rewrite ``model`` in place so that every ``Gemm`` whose weight is in ``weights`` reads it
    block-quantized; fp32 initializers nobody reads any more are dropped. A
    :class:`QuantizedWeight` puts its values in the graph; a :class:`QuantSpec` leaves
    placeholders for the stream (the graph's own weights may be placeholders too)."""
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
        given = weights[name]
        w = given if isinstance(given, QuantSpec) else QuantSpec.of_weight(given)
        out_features, in_features = w.shape
        if tuple(inits[name].dims) != (out_features, in_features):
            raise ValueError(f"{name}: graph weight {list(inits[name].dims)} does not match "
                             f"the quantized weight {list(w.shape)}")
        x, y = node.input[0], node.output[0]
        tensors = (_spec_tensors(name, given) if isinstance(given, QuantSpec)
                   else quantized_tensors(name, given))
        by_name = {t.name: t for t in tensors}
        dq_inputs = [f"{name}.q", f"{name}.scale"]
        new_inits += [by_name[dq_inputs[0]], by_name[dq_inputs[1]]]
        if w.zero_point:
            dq_inputs.append(f"{name}.zero_point")
            new_inits.append(by_name[dq_inputs[2]])
        new_nodes.append(helper.make_node("DequantizeLinear", dq_inputs, [f"{name}.dq"],
                                          name=f"{name}.DequantizeLinear", axis=0,
                                          block_size=w.block_size))
        has_bias = len(node.input) > 2 and bool(node.input[2])
        product = y if not w.minimum and not has_bias else f"{name}.matmul"
        new_nodes.append(helper.make_node("MatMul", [x, f"{name}.dq"], [product],
                                          name=f"{name}.MatMul"))
        if has_bias:
            biased = y if not w.minimum else f"{name}.biased"
            new_nodes.append(helper.make_node("Add", [product, node.input[2]], [biased]))
            product = biased
        if w.minimum:
            key = (x, in_features, w.block_size)
            if key not in block_sums:
                block_sums[key] = _block_sum(x, in_features, w.block_size, new_nodes, new_inits)
            new_inits.append(by_name[f"{name}.minimum"])
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
