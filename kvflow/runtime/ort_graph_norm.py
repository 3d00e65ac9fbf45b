"""RMSNorm and RoPE fusions of :mod:`kvflow.runtime.ort_graph`.

Each returns ``(applied, skipped)`` counters; a candidate that does not match every check is
left in the graph as it is.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from kvflow.plugins.op_names import ONNX_DOMAIN, ONNX_OP_TYPE
from kvflow.runtime.ort_graph_edit import MS_DOMAIN, Graph, float_dims

SLN = "SimplifiedLayerNormalization"
SKIP_SLN = "SkipSimplifiedLayerNormalization"
ROPE = "RotaryEmbedding"
INT64_MAX = np.iinfo(np.int64).max


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _ints(g: Graph, name: str) -> list[int] | None:
    value = g.const(name) if name else None
    if value is None or value.dtype.kind not in "iu":
        return None
    return [int(v) for v in np.ravel(value)]


@dataclass
class _Norm:
    x: str
    weight: str
    epsilon: float
    out: str
    nodes: list[onnx.NodeProto]


def _match_rms_norm(g: Graph, mean: onnx.NodeProto) -> _Norm | None:
    """``w * (x * Reciprocal(Sqrt(ReduceMean(x^2, -1) + eps)))``, as torch exports RMSNorm."""
    axes = _attrs(mean).get("axes") or (_ints(g, mean.input[1]) if len(mean.input) > 1
                                        else None)
    if _attrs(mean).get("keepdims", 1) != 1 or list(axes or []) != [-1]:
        return None
    square = g.producer.get(mean.input[0])
    if square is None or not g.only_used_by(square.output[0], [mean]):
        return None
    x = square.input[0]
    if square.op_type == "Pow":
        two = g.const(square.input[1])
        if two is None or two.size != 1 or float(two.ravel()[0]) != 2.0:
            return None
    elif not (square.op_type == "Mul" and square.input[1] == x):
        return None
    add = g.sole_consumer(mean.output[0], "Add")
    if add is None:
        return None
    eps = g.const(add.input[1] if add.input[0] == mean.output[0] else add.input[0])
    if eps is None or eps.size != 1 or eps.dtype != np.float32 or not 0 <= float(eps) < 1:
        return None
    sqrt = g.sole_consumer(add.output[0], "Sqrt")
    recip = g.sole_consumer(sqrt.output[0], "Reciprocal") if sqrt is not None else None
    scaled = g.sole_consumer(recip.output[0], "Mul") if recip is not None else None
    if sqrt is None or recip is None or scaled is None or \
            sorted(scaled.input) != sorted([x, recip.output[0]]):
        return None
    mul_w = g.sole_consumer(scaled.output[0], "Mul")
    if mul_w is None:
        return None
    weight = mul_w.input[0] if mul_w.input[1] == scaled.output[0] else mul_w.input[1]
    w = g.const(weight)
    x_dims = float_dims(g, x)
    if w is None or weight not in g.inits or w.ndim != 1 or w.dtype != np.float32 \
            or (x_dims and x_dims[-1] != w.shape[0]):
        return None
    return _Norm(x, weight, float(eps.ravel()[0]), mul_w.output[0],
                 [square, mean, add, sqrt, recip, scaled, mul_w])


def _residual_add(g: Graph, norm: _Norm) -> onnx.NodeProto | None:
    """The ``Add`` of two same-shaped activations that makes the norm's input, if any."""
    add = g.producer.get(norm.x)
    if add is None or add.op_type != "Add" or any(i in g.inits or g.const(i) is not None
                                                  for i in add.input):
        return None
    shapes = [float_dims(g, t) for t in (*add.input, norm.x)]
    if any(s is None or len(s) not in (2, 3) for s in shapes) or \
            not shapes[0] == shapes[1] == shapes[2]:
        return None
    return add


def fuse_rms_norms(g: Graph) -> tuple[Counter, Counter]:
    """RMSNorm -> SimplifiedLayerNormalization; residual Add + RMSNorm ->
    SkipSimplifiedLayerNormalization (output 3 keeps the residual's name)."""
    applied: Counter = Counter()
    skipped: Counter = Counter()
    for mean in [n for n in g.nodes if n.op_type == "ReduceMean"]:
        norm = _match_rms_norm(g, mean)
        if norm is None:
            skipped[SLN] += 1
            continue
        add = _residual_add(g, norm)
        if add is None:
            node = g.node(SLN, [norm.x, norm.weight], [norm.out], axis=-1,
                          epsilon=norm.epsilon, stash_type=1)
            g.replace(norm.nodes, [node])
            applied[SLN] += 1
            continue
        residual = "" if g.only_used_by(norm.x, norm.nodes) else norm.x
        node = g.node(SKIP_SLN, [add.input[0], add.input[1], norm.weight],
                      [norm.out, "", "", residual], epsilon=norm.epsilon, domain=MS_DOMAIN)
        g.replace([add, *norm.nodes], [node])
        applied[SKIP_SLN] += 1
    return applied, skipped


# --- RoPE -----------------------------------------------------------------------------------
@dataclass
class _Rope:
    lin: str  # [T, heads * head_dim] before the rotation; [T, heads, head_dim] when per_head
    cos_table: str
    sin_table: str
    positions: str
    nodes: list[onnx.NodeProto]
    # The rotation's input is per-head already (q/k norms of Qwen3 and Gemma 3 before RoPE).
    per_head: bool = False
    rotary_dim: int = 0  # the dims rotated (the tables' width): head_dim but for Phi-4-mini


def _slice_is(g: Graph, node: onnx.NodeProto | None, data: str, start: int, end: int) -> bool:
    """``node`` is ``data[..., start:end]`` on the last of 3 axes (``end`` or beyond)."""
    if node is None or node.op_type != "Slice" or node.input[0] != data or len(node.input) < 4:
        return False
    starts, ends, axes = (_ints(g, i) for i in node.input[1:4])
    steps = _ints(g, node.input[4]) if len(node.input) > 4 and node.input[4] else [1]
    return starts == [start] and ends is not None and len(ends) == 1 and \
        (ends[0] == end or (end == -1 and ends[0] >= INT64_MAX // 2)) and \
        axes in ([-1], [2]) and steps == [1]


def _table_rows(g: Graph, tensor: str) -> tuple[str, str, onnx.NodeProto] | None:
    """``Unsqueeze(table[positions], 1)``: the cos or sin rows of each token."""
    unsq = g.producer.get(tensor)
    if unsq is None or unsq.op_type != "Unsqueeze" or _ints(g, unsq.input[1]) != [1]:
        return None
    gather = g.producer.get(unsq.input[0])
    if gather is None or gather.input[0] not in g.inits:
        return None
    if gather.op_type == "Gather" and _attrs(gather).get("axis", 0) == 0:
        return gather.input[0], gather.input[1], unsq
    if gather.op_type == "GatherND" and _attrs(gather).get("batch_dims", 0) == 0:
        index = g.producer.get(gather.input[1])
        if index is not None and index.op_type == "Unsqueeze" and \
                _ints(g, index.input[1]) == [-1]:
            return gather.input[0], index.input[0], unsq
    return None


def _tables_ok(g: Graph, cos_name: str, sin_name: str, width: int) -> bool:
    """HF's non-interleaved layout: ``[P, width]`` tables whose halves repeat, a cos/sin
    pair."""
    key = ("rope_tables", cos_name, sin_name, width)
    if key not in g.memo:  # every layer's q and k read the same pair
        g.memo[key] = _check_tables(g, cos_name, sin_name, width)
    return g.memo[key]


def _check_tables(g: Graph, cos_name: str, sin_name: str, width: int) -> bool:
    """Row 0 is cos = a, sin = 0 and every row has cos^2 + sin^2 = a^2: a RoPE table pair,
    scaled by a > 0 (1, or longrope's attention factor, which the op's product carries)."""
    cos, sin = g.const(cos_name), g.const(sin_name)
    half = width // 2
    if cos is None or sin is None or cos.dtype != np.float32 or cos.shape != sin.shape or \
            cos.ndim != 2 or cos.shape[1] != width or width % 2:
        return False
    scale = float(cos[0, 0])
    return bool(np.array_equal(cos[:, :half], cos[:, half:])
                and np.array_equal(sin[:, :half], sin[:, half:])
                and scale > 0 and np.all(cos[0] == scale) and np.all(sin[0] == 0.0)
                and np.allclose(cos * cos + sin * sin, scale * scale, atol=1e-5 * scale * scale))


def _match_rope(g: Graph, out: str, heads: int, head_dim: int) -> _Rope | None:
    """``reshape(x * cos + cat(-x2, x1) * sin)`` with ``x = reshape(lin, [-1, heads, D])``, or
    ``x`` any float ``[T, heads, D]`` tensor (a per-head norm's output). With a partial rotary
    factor (Phi-4-mini) the rotation is on ``x[..., :R]`` and ``x[..., R:]`` is concatenated
    after it."""
    flat = g.producer.get(out)
    if flat is None or flat.op_type != "Reshape" or \
            _ints(g, flat.input[1]) != [-1, heads * head_dim]:
        return None
    add = g.producer.get(flat.input[0])
    outer: list[onnx.NodeProto] = []  # the partial form's Concat, pass-through and rotated Slice
    rest = None
    if add is not None and add.op_type == "Concat" and len(add.input) == 2 and \
            _attrs(add).get("axis") in (-1, 2) and g.only_used_by(add.output[0], [flat]):
        joint = add
        add, rest = g.producer.get(joint.input[0]), g.producer.get(joint.input[1])
        if rest is None or not g.only_used_by(rest.output[0], [joint]):
            return None
        outer = [joint, rest]
    if add is None or add.op_type != "Add" or \
            not g.only_used_by(add.output[0], outer[:1] or [flat]):
        return None
    muls = [m for i in add.input if (m := g.producer.get(i)) is not None
            and m.op_type == "Mul" and g.only_used_by(m.output[0], [add])]
    if len(muls) != 2:
        return None
    concats = [[p for i in m.input if (p := g.producer.get(i)) is not None
                and p.op_type == "Concat"] for m in muls]
    if sorted(map(len, concats)) != [0, 1]:
        return None
    m_cos, m_sin = muls if concats[1] else muls[::-1]
    cat = (concats[0] or concats[1])[0]
    neg = g.producer.get(cat.input[0]) if len(cat.input) == 2 else None
    if neg is None or neg.op_type != "Neg" or _attrs(cat).get("axis") not in (-1, 2):
        return None
    s1, s2 = g.producer.get(neg.input[0]), g.producer.get(cat.input[1])
    if s1 is None or s2 is None or len(s2.input) < 3:
        return None
    xr = s2.input[0]  # the rotated part: x, or x[..., :R]
    ends = _ints(g, s2.input[2])
    half = ends[0] if ends and len(ends) == 1 else 0
    rotary = 2 * half
    if not (0 < rotary <= head_dim and _slice_is(g, s1, xr, half, -1)
            and _slice_is(g, s2, xr, 0, half)) or (rest is None) != (rotary == head_dim):
        return None
    x, x_users = xr, [m_cos, s1, s2]
    if rest is not None:
        piece = g.producer.get(xr)
        x = piece.input[0] if piece is not None else ""
        if not (_slice_is(g, piece, x, 0, rotary) and _slice_is(g, rest, x, rotary, -1)
                and g.only_used_by(xr, x_users)):
            return None
        assert piece is not None  # _slice_is checked it
        outer.append(piece)
        x_users = [piece, rest]
    view = g.producer.get(x)
    if view is None or view.op_type != "Reshape" or \
            _ints(g, view.input[1]) != [-1, heads, head_dim]:
        dims = float_dims(g, x)
        if dims is None or len(dims) != 3 or list(dims[1:]) != [heads, head_dim]:
            return None
        view = None
    cos_u = next((i for i in m_cos.input if i != xr), "")
    sin_u = next((i for i in m_sin.input if i != cat.output[0]), "")
    cos_rows, sin_rows = _table_rows(g, cos_u), _table_rows(g, sin_u)
    if xr not in m_cos.input or cos_rows is None or sin_rows is None or \
            cos_rows[1] != sin_rows[1] or not _tables_ok(g, cos_rows[0], sin_rows[0], rotary):
        return None
    nodes = [s1, neg, s2, cat, m_cos, m_sin, add, flat, *outer]
    inner = [(s1.output[0], [neg]), (neg.output[0], [cat]), (s2.output[0], [cat]),
             (cat.output[0], [m_sin])]
    if view is not None:  # the view goes too, unless something else reads x
        inner.append((x, x_users))
        nodes.insert(0, view)
    if not all(g.only_used_by(t, users) for t, users in inner):
        return None
    lin = x if view is None else view.input[0]
    return _Rope(lin, cos_rows[0], sin_rows[0], cos_rows[1], nodes, per_head=view is None,
                 rotary_dim=rotary)


def fuse_rotary(g: Graph) -> tuple[Counter, Counter]:
    """RoPE on each PagedAttention node's q and k -> com.microsoft.RotaryEmbedding.

    The op takes ``[batch, seq, heads * D]``: the packed tokens are one batch row, position
    offset 0, and its cache is the step's own rows of the model's tables (gathered once per
    step; the half of each row, as its halves repeat)."""
    applied: Counter = Counter()
    skipped: Counter = Counter()
    caches: dict[tuple[str, str, str], tuple[str, str]] = {}
    consts: dict[str, str] = {}
    for pa in [n for n in g.nodes if n.op_type == ONNX_OP_TYPE and n.domain == ONNX_DOMAIN]:
        a = _attrs(pa)
        head_dim = int(a["head_dim"])
        for index, heads in ((0, int(a["num_heads"])), (1, int(a["num_kv_heads"]))):
            rope = _match_rope(g, pa.input[index], heads, head_dim)
            if rope is None:
                skipped[ROPE] += 1
                continue
            if not consts:
                consts["zero"] = g.add_init("kvflow_zero", np.array([0], dtype=np.int64))
            key = (rope.cos_table, rope.sin_table, rope.positions)
            if key not in caches:
                caches[key] = _gather_caches(g, rope)
            cos_rows, sin_rows = caches[key]
            out = pa.input[index]
            lin3, rot3 = g.unique(f"{out}.batch"), g.unique(f"{out}.rotated")
            dims = g.dims(rope.lin)
            shape = [1, dims[0], heads * head_dim] if dims else None
            for t in (lin3, rot3):
                g.add_value_info(t, TensorProto.FLOAT, shape)
            if rope.per_head:  # [T, heads, D] -> [1, T, heads * D]
                batch_key = f"batch_{heads * head_dim}"
                if batch_key not in consts:
                    consts[batch_key] = g.add_init(
                        f"kvflow_{batch_key}", np.array([1, -1, heads * head_dim], np.int64))
                batch = g.node("Reshape", [rope.lin, consts[batch_key]], [lin3])
            else:
                batch = g.node("Unsqueeze", [rope.lin, consts["zero"]], [lin3])
            g.replace(rope.nodes, [
                batch,
                g.node(ROPE, [lin3, consts["zero"], cos_rows, sin_rows], [rot3],
                       domain=MS_DOMAIN, num_heads=heads, interleaved=0,
                       **({"rotary_embedding_dim": rope.rotary_dim}
                          if rope.rotary_dim != head_dim else {})),
                g.node("Squeeze", [rot3, consts["zero"]], [out]),
            ])
            applied[ROPE] += 1
    return applied, skipped


def _gather_caches(g: Graph, rope: _Rope) -> tuple[str, str]:
    half = rope.rotary_dim // 2
    tokens = (g.dims(rope.positions) or [None])[0]
    names = []
    nodes = []
    for tag, table in (("cos", rope.cos_table), ("sin", rope.sin_table)):
        values = g.const(table)
        assert values is not None  # checked by _tables_ok
        init = g.add_init(f"kvflow_rope_{tag}_table", values[:, :half])
        rows = g.unique(f"kvflow_rope_{tag}")
        g.add_value_info(rows, TensorProto.FLOAT, [tokens, half])
        nodes.append(g.node("Gather", [init, rope.positions], [rows], axis=0))
        names.append(rows)
    g.replace([], nodes, rank=-1.0)
    return names[0], names[1]
