"""Compile ``model.onnx`` into a TensorRT plan with Polygraphy: the ``--backend tensorrt`` step
of build-engine.

The same three calls a TensorRT user writes by hand or on Polygraphy's command line::

    network = network_from_onnx_path("model.onnx", strongly_typed=True)
    config = CreateConfig(profiles=[profile], memory_pool_limits={WORKSPACE: ...})
    plan = engine_bytes_from_network(network, config)

The ONNX graph is exported in the engine's dtype (fp16 or bf16) and parsed into a strongly
typed network: TensorRT keeps the types the graph states. Each PagedAttention node becomes the
``kvflow::PagedAttention`` plugin of :mod:`kvflow.plugins.tensorrt_plugin` (registered by
importing it, before the parse). One optimization profile covers every step the build limits
allow (:func:`kvflow.build.profile.profile_shapes`). Before building, the network is inspected
(:func:`network_report`) for ``build_report.json``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from kvflow.build.engine_config import BuildLimits
from kvflow.build.profile import profile_shapes
from kvflow.build.report import PLUGIN_OP, metadata_report, quiet_polygraphy
from kvflow.model.config import ModelConfig


class TensorRTBuildError(RuntimeError):
    """The ONNX parser or the builder refused the network."""


def network_report(network: Any) -> dict[str, Any]:
    """Polygraphy's inspection of a parsed TensorRT network, as data: layers, layer types,
    layer precisions, plugin layers, inputs and outputs."""
    import polygraphy
    import tensorrt as trt
    from polygraphy.backend.trt import util as trt_util

    layers = [network.get_layer(i) for i in range(network.num_layers)]
    # NOTE: by name: a TensorRT release may drop the older plugin layer types.
    plugin_types = {getattr(trt.LayerType, t) for t in ("PLUGIN", "PLUGIN_V2", "PLUGIN_V3")
                    if hasattr(trt.LayerType, t)}
    plugins = [layer for layer in layers if layer.type in plugin_types]
    _, inputs = trt_util.get_network_input_names_meta(network)
    _, outputs = trt_util.get_network_output_names_meta(network)
    return {
        "inspected_by": f"polygraphy {polygraphy.__version__}, TensorRT {trt.__version__}",
        "num_layers": len(layers),
        "layer_types": dict(Counter(layer.type.name for layer in layers).most_common()),
        "layer_precisions": dict(Counter(layer.precision.name for layer in layers)
                                 .most_common()),
        "num_plugins": len(plugins),
        "plugins": {PLUGIN_OP: len(plugins)},
        "inputs": metadata_report(inputs),
        "outputs": metadata_report(outputs),
        "summary": trt_util.str_from_network(network),
    }


def build_plan(onnx_path: Path, plan_path: Path, limits: BuildLimits, cfg: ModelConfig,
               workspace_bytes: int = 4 << 30) -> dict[str, Any]:
    """Parse ``onnx_path``, build for ``limits`` and write the serialized plan; returns the
    network's inspection (:func:`network_report`)."""
    import tensorrt as trt
    from polygraphy.backend.trt import (
        CreateConfig,
        Profile,
        engine_bytes_from_network,
        network_from_onnx_path,
    )
    from polygraphy.exception import PolygraphyException

    from kvflow.plugins import tensorrt_plugin  # registers kvflow::PagedAttention

    quiet_polygraphy()
    # NOTE: TensorRT 11 makes every network strongly typed and may drop the flag.
    typed = hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED") or None
    try:
        builder, network, parser = network_from_onnx_path(str(onnx_path), strongly_typed=typed)
    except PolygraphyException as e:
        raise TensorRTBuildError(f"TensorRT's ONNX parser refused {onnx_path}: {e}") from None
    shapes = profile_shapes(limits, cfg)
    profile = Profile()
    for i in range(network.num_inputs):
        name = network.get_input(i).name
        if name not in shapes:
            raise TensorRTBuildError(f"unexpected engine input {name!r} in {onnx_path}")
        lo, opt, hi = shapes[name]
        profile.add(name, min=lo, opt=opt, max=hi)
    report = network_report(network)
    config = CreateConfig(profiles=[profile],
                          memory_pool_limits={trt.MemoryPoolType.WORKSPACE: workspace_bytes})
    try:
        with tensorrt_plugin.building():
            plan = engine_bytes_from_network((builder, network, parser), config)
    except PolygraphyException as e:
        raise TensorRTBuildError(f"TensorRT could not build the engine: {e}") from None
    plan_path.write_bytes(bytes(plan))
    return report
