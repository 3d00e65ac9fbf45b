"""``build_report.json``: what an engine build produced, as Polygraphy inspects it.

Every build that writes a graph (``--backend onnxruntime`` or ``tensorrt``) writes one beside
``engine_config.json``:

- ``profile``: each input's (min, opt, max) shape at the build limits (the TensorRT
  optimization profile; the ONNX Runtime runner takes the same shapes);
- ``onnx``: ``model.onnx`` as ``polygraphy inspect model`` sees it: nodes (with those of
  subgraphs), node types, the ``kvflow::PagedAttention`` plugin nodes, weights by element type,
  inputs and outputs with their symbolic shapes, and Polygraphy's text summary;
- ``tensorrt`` (TensorRT builds): the parsed network the same way: layers, layer types,
  layer precisions, plugin layers, I/O.

A ``--backend torch`` build has no graph; its report lists ``weights.safetensors`` instead.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from kvflow.build.engine_config import BuildLimits
from kvflow.build.profile import profile_shapes
from kvflow.model.config import ModelConfig

REPORT_FILE = "build_report.json"
PLUGIN_OP = "kvflow::PagedAttention"  # the plugin's name in ONNX (domain::op) and TensorRT


def quiet_polygraphy() -> None:
    """Polygraphy logs at INFO by default; a build prints its own progress."""
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR


def profile_report(limits: BuildLimits, cfg: ModelConfig) -> dict[str, dict[str, list[int]]]:
    return {name: {"min": list(lo), "opt": list(opt), "max": list(hi)}
            for name, (lo, opt, hi) in profile_shapes(limits, cfg).items()}


def metadata_report(meta: Any) -> dict[str, dict[str, Any]]:
    """A Polygraphy ``TensorMetadata`` as JSON: name -> element type and shape (symbolic
    dimensions by name, unknown ones as null)."""
    def dim(d: Any) -> Any:
        return d if isinstance(d, str) or d is None else int(d)

    return {name: {"dtype": str(m.dtype), "shape": [dim(d) for d in (m.shape or ())]}
            for name, m in meta.items()}


def onnx_report(onnx_path: Path) -> dict[str, Any]:
    """``polygraphy inspect model`` of an ONNX graph, as data (weights are not loaded)."""
    import onnx
    import polygraphy
    from polygraphy.backend.onnx import util as onnx_util

    quiet_polygraphy()
    model = onnx.load(str(onnx_path), load_external_data=False)
    graph = model.graph
    node_types = Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type
                         for n in graph.node)
    weights = Counter(onnx.helper.tensor_dtype_to_np_dtype(t.data_type).name
                      if t.data_type != onnx.TensorProto.UINT4 else "uint4"
                      for t in graph.initializer)
    return {
        "file": onnx_path.name,
        "inspected_by": f"polygraphy {polygraphy.__version__}",
        "opsets": {imp.domain or "ai.onnx": imp.version for imp in model.opset_import},
        "num_layers": onnx_util.get_num_nodes(model),
        "layer_types": dict(node_types.most_common()),
        "num_plugins": node_types[PLUGIN_OP],
        "plugins": {PLUGIN_OP: node_types[PLUGIN_OP]},
        "num_weights": len(graph.initializer),
        "weight_dtypes": dict(weights.most_common()),
        "inputs": metadata_report(onnx_util.get_input_metadata(graph)),
        "outputs": metadata_report(onnx_util.get_output_metadata(graph)),
        "summary": onnx_util.str_from_onnx(model),
    }


_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "U8": "uint8", "I8": "int8"}


def weights_report(path: Path) -> dict[str, Any]:
    """A safetensors file's tensors by element type (a torch build's artifact)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        names = list(f.keys())  # noqa: SIM118  (a safe_open handle, not a dict)
        dtypes = Counter(_SAFETENSORS_DTYPES.get(f.get_slice(k).get_dtype(), "other")
                         for k in names)
    return {"file": path.name, "num_weights": len(names),
            "weight_dtypes": dict(dtypes.most_common())}


def write_report(out: Path, limits: BuildLimits, cfg: ModelConfig, backend: str,
                 dtype: str, onnx_path: Path | None = None,
                 network: dict[str, Any] | None = None, extra: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """Write ``out/build_report.json`` and return it: of the ONNX graph at ``onnx_path``
    (else of ``weights.safetensors``); ``network``: the TensorRT network's inspection."""
    report: dict[str, Any] = {
        "backend": backend, "dtype": dtype,
        "limits": {"max_model_len": limits.max_model_len,
                   "max_num_tokens": limits.max_num_tokens,
                   "max_batch_size": limits.max_batch_size, "block_size": limits.block_size},
        "profile": profile_report(limits, cfg),
    }
    if onnx_path is not None:
        report["onnx"] = onnx_report(onnx_path)
    else:
        report["torch"] = weights_report(out / "weights.safetensors")
    if network is not None:
        report["tensorrt"] = network
    report.update(extra or {})
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report
