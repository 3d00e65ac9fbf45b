"""The last layer after its attention, on the logits rows only, for
:mod:`kvflow.runtime.ort_graph`.

The exported graph runs every layer on every token and gathers the rows whose logits the step
wants (``logits_indices``) before the final norm. Everything between the last PagedAttention
and that gather (o_proj, residual, norm, MLP) is row by row, so it may as well run on those
rows only: the gather moves up to the tensors that enter that part (the attention output and
the residual stream). A prefill chunk then computes its last layer's MLP for one row, not for
every token; and the last residual ``Add`` meets the final norm, which fuses it.
"""

from __future__ import annotations

from collections import Counter

import onnx
from onnx import TensorProto, helper

from kvflow.plugins.op_names import ONNX_DOMAIN, ONNX_OP_TYPE
from kvflow.runtime.ort_graph_edit import Graph

ROWS = "logits_rows_early"
# Ops that compute each row from that row alone (given the checks in _row_wise).
_ELEMENTWISE = {"Add", "Mul", "Sub", "Div", "Pow", "Sqrt", "Reciprocal", "Neg", "Sigmoid",
                "QuickGelu", "Cast", "Tanh", "Erf", "Gelu"}


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _row_wise(g: Graph, node: onnx.NodeProto, rows: set[str]) -> bool:
    """``node`` maps the rows of its row-indexed inputs (``rows``) row by row."""
    a = _attrs(node)
    axes = g.const(node.input[1]) if len(node.input) > 1 and node.input[1] else None
    if node.op_type in _ELEMENTWISE:
        return True
    if node.op_type == "MatMul":
        return node.input[0] in rows and node.input[1] not in rows
    if node.op_type == "Gemm":
        return node.input[0] in rows and node.input[1] not in rows and \
            a.get("transA", 0) == 0
    if node.op_type in ("ReduceMean", "ReduceSum"):
        return axes is not None and list(axes.ravel()) == [-1]
    if node.op_type == "Reshape":
        return axes is not None and int(axes.ravel()[0]) == -1 and \
            all(int(v) > 0 for v in axes.ravel()[1:]) and a.get("allowzero", 0) in (0, 1)
    if node.op_type == "Split":
        return a.get("axis", 0) in (-1, 1)
    return False


def _dynamic(g: Graph) -> set[str]:
    """Tensors that depend on a graph input (the rest are constants)."""
    out = {i.name for i in g.model.graph.input}
    for n in sorted(g.nodes, key=lambda n: g.rank[id(n)]):
        if any(i in out for i in n.input):
            out.update(o for o in n.output if o)
    return out


def _picks_rows(g: Graph, node: onnx.NodeProto) -> bool:
    """``node`` is ``GatherND(x, Unsqueeze(indices, -1))``: rows of an activation ``x``."""
    index = g.producer.get(node.input[1]) if node.op_type == "GatherND" else None
    if index is None or index.op_type != "Unsqueeze" or len(index.input) < 2 or \
            _attrs(node).get("batch_dims", 0) != 0 or node.input[0] in g.inits:
        return False
    axes = g.const(index.input[1])
    return axes is not None and list(axes.ravel()) == [-1]


def gather_logit_rows_early(g: Graph) -> tuple[Counter, Counter]:
    """Move the logits row gather up to right after the last PagedAttention node."""
    attention = [n for n in g.nodes if n.op_type == ONNX_OP_TYPE and n.domain == ONNX_DOMAIN]
    gathers = [n for n in g.nodes if _picks_rows(g, n)]
    if not attention or len(gathers) != 1:
        return Counter(), Counter({ROWS: 1})
    gather = gathers[0]
    last = max(attention, key=lambda n: g.rank[id(n)])
    tokens = (g.dims(last.input[0]) or [None])[0]
    picked = (g.dims(gather.output[0]) or [None])[0]
    # The tail: nodes between the last attention and the gather, that the gather depends on.
    dynamic = _dynamic(g)
    tail: list[onnx.NodeProto] = []
    todo, seen = [gather.input[0]], set()
    while todo:
        node = g.producer.get(todo.pop())
        if node is None or id(node) in seen or node is last:
            continue
        seen.add(id(node))
        if g.rank[id(node)] > g.rank[id(last)]:
            tail.append(node)
            todo.extend(i for i in node.input if i in dynamic)
    tail.sort(key=lambda n: g.rank[id(n)])
    made = {o for n in tail for o in n.output}
    entering = list(dict.fromkeys(i for n in tail for i in n.input
                                  if i in dynamic and i not in made))
    rows = made | set(entering)
    ok = bool(tail) and tokens is not None and picked is not None and \
        all(_row_wise(g, n, rows) for n in tail) and \
        all((g.dims(i) or [None])[0] == tokens for i in entering) and \
        all(c is gather or id(c) in {id(t) for t in tail}
            for o in made for c in g.consumers[o]) and not made & g.outputs and \
        gather.output[0] not in g.outputs
    if not ok:
        return Counter(), Counter({ROWS: 1})
    start = min(g.rank[id(n)] for n in tail)
    new = []
    renames = {}
    for name in entering:
        renames[name] = g.unique(f"{name}.logit_rows")
        new.append(g.node("GatherND", [name, gather.input[1]], [renames[name]], batch_dims=0))
        dims = g.dims(name)
        g.add_value_info(renames[name], TensorProto.FLOAT,
                         [picked, *dims[1:]] if dims else None)
    for n in tail:
        if renames.keys() & set(n.input):
            g.rewire(n, renames)
    g.replace([], new, rank=start - 1e-2)
    for name in made:
        dims = g.dims(name)
        if dims and dims[0] == tokens:
            vi = g.value_info[name]
            g.add_value_info(name, vi.type.tensor_type.elem_type, [picked, *dims[1:]])
    for c in list(g.consumers[gather.output[0]]):
        g.rewire(c, {gather.output[0]: gather.input[0]})
    g.replace([gather], [])
    return Counter({ROWS: 1}), Counter()
