"""An editable view of an ONNX graph, for the rewrites of :mod:`kvflow.runtime.ort_graph`:
producers, consumers, constants, node replacement, and the final clean-up (dead nodes, a
topological order close to the original one)."""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvflow.plugins.op_names import ONNX_DOMAIN, ONNX_OP_TYPE
from kvflow.runtime.ort_weights import (
    INLINE_MAX_BYTES,
    PreparedWeights,
    ProgressFn,
    WeightSource,
    is_external,
)

MS_DOMAIN = "com.microsoft"


class Graph:
    """A mutable view of an ONNX graph for the rewrites: producers, consumers, constants.

    With ``weights`` (a graph read without its external data) constants are read through the
    mapped data file, and initializers the rewrites make are *deferred*: a placeholder with
    their dims and type, computed only if still used when the graph is finished, into
    ``prepared`` (:mod:`kvflow.runtime.ort_weights`), or found there from an earlier load.
    Without, every initializer is in memory, as ``onnx.load(path)`` gives them.
    """

    def __init__(self, model: onnx.ModelProto, weights: WeightSource | None = None,
                 prepared: PreparedWeights | None = None,
                 progress: ProgressFn | None = None) -> None:
        g = model.graph
        unloaded = [t.name for t in g.initializer if is_external(t)]
        if unloaded and weights is None:
            raise ValueError(f"the graph's weights are not loaded ({len(unloaded)} initializers "
                             f"in external data, e.g. {unloaded[0]!r}): fuse a model read with "
                             "onnx.load(path), which loads them, or give its WeightSource")
        if prepared is not None and weights is None:
            raise ValueError("prepared weights need the graph's WeightSource")
        self.weights = weights
        self.prepared = prepared
        self.progress = progress
        self.deferred: dict[str, Callable[[], np.ndarray]] = {}
        # codes initializer -> (its kvflow::MatMulQ blocks, how they were made): ort_graph_gather
        self.packed: dict[str, tuple] = {}
        self.memo: dict[tuple, bool] = {}  # checks of constants, by what they read
        self.model = model
        self._nodes = {id(n): n for n in g.node}
        self.rank = {key: float(i) for i, key in enumerate(self._nodes)}
        self.inits = {t.name: t for t in g.initializer}
        self.value_info = {v.name: v for v in (*g.input, *g.value_info, *g.output)}
        self.outputs = {o.name for o in g.output}
        self.names = {*self.inits, *self.value_info, *(o for n in self.nodes for o in n.output)}
        self._values: dict[str, np.ndarray] = {}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for n in self._nodes.values():
            self._link(n)

    @property
    def nodes(self) -> list[onnx.NodeProto]:
        return list(self._nodes.values())

    def _link(self, n: onnx.NodeProto) -> None:
        self.producer.update((o, n) for o in n.output if o)
        for i in dict.fromkeys(n.input):
            if i:
                self.consumers[i].append(n)

    def _unlink(self, n: onnx.NodeProto) -> None:
        for o in n.output:
            if self.producer.get(o) is n:
                del self.producer[o]
        for i in dict.fromkeys(n.input):
            if i:
                self.consumers[i] = [c for c in self.consumers[i] if c is not n]

    def const(self, name: str) -> np.ndarray | None:
        """The value of an initializer or a ``Constant`` node's output, else None."""
        if name in self._values:
            return self._values[name]
        value = None
        cache = True
        if name in self.deferred:
            value = self.deferred[name]()
            cache = value.nbytes < INLINE_MAX_BYTES  # recomputed rather than held
        elif name in self.inits and is_external(self.inits[name]):
            assert self.weights is not None
            value = self.weights.array(self.inits[name])
            cache = isinstance(value, np.memmap) or value.nbytes < INLINE_MAX_BYTES
        elif name in self.inits:
            value = numpy_helper.to_array(self.inits[name])
        elif (p := self.producer.get(name)) is not None and p.op_type == "Constant" \
                and p.attribute and p.attribute[0].name == "value":
            value = numpy_helper.to_array(p.attribute[0].t)
        if value is not None and cache:
            self._values[name] = value
        return value

    def dims(self, name: str) -> list | None:
        """Static shape of a tensor (ints, or dim_param strings), if recorded."""
        if name in self.inits:
            return list(self.inits[name].dims)
        vi = self.value_info.get(name)
        if vi is None or not vi.type.tensor_type.HasField("shape"):
            return None
        return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]

    def sole_consumer(self, name: str, op_type: str) -> onnx.NodeProto | None:
        users = self.consumers.get(name, [])
        if len(users) != 1 or name in self.outputs or users[0].op_type != op_type:
            return None
        return users[0]

    def only_used_by(self, name: str, nodes: list[onnx.NodeProto]) -> bool:
        ids = {id(n) for n in nodes}
        return name not in self.outputs and all(id(u) in ids for u in self.consumers[name])

    def _free_name(self, base: str) -> str:
        name, i = base, 0
        while name in self.names:
            i += 1
            name = f"{base}_{i}"
        return name

    def unique(self, base: str) -> str:
        name = self._free_name(base)
        self.names.add(name)
        return name

    def prepared_has(self, base: str, data_type: int) -> bool:
        """Whether the prepared-weights file already holds the initializer the next
        ``add_init(base, ...)`` of this type would make."""
        if self.prepared is None:
            return False
        entry = self.prepared.entries.get(self._free_name(base))
        return entry is not None and entry.data_type == data_type

    def add_init(self, base: str, array: np.ndarray | Callable[[], np.ndarray],
                 dims: list[int] | None = None, data_type: int | None = None) -> str:
        """A new initializer: ``array``, or a function that computes it (then ``dims`` and
        ``data_type`` say what it will be). Large ones are deferred when the graph has
        prepared weights (see the class doc); the rest are computed now."""
        name = self.unique(base)
        if callable(array):
            if self.prepared is None:
                array = array()
            else:
                assert dims is not None and data_type is not None
                return self._defer(name, array, dims, data_type)
        if self.prepared is not None and array.nbytes >= INLINE_MAX_BYTES:
            value = array
            return self._defer(name, lambda: value, list(array.shape),
                               helper.np_dtype_to_tensor_dtype(array.dtype))
        self.inits[name] = numpy_helper.from_array(np.ascontiguousarray(array), name)
        self._values[name] = array
        return name

    def _defer(self, name: str, make: Callable[[], np.ndarray], dims: list[int],
               data_type: int) -> str:
        placeholder = TensorProto(name=name, data_type=data_type, dims=dims)
        placeholder.data_location = TensorProto.EXTERNAL
        self.inits[name] = placeholder
        self.deferred[name] = make
        return name

    def cat_init(self, base: str, names: list[str], axis: int) -> str:
        """The concatenation of initializers ``names`` along ``axis`` (same type)."""
        first = self.inits[names[0]]
        dims = list(first.dims)
        dims[axis] = sum(int(self.inits[n].dims[axis]) for n in names)

        def make() -> np.ndarray:
            arrays = [self.const(n) for n in names]
            assert all(a is not None for a in arrays)
            return np.concatenate(arrays, axis=axis)  # type: ignore[arg-type]
        return self.add_init(base, make, dims, first.data_type)

    def reshape_init(self, base: str, source: str, dims: list[int]) -> str:
        """Initializer ``source`` with other ``dims``: the same bytes, so an externally
        stored one stays a reference to them (nothing is written)."""
        t = self.inits[source]
        if is_external(t) and source not in self.deferred:
            name = self.unique(base)
            alias = TensorProto()
            alias.CopyFrom(t)
            alias.name = name
            del alias.dims[:]
            alias.dims.extend(dims)
            self.inits[name] = alias
            return name

        def make() -> np.ndarray:
            value = self.const(source)
            assert value is not None
            return value.reshape(dims)
        return self.add_init(base, make, dims, t.data_type)

    def add_value_info(self, name: str, elem_type: int, dims: list | None) -> None:
        self.value_info[name] = helper.make_tensor_value_info(name, elem_type, dims)

    def node(self, op_type: str, inputs: list[str], outputs: list[str], **attrs) -> onnx.NodeProto:
        domain = attrs.pop("domain", "")
        return helper.make_node(op_type, inputs, outputs, name=self.unique(f"kvflow_{op_type}"),
                                domain=domain, **attrs)

    def replace(self, old: list[onnx.NodeProto], new: list[onnx.NodeProto],
                rank: float | None = None) -> None:
        """Swap ``old`` nodes for ``new`` ones, placed where the first of ``old`` was."""
        first = min(self.rank[id(n)] for n in old) if rank is None else rank
        for n in old:
            self._unlink(n)
            del self._nodes[id(n)]
        for k, n in enumerate(new):
            self.rank[id(n)] = first + (k + 1) / (len(new) + 2) * 1e-3
            self._nodes[id(n)] = n
            self._link(n)

    def rewire(self, node: onnx.NodeProto, renames: dict[str, str]) -> onnx.NodeProto:
        """Replace ``node`` (in its place) by a copy that reads ``renames[x]`` for each input
        ``x`` renamed; returns the copy. (The given model's nodes are never edited.)"""
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        for i, x in enumerate(copy.input):
            copy.input[i] = renames.get(x, x)
        self.rank[id(copy)] = self.rank[id(node)]
        self._unlink(node)
        del self._nodes[id(node)]
        self._nodes[id(copy)] = copy
        self._link(copy)
        return copy

    def finish(self) -> onnx.ModelProto:
        """The rewritten model: dead nodes dropped, nodes in a topological order close to the
        original one, unused initializers and value_info dropped."""
        nodes = self.nodes
        todo = [n for n in nodes if n.op_type == ONNX_OP_TYPE and n.domain == ONNX_DOMAIN]
        todo += [self.producer[o] for o in self.outputs if o in self.producer]
        seen: set[int] = set()
        live = set(self.outputs)
        while todo:
            n = todo.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            live.update(i for i in n.input if i)
            todo.extend(self.producer[i] for i in n.input if i in self.producer)
        kept = [n for n in nodes if id(n) in seen]
        order = _topological(kept, self.rank, {i.name for i in self.model.graph.input}
                             | set(self.inits))
        # Copy the model but its graph (whose weights would be copied only to be dropped).
        source = self.model.graph
        shell = onnx.GraphProto(name=source.name, doc_string=source.doc_string)
        shell.input.extend(source.input)
        shell.output.extend(source.output)
        shell.sparse_initializer.extend(source.sparse_initializer)
        shell.metadata_props.extend(source.metadata_props)
        out = onnx.ModelProto()
        for descriptor, value in self.model.ListFields():
            if descriptor.name != "graph":
                out.MergeFrom(onnx.ModelProto(**{descriptor.name: value}))
        out.graph.CopyFrom(shell)
        g = out.graph
        g.node.extend(order)
        self._materialize([name for name in self.inits if name in live and
                           name in self.deferred])
        g.initializer.extend(t for name, t in self.inits.items() if name in live)
        produced = {o for n in order for o in n.output}
        g.value_info.extend(v for name, v in self.value_info.items()
                            if name in produced and name not in self.outputs)
        if any(n.domain == MS_DOMAIN for n in order) and \
                not any(o.domain == MS_DOMAIN for o in out.opset_import):
            out.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
        return out


    def _materialize(self, names: list[str]) -> None:
        """Swap deferred placeholders for references into the prepared-weights file, making
        (or remaking, whole) the file when it lacks one."""
        if not names:
            return
        assert self.prepared is not None
        refs = {n: self.prepared.lookup(n, list(self.inits[n].dims), self.inits[n].data_type)
                for n in names}
        if any(r is None for r in refs.values()):
            made = self.prepared.write([(n, self.deferred[n]) for n in names], self.progress,
                                       None if self.weights is None else self.weights.release)
            for n in names:
                want = self.inits[n]
                if list(made[n].dims) != list(want.dims) or made[n].data_type != want.data_type:
                    raise AssertionError(f"prepared weight {n!r}: made {list(made[n].dims)} "
                                         f"type {made[n].data_type}, declared "
                                         f"{list(want.dims)} type {want.data_type}")
            refs = dict(made)
        for n in names:
            ref = refs[n]
            assert ref is not None
            self.inits[n] = ref
            self.deferred.pop(n)


def _topological(nodes: list[onnx.NodeProto], rank: dict[int, float],
                 available: set[str]) -> list[onnx.NodeProto]:
    """Kahn's algorithm, ready nodes taken in ``rank`` order."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    waiting = [0] * len(nodes)
    users: dict[int, list[int]] = defaultdict(list)
    for i, n in enumerate(nodes):
        for src in {producer[x] for x in n.input if x and x not in available and x in producer}:
            waiting[i] += 1
            users[src].append(i)
    ready = [(rank[id(n)], i) for i, n in enumerate(nodes) if waiting[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(nodes[i])
        for j in users[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, (rank[id(nodes[j])], j))
    if len(order) != len(nodes):
        raise ValueError("the rewritten graph has a cycle (a fusion bug)")
    return order


def float_dims(g: Graph, name: str) -> list | None:
    """``name``'s dims if it is known to be a float32 tensor (or of unknown type)."""
    vi = g.value_info.get(name)
    if vi is not None and vi.type.tensor_type.elem_type not in (0, TensorProto.FLOAT):
        return None
    return g.dims(name)
