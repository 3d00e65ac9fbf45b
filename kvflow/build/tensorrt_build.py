"""Compile ``model.onnx`` into a TensorRT plan: the ``--backend tensorrt`` step of build-engine.

The ONNX graph is exported in the engine's dtype (fp16 or bf16) and parsed into a strongly
typed network: TensorRT keeps the types the graph states (since TensorRT 11 every network is
strongly typed; there is no FP16 builder flag to set). Each PagedAttention node becomes the
``kvflow::PagedAttention`` plugin of :mod:`kvflow.plugins.tensorrt_plugin`. One optimization
profile covers every step the build limits allow: ``num_tokens`` up to ``max_num_tokens``,
``num_seqs`` up to ``max_batch_size``, block tables up to ``max_model_len / block_size``
blocks wide.
"""

from __future__ import annotations

from pathlib import Path

from kvflow.build.engine_config import BuildLimits
from kvflow.model.config import ModelConfig


class TensorRTBuildError(RuntimeError):
    """The ONNX parser or the builder refused the network."""


def profile_shapes(limits: BuildLimits,
                   cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], ...]]:
    """(min, opt, max) shape of every engine input, from the build limits.

    ``opt`` is a decode batch at half the limits, the step a server runs most."""
    max_tokens, max_seqs = limits.max_num_tokens, limits.max_batch_size
    max_blocks = -(-limits.max_model_len // limits.block_size)
    opt_seqs = max(1, max_seqs // 2)
    opt_blocks = max(1, max_blocks // 2)
    tokens = ((1,), (min(opt_seqs, max_tokens),), (max_tokens,))
    layers = (cfg.num_hidden_layers, 2)
    return {
        "input_ids": tokens,
        "positions": tokens,
        "slot_mapping": tokens,
        "kv_cache_ptrs": (layers, layers, layers),
        "block_tables": ((1, 1), (opt_seqs, opt_blocks), (max_seqs, max_blocks)),
        "seq_lens": ((1,), (opt_seqs,), (max_seqs,)),
        "query_start_loc": ((2,), (opt_seqs + 1,), (max_seqs + 1,)),
        "logits_indices": ((1,), (opt_seqs,), (max_seqs,)),
    }


def build_plan(onnx_path: Path, plan_path: Path, limits: BuildLimits, cfg: ModelConfig,
               workspace_bytes: int = 4 << 30) -> None:
    """Parse ``onnx_path``, build for ``limits`` and write the serialized plan."""
    import tensorrt as trt

    from kvflow.plugins import tensorrt_plugin  # registers kvflow::PagedAttention

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TensorRTBuildError(f"TensorRT's ONNX parser refused {onnx_path}: {errors}")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    profile = builder.create_optimization_profile()
    shapes = profile_shapes(limits, cfg)
    for i in range(network.num_inputs):
        name = network.get_input(i).name
        if name not in shapes:
            raise TensorRTBuildError(f"unexpected engine input {name!r} in {onnx_path}")
        lo, opt, hi = shapes[name]
        profile.set_shape(name, trt.Dims(list(lo)), trt.Dims(list(opt)), trt.Dims(list(hi)))
    config.add_optimization_profile(profile)

    with tensorrt_plugin.building():
        plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise TensorRTBuildError("TensorRT could not build the engine (see its log above)")
    plan_path.write_bytes(bytes(plan))
