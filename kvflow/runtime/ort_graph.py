"""The engine's ONNX graph rewritten for ONNX Runtime's CPU provider, in memory, at load time.

The file on disk stays the one artifact TensorRT compiles; :func:`fuse_for_ort` returns a copy
in which:

- RMSNorm (``Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul``) is
  ``SimplifiedLayerNormalization``, and with the residual ``Add`` before it,
  ``com.microsoft.SkipSimplifiedLayerNormalization`` (its output 3, input + skip, keeps the
  residual's name for the next layer);
- RoPE (``Reshape, Slice, Neg, Concat, Mul, Add, Reshape``) is ``com.microsoft.RotaryEmbedding``
  on ``[1, T, H*D]``, its caches the model's own cos/sin tables' rows gathered once per step;
- linear layers that read one tensor (Q/K/V, gate/up) are one matmul over concatenated
  weights and a ``Split``, fp32 ``Gemm`` or blocked ``DequantizeLinear + MatMul`` alike
  (:mod:`kvflow.runtime.ort_graph_linear`);
- optionally, each GGUF-blocked matmul (Q4_1, Q4_0, Q8_0) is one ``kvflow::MatMulQ`` of the
  native op library: int8 activations per block and integer dot products, as llama.cpp's;
  and (when the library has it) the embedding ``Gather`` over a tied table is
  ``kvflow::GatherQ`` over the LM head's blocks (:mod:`kvflow.runtime.ort_graph_gather`).

The graph may come with its weights loaded, or without (``load_external_data=False``) plus a
:class:`~kvflow.runtime.ort_weights.WeightSource` and
:class:`~kvflow.runtime.ort_weights.PreparedWeights`: then the weights the fusions make are
written once to the prepared-weights file and the result references them (and the engine's own
data file) as external data, for ORT to map.

Every match is verified (constants, shapes, single consumers); a pattern that does not match
cleanly is left as it is and counted in the :class:`FusionReport`. Tensors that remain keep
their names, so the PagedAttention nodes and the graph's value_info are unchanged.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import onnx

from kvflow.runtime.ort_graph_edit import Graph
from kvflow.runtime.ort_graph_gather import gather_quantized_rows
from kvflow.runtime.ort_graph_linear import fold_minima, fuse_linear_groups, native_matmuls
from kvflow.runtime.ort_graph_norm import fuse_rms_norms, fuse_rotary
from kvflow.runtime.ort_graph_rows import gather_logit_rows_early
from kvflow.runtime.ort_weights import PreparedWeights, ProgressFn, WeightSource


@dataclass(frozen=True)
class FusionReport:
    """What :func:`fuse_for_ort` did.

    Attributes:
        nodes_before: nodes of the graph given.
        nodes_after: nodes of the fused graph.
        applied: fusion name -> times applied.
        skipped: fusion name -> candidates that did not match cleanly (left unfused).
    """

    nodes_before: int
    nodes_after: int
    applied: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        """One line: node counts and each fusion's count."""
        done = ", ".join(f"{k} {v}" for k, v in sorted(self.applied.items())) or "none"
        line = f"{self.nodes_before} -> {self.nodes_after} nodes ({done})"
        if any(self.skipped.values()):
            line += "; unmatched: " + ", ".join(
                f"{k} {v}" for k, v in sorted(self.skipped.items()) if v)
        return line


def fuse_for_ort(model: onnx.ModelProto, fp32_matmul: bool = False,
                 native_matmul: bool = False, gather_q: bool = False,
                 weights: WeightSource | None = None, prepared: PreparedWeights | None = None,
                 progress: ProgressFn | None = None) -> tuple[onnx.ModelProto, FusionReport]:
    """A fused copy of ``model`` (weights loaded) for ORT's CPU provider, and what was done.

    ``fp32_matmul``: the graph will only run with DequantizeLinear folded into fp32 weights
    (``session.disable_quant_qdq``, the runner's ``quantized_matmul="fp32"`` path), so Q4_1's
    block minima are folded into those weights too (:func:`fold_minima`). The default graph
    serves both paths. ``native_matmul``: the session will load the native op library
    (:mod:`kvflow.plugins.ort_custom_ops`); block-quantized matmuls it takes become
    ``kvflow::MatMulQ`` nodes (:func:`~kvflow.runtime.ort_graph_linear.native_matmuls`), before
    any minima folding; with ``gather_q`` (the library has ``kvflow::GatherQ``) the tied
    embedding too. ``weights``/``prepared``: see the module doc. ``model`` itself is not
    modified.
    """
    g = Graph(model, weights, prepared, progress)
    applied: Counter = Counter()
    skipped: Counter = Counter()
    fusions = [gather_logit_rows_early, fuse_rms_norms, fuse_rotary, fuse_linear_groups]
    if native_matmul:
        fusions.append(native_matmuls)
        if gather_q:
            fusions.append(gather_quantized_rows)
    if fp32_matmul:
        fusions.append(fold_minima)
    for fusion in fusions:
        done, missed = fusion(g)
        applied.update(done)
        skipped.update(missed)
    fused = g.finish()
    report = FusionReport(len(model.graph.node), len(fused.graph.node),
                          {k: v for k, v in applied.items() if v},
                          {k: v for k, v in skipped.items() if v})
    return fused, report
