"""``kvflow::LoraMatMul`` nodes inserted into the fused ORT graph, for multi-LoRA serving.

After :func:`~kvflow.runtime.ort_graph.fuse_for_ort`, each layer's Q/K/V is one matmul whose
product a ``Split`` cuts into q, k and v, gate/up likewise, and o_proj and down_proj are plain
matmuls (fp32 ``Gemm``, ``kvflow::MatMulQ``, or ``DequantizeLinear + MatMul`` with an optional
bias ``Add`` and Q4_1 minimum ``Gemm``). :func:`add_lora_nodes` finds each of those linear
units by its weight's name (``model.layers.{i}.{self_attn|mlp}.{module}``), and puts one
LoraMatMul between the unit's output and its consumers: ``y = LoraMatMul(y, x, lora_ptrs,
slots)``, the pool's group ``qkv``/``o``/``gate_up``/``down`` of that layer
(:func:`~kvflow.runtime.lora_pool.fused_groups`). The tensor names downstream do not change.

The graph gains the inputs ``lora_ptrs`` (the pool's addresses) and ``lora_slots`` (each
token's slot, or ``[0]`` when no token of the step has an adapter). Layers the graph runs on
the sampled rows only (:mod:`kvflow.runtime.ort_graph_rows` gathers the last layer's rows
early) read ``lora_logit_slots`` instead: ``lora_slots[logits_indices]``, which the runner feeds.
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np
import onnx
from onnx import TensorProto, helper

from kvflow.plugins.op_names import ONNX_DOMAIN
from kvflow.runtime.lora_pool import LoraPool

LORA_OP_TYPE = "LoraMatMul"  # kvflow/plugins/lora_matmul_ort.h
PTRS_INPUT = "lora_ptrs"
SLOTS_INPUT = "lora_slots"
LOGIT_SLOTS_INPUT = "lora_logit_slots"
_WEIGHT = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                     r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.")
# module of a unit's weight -> (pool group, parts the unit's output holds)
_GROUPS = {"q_proj": ("qkv", 3), "gate_proj": ("gate_up", 2), "o_proj": ("o", 1),
           "down_proj": ("down", 1)}
_MATMULS = ("Gemm", "MatMul", "MatMulQ")


class LoraGraphError(RuntimeError):
    """The graph has a target linear in a form the LoRA pass does not know."""


def add_lora_nodes(model: onnx.ModelProto, pool: LoraPool) -> int:
    """Insert the LoraMatMul nodes into ``model`` (in place) for ``pool``'s fused groups;
    returns how many. Raises LoraGraphError naming a layer whose units were not all found."""
    graph = model.graph
    inits = {t.name for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in graph.node:
        for i in n.input:
            consumers[i].append(n)
    logit_rows = _downstream(graph, consumers, "logits_indices")

    def weight_name(name: str) -> str:
        # Through the Q4_1 minima folding (Reshape, Add) and DequantizeLinear to the codes.
        node = producer.get(name)
        while node is not None and node.op_type in ("Reshape", "Add", "DequantizeLinear"):
            name = node.input[0]
            node = producer.get(name)
        return name

    found: dict[tuple[int, str], tuple[str, str]] = {}  # (layer, group) -> (x, unit output)
    for node in list(graph.node):
        if node.op_type not in _MATMULS or len(node.input) < 2:
            continue
        if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] not in inits:
            continue  # Q4_1's minimum Gemm, C = the unit's product so far
        match = _WEIGHT.search(weight_name(node.input[1]))
        if match is None or match.group(2) not in _GROUPS:
            continue
        layer, (group, parts) = int(match.group(1)), _GROUPS[match.group(2)]
        out = _unit_output(node.output[0], consumers, inits)
        split = consumers[out][0] if len(consumers[out]) == 1 else None
        if parts > 1 and (split is None or split.op_type != "Split"
                          or len(split.output) != parts):
            raise LoraGraphError(f"layer {layer}: the {group} linears are not one fused "
                                 f"matmul and a {parts}-way Split (fusion skipped?); LoRA on the "
                                 "onnxruntime runner needs them fused")
        found[layer, group] = (node.input[0], out)
    missing = [(i, g) for i in range(pool.num_layers) for g in pool.groups
               if (i, g) not in found]
    if missing:
        raise LoraGraphError(f"no {missing[0][1]} linear found for layer {missing[0][0]} "
                             f"({len(missing)} units missing) in the fused graph")
    order = {id(n): i for i, n in enumerate(graph.node)}
    inserts: list[tuple[int, onnx.NodeProto]] = []
    uses_logit_rows = False
    for (layer, group), (x, out) in found.items():
        lora_out = f"{out}.lora"
        for c in consumers[out]:
            c.input[:] = [lora_out if i == out else i for i in c.input]
        for o in graph.output:
            if o.name == out:
                raise LoraGraphError(f"{out} is a graph output; it cannot take a LoRA node")
        slots = LOGIT_SLOTS_INPUT if x in logit_rows else SLOTS_INPUT
        uses_logit_rows |= slots == LOGIT_SLOTS_INPUT
        g = pool.groups[group]
        node = helper.make_node(LORA_OP_TYPE, [out, x, PTRS_INPUT, slots], [lora_out],
                                name=f"kvflow_lora_{group}_{layer}", domain=ONNX_DOMAIN,
                                module=pool.row(layer, group), part_cols=list(g.out_features),
                                rank=pool.max_rank, num_slots=pool.max_loras,
                                weight_dtype=int(pool.dtype == np.float16))
        inserts.append((order[id(producer[out])], node))
    for position, node in sorted(inserts, key=lambda p: p[0], reverse=True):
        graph.node.insert(position + 1, node)
    graph.input.append(helper.make_tensor_value_info(PTRS_INPUT, TensorProto.INT64,
                                                     ["lora_rows", 3]))
    graph.input.append(helper.make_tensor_value_info(SLOTS_INPUT, TensorProto.INT32,
                                                     ["lora_tokens"]))
    if uses_logit_rows:
        graph.input.append(helper.make_tensor_value_info(LOGIT_SLOTS_INPUT, TensorProto.INT32,
                                                         ["lora_logit_tokens"]))
    return len(inserts)


def _unit_output(out: str, consumers: dict[str, list[onnx.NodeProto]], inits: set[str]) -> str:
    """The end of the linear unit whose matmul makes ``out``: past a bias ``Add`` and Q4_1's
    minimum ``Gemm`` (whose C is the product so far)."""
    while len(consumers[out]) == 1:
        c = consumers[out][0]
        bias_add = c.op_type == "Add" and any(i in inits for i in c.input if i != out)
        minimum = c.op_type == "Gemm" and len(c.input) == 3 and c.input[2] == out
        if not (bias_add or minimum):
            break
        out = c.output[0]
    return out


def _downstream(graph: onnx.GraphProto, consumers: dict[str, list[onnx.NodeProto]],
                source: str) -> set[str]:
    """Every tensor computed from ``source`` (the sampled rows' tensors, for logits_indices)."""
    seen: set[str] = set()
    todo = [source]
    while todo:
        for node in consumers.get(todo.pop(), []):
            for o in node.output:
                if o and o not in seen:
                    seen.add(o)
                    todo.append(o)
    return seen
