"""Sibling linear layers (Q/K/V, gate/up) as one matmul + ``Split``, for
:mod:`kvflow.runtime.ort_graph`.

A *linear unit* is one of the two forms the build writes (:mod:`kvflow.build.quantize`):

- fp32: ``Gemm(x, W[N, K], b?, transB=1)``;
- block-quantized: ``MatMul(x, DequantizeLinear(q[K, N], scale, zero_point?, axis=0,
  block_size=B))``, then ``+ b`` if biased, then (Q4_1) ``Gemm(block_sums(x), minimum, C=...)``.

Units that read the same ``x`` and have the same form (same block size and code types) are
concatenated along the output axis, codes, scales, zero points, minima and biases alike, and
the product is split back into the tensors the units made. The result is the same form as
before, so ORT still folds ``DequantizeLinear`` into fp32 weights or into ``MatMulNBits``, as
the runner asks; and Q4_1 pays one minimum ``Gemm`` per group instead of one per layer.
A missing bias among biased siblings is a zero bias (exact).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import partial

import numpy as np
import onnx
from onnx import TensorProto, helper

from kvflow.plugins.op_names import ONNX_DOMAIN, ONNX_OP_TYPE
from kvflow.runtime.ort_graph_edit import Graph

QKV = "qkv_matmul"
GATE_UP = "gate_up_matmul"
OTHER = "sibling_matmul"


@dataclass
class _Unit:
    x: str
    out: str
    features: int  # N, the output features
    key: tuple  # units with equal keys (and the same x) can be concatenated
    nodes: list[onnx.NodeProto]
    weight: str = ""  # fp32 W [N, K]
    bias: str = ""
    codes: str = ""  # quantized: q [K, N], scale / zero_point / minimum [K / B, N]
    scale: str = ""
    zero_point: str = ""
    minimum: str = ""
    block_sums: str = ""
    block_size: int = 0


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _plain_gemm(node: onnx.NodeProto, trans_b: int) -> bool:
    a = _attrs(node)
    return node.op_type == "Gemm" and a.get("transA", 0) == 0 and a.get("transB", 0) == trans_b \
        and a.get("alpha", 1.0) == 1.0 and a.get("beta", 1.0) == 1.0


def _init_dims(g: Graph, name: str, dtype: int | None = TensorProto.FLOAT) -> list[int] | None:
    t = g.inits.get(name)
    if t is None or (dtype is not None and t.data_type != dtype):
        return None
    return list(t.dims)


def _bias(g: Graph, name: str, features: int) -> bool:
    return _init_dims(g, name) == [features]


def _match_gemm(g: Graph, node: onnx.NodeProto) -> _Unit | None:
    dims = _init_dims(g, node.input[1]) if len(node.input) > 1 else None
    if not _plain_gemm(node, 1) or dims is None or len(dims) != 2:
        return None
    bias = node.input[2] if len(node.input) > 2 else ""
    if bias and not _bias(g, bias, dims[0]):
        return None
    return _Unit(node.input[0], node.output[0], dims[0], ("gemm", dims[1]), [node],
                 weight=node.input[1], bias=bias)


def _is_block_sum(g: Graph, name: str, x: str, k: int, block: int) -> bool:
    """``name`` is ``ReduceSum(Reshape(x, [-1, K/B, B]), -1)``: the block sums of ``x``."""
    total = g.producer.get(name)
    if total is None or total.op_type != "ReduceSum" or _attrs(total).get("keepdims", 1) != 0:
        return False
    axes = g.const(total.input[1]) if len(total.input) > 1 else None
    blocks = g.producer.get(total.input[0])
    shape = g.const(blocks.input[1]) if blocks is not None and blocks.op_type == "Reshape" \
        else None
    return axes is not None and list(axes.ravel()) == [-1] and shape is not None and \
        blocks is not None and blocks.input[0] == x and \
        list(shape.ravel()) == [-1, k // block, block]


def _match_dequantized(g: Graph, node: onnx.NodeProto) -> _Unit | None:
    dq = g.producer.get(node.input[1]) if node.op_type == "MatMul" else None
    if dq is None or dq.op_type != "DequantizeLinear" or not g.only_used_by(dq.output[0], [node]):
        return None
    a = _attrs(dq)
    block = int(a.get("block_size", 0))
    codes = _init_dims(g, dq.input[0], None)
    scales = _init_dims(g, dq.input[1])
    if a.get("axis", 1) != 0 or block <= 0 or codes is None or len(codes) != 2 or \
            codes[0] % block or scales != [codes[0] // block, codes[1]]:
        return None
    k, n = codes
    zero_point = dq.input[2] if len(dq.input) > 2 else ""
    if zero_point and _init_dims(g, zero_point, None) != scales:
        return None
    unit = _Unit(node.input[0], node.output[0], n, (), [dq, node], codes=dq.input[0],
                 scale=dq.input[1], zero_point=zero_point, block_size=block)
    add = g.sole_consumer(unit.out, "Add")
    if add is not None:
        bias = add.input[1] if add.input[0] == unit.out else add.input[0]
        if _bias(g, bias, n):
            unit.bias, unit.out = bias, add.output[0]
            unit.nodes.append(add)
    gemm = g.sole_consumer(unit.out, "Gemm")
    if gemm is not None and _plain_gemm(gemm, 0) and len(gemm.input) == 3 and \
            gemm.input[2] == unit.out and _init_dims(g, gemm.input[1]) == scales and \
            _is_block_sum(g, gemm.input[0], unit.x, k, block):
        unit.minimum, unit.block_sums, unit.out = gemm.input[1], gemm.input[0], gemm.output[0]
        unit.nodes.append(gemm)
    zp_type = g.inits[zero_point].data_type if zero_point else None
    unit.key = ("dq", k, block, g.inits[unit.codes].data_type, zp_type, unit.block_sums)
    return unit


def _merge(g: Graph, units: list[_Unit]) -> None:
    first = units[0]
    tag = f"{first.weight or first.codes}.fused{len(units)}"
    product = g.unique(f"{tag}.out")
    nodes = []
    bias = ""
    if any(u.bias for u in units):
        bias = g.add_init(f"{tag}.bias", np.concatenate([
            g.const(u.bias) if u.bias else np.zeros(u.features, np.float32) for u in units]))
    if first.weight:
        weight = g.cat_init(f"{tag}.weight", [u.weight for u in units], 0)
        nodes.append(g.node("Gemm", [first.x, weight, *([bias] if bias else [])], [product],
                            transB=1))
    else:
        dq_inputs = [g.cat_init(f"{tag}.q", [u.codes for u in units], 1),
                     g.cat_init(f"{tag}.scale", [u.scale for u in units], 1)]
        if first.zero_point:
            dq_inputs.append(g.cat_init(f"{tag}.zero_point", [u.zero_point for u in units], 1))
        weight = g.unique(f"{tag}.dq")
        nodes.append(g.node("DequantizeLinear", dq_inputs, [weight], axis=0,
                            block_size=first.block_size))
        steps = [("MatMul", [first.x, weight])]
        if bias:
            steps.append(("Add", [bias]))
        if first.minimum:
            minimum = g.cat_init(f"{tag}.minimum", [u.minimum for u in units], 1)
            steps.append(("Gemm", [first.block_sums, minimum]))
        current = ""
        for k, (op, inputs) in enumerate(steps):
            out = product if k == len(steps) - 1 else g.unique(f"{tag}.{op.lower()}")
            args = inputs if op != "Add" else [current, *inputs]
            nodes.append(g.node(op, [*args, current] if op == "Gemm" else args, [out]))
            current = out
    x_dims = g.dims(first.x)
    g.add_value_info(product, TensorProto.FLOAT, [*x_dims[:-1], sum(u.features for u in units)]
                     if x_dims else None)
    sizes = g.add_init(f"{tag}.split", np.array([u.features for u in units], dtype=np.int64))
    nodes.append(g.node("Split", [product, sizes], [u.out for u in units], axis=-1))
    g.replace([n for u in units for n in u.nodes], nodes)


def fuse_linear_groups(g: Graph) -> tuple[Counter, Counter]:
    """Concatenate each group of compatible linear units that read one tensor."""
    groups: dict[tuple, list[_Unit]] = defaultdict(list)
    for node in list(g.nodes):
        unit = _match_gemm(g, node) if node.op_type == "Gemm" else \
            _match_dequantized(g, node) if node.op_type == "MatMul" else None
        if unit is not None:
            groups[unit.x, unit.key].append(unit)
    attention = [n for n in g.nodes if n.op_type == ONNX_OP_TYPE and n.domain == ONNX_DOMAIN]
    values = {n.input[2] for n in attention}
    silu = sum(n.op_type in ("Sigmoid", "QuickGelu") for n in g.nodes)
    applied: Counter = Counter()
    for units in groups.values():
        if len(units) < 2:
            continue
        outs = {u.out for u in units}
        if len(units) == 3 and outs & values:
            label = QKV
        elif len(units) == 2 and any(c.op_type in ("Sigmoid", "QuickGelu")
                                     for o in outs for c in g.consumers[o]):
            label = GATE_UP
        else:
            label = OTHER
        _merge(g, units)
        applied[label] += 1
    skipped = Counter({QKV: len(attention) - applied[QKV], GATE_UP: silu - applied[GATE_UP]})
    return applied, skipped


def fold_minima(g: Graph) -> tuple[Counter, Counter]:
    """Q4_1 for the fp32 matmul path: ``x @ DQ(q, d) + block_sums(x) @ m`` becomes
    ``x @ (DQ(q, d) + m)``, the block minima added to the dequantized codes in gguf-py's
    order (``d * q + m``), all constants: ORT folds it into one fp32 weight at load, so the
    minimum ``Gemm`` and the block sums are gone and the weight is the checkpoint's own
    dequantization. Not for MatMulNBits (int8 activations): it would fold the codes too."""
    applied: Counter = Counter()
    for node in [n for n in g.nodes if n.op_type == "MatMul"]:
        unit = _match_dequantized(g, node)
        if unit is None or not unit.minimum:
            continue
        k, n = list(g.inits[unit.codes].dims)
        blocks = k // unit.block_size
        tag = unit.codes.removesuffix(".q")
        dq = unit.nodes[0].output[0]
        shape3 = g.add_init(f"{tag}.blocks_shape", np.array([blocks, unit.block_size, n],
                                                             dtype=np.int64))
        shape2 = g.add_init(f"{tag}.weight_shape", np.array([k, n], dtype=np.int64))
        minima = g.reshape_init(f"{tag}.minimum3", unit.minimum, [blocks, 1, n])
        names = [g.unique(f"{tag}.{s}") for s in ("blocks", "plus_minimum", "weight")]
        product = unit.out if not unit.bias else g.unique(f"{tag}.matmul")
        nodes = [g.node("Reshape", [dq, shape3], [names[0]]),
                 g.node("Add", [names[0], minima], [names[1]]),
                 g.node("Reshape", [names[1], shape2], [names[2]]),
                 g.node("MatMul", [unit.x, names[2]], [product])]
        if unit.bias:
            nodes.append(g.node("Add", [product, unit.bias], [unit.out]))
        g.replace(unit.nodes[1:], nodes)
        applied["q4_1_minimum_folded"] += 1
    return applied, Counter()


NATIVE_MATMUL = "native_matmul"
NATIVE_OP_TYPE = "MatMulQ"  # kvflow/plugins/matmul_q_ort.h
NATIVE_BLOCK = 32
_BLOCK_BYTES = {4: 20, 8: 34}
PACK_COLUMNS = 4096  # NativeWeight.pack's chunk


def _half_bytes(values: np.ndarray) -> np.ndarray | None:
    """``values`` [K/B, N] as fp16 bytes [N, K/B * 2], or None if fp16 would change one."""
    half = values.astype(np.float16)
    if not np.array_equal(half.astype(np.float64), values.astype(np.float64)):
        return None
    return np.ascontiguousarray(half.T).view(np.uint8)


def pack_blocks(codes: np.ndarray, scale: np.ndarray,
                minimum: np.ndarray | None) -> np.ndarray | None:
    """The ``kvflow::MatMulQ`` weight: ``codes`` [K, N] (uint8 0..15 with ``minimum``, Q4_1's
    ``d * q + m``; int8 without, Q8_0's ``d * q``), ``scale`` and ``minimum`` [K/32, N] ->
    uint8 [N, K/32 * 20 (Q4_1) or 34 (Q8_0)]: per output column, its K/32 blocks' fp16 d, then
    (Q4_1) their fp16 m, then their codes (Q4_1: block element j < 16 in the low nibble of
    byte j, element j + 16 in its high nibble, as llama.cpp's blocks). None if a scale or
    minimum is not exact in fp16."""
    k, n = codes.shape
    d = _half_bytes(scale)
    blocks = np.ascontiguousarray(codes.T).reshape(n, k // NATIVE_BLOCK, NATIVE_BLOCK)
    if d is None:
        return None
    if minimum is None:
        parts = [d, blocks.astype(np.int8).view(np.uint8).reshape(n, -1)]
    else:
        m = _half_bytes(minimum)
        if m is None:
            return None
        nibbles = blocks.astype(np.uint8)
        parts = [d, m, (nibbles[..., :16] | (nibbles[..., 16:] << 4)).reshape(n, -1)]
    return np.concatenate(parts, axis=1)


@dataclass
class NativeWeight:
    """How a quantized unit's weight becomes ``kvflow::MatMulQ`` blocks: ``bits``, and the
    initializers of its codes, scales and (4 bit) minima or zero points, read only when the
    blocks are made or a table is compared with them."""

    codes: str
    scale_name: str
    minimum_name: str
    zero_point_name: str
    bits: int
    k: int
    n: int

    def scale(self, g: Graph) -> np.ndarray:
        scale = g.const(self.scale_name)
        assert scale is not None
        return scale

    def minimum(self, g: Graph) -> np.ndarray | None:
        """The fp32 ``m`` of ``d * q + m`` (None for 8 bit)."""
        if self.bits == 8:
            return None
        if self.minimum_name:
            return g.const(self.minimum_name)
        if self.zero_point_name:  # Q4_0, int4: d * (q - z) = d * q + m with m = -z * d
            zero_point = g.const(self.zero_point_name)
            assert zero_point is not None
            return -zero_point.astype(np.float64) * self.scale(g).astype(np.float64)
        return np.zeros_like(self.scale(g))

    def exact_in_fp16(self, g: Graph) -> bool:
        minimum = self.minimum(g)
        return _half_bytes(self.scale(g)) is not None and \
            (minimum is None or _half_bytes(minimum) is not None)

    def pack(self, g: Graph) -> np.ndarray:
        """The blocks, made :data:`PACK_COLUMNS` output columns at a time: a large head's
        temporaries (typed, transposed, split codes) stay a few MB beside the result."""
        codes = g.const(self.codes)
        scale, minimum = self.scale(g), self.minimum(g)
        assert codes is not None
        packed = np.empty(self.packed_dims, np.uint8)
        for j in range(0, self.n, PACK_COLUMNS):
            cols = slice(j, min(j + PACK_COLUMNS, self.n))
            part = pack_blocks(codes[:, cols].astype(np.int8 if self.bits == 8 else np.uint8),
                               scale[:, cols], None if minimum is None else minimum[:, cols])
            assert part is not None  # fp16 exactness was checked by native_weight
            packed[cols] = part
        return packed

    @property
    def packed_dims(self) -> list[int]:
        return [self.n, self.k // NATIVE_BLOCK * _BLOCK_BYTES[self.bits]]


def native_weight(g: Graph, unit: _Unit, check: bool = True) -> NativeWeight | None:
    """The unit's ``kvflow::MatMulQ`` form, or None if it has none (block size, code type,
    and unless ``check`` is False, a scale or minimum not exact in fp16: that reads them)."""
    codes_type = g.inits[unit.codes].data_type
    if unit.block_size != NATIVE_BLOCK:
        return None
    k, n = list(g.inits[unit.codes].dims)
    if codes_type == TensorProto.INT8 and not unit.zero_point and not unit.minimum:
        bits = 8
    elif codes_type == TensorProto.UINT4 and not (unit.zero_point and unit.minimum):
        bits = 4
    else:
        return None
    weight = NativeWeight(unit.codes, unit.scale, unit.minimum, unit.zero_point, bits, k, n)
    return weight if not check or weight.exact_in_fp16(g) else None


def native_matmuls(g: Graph) -> tuple[Counter, Counter]:
    """Each blocked ``DequantizeLinear + MatMul`` (+ its Q4_1 minimum ``Gemm``) with blocks of
    32 and scales (and minima) exact in fp16, as the GGUF schemes' are, becomes one
    ``kvflow::MatMulQ`` (int8 activations per block, integer dot products; the minimum term
    from the activations' block sums): the weights packed by :func:`pack_blocks`, a bias kept
    as an ``Add``. Other quantized matmuls stay for ORT and are counted as unmatched."""
    applied: Counter = Counter()
    skipped: Counter = Counter()
    for node in [n for n in g.nodes if n.op_type == "MatMul"]:
        unit = _match_dequantized(g, node)
        if unit is None:
            continue
        tag = unit.codes.removesuffix(".q")
        # Blocks an earlier load made from these same data passed the check then.
        k, n = list(g.inits[unit.codes].dims)
        made = g.prepared_has(f"{tag}.blocks", TensorProto.UINT8)
        weight = native_weight(g, unit, check=not made)
        if weight is None:
            skipped[NATIVE_MATMUL] += 1
            continue
        bits = weight.bits
        product = unit.out if not unit.bias else g.unique(f"{tag}.matmul_q")
        blocks = g.add_init(f"{tag}.blocks", partial(weight.pack, g), weight.packed_dims,
                            TensorProto.UINT8)
        g.packed[unit.codes] = (blocks, weight)
        nodes = [g.node(NATIVE_OP_TYPE, [unit.x, blocks], [product],
                        domain=ONNX_DOMAIN, bits=bits, K=k, N=n)]
        if unit.bias:
            x_dims = g.dims(unit.x)
            g.add_value_info(product, TensorProto.FLOAT, [*x_dims[:-1], n] if x_dims else None)
            nodes.append(g.node("Add", [product, unit.bias], [unit.out]))
        g.replace(unit.nodes, nodes)
        applied[NATIVE_MATMUL] += 1
    return applied, skipped
