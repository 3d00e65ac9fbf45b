"""``kvflow build-engine``: checkpoint in, engine folder out.

An engine folder holds everything a server needs: ``engine_config.json`` (model shape, backend,
dtype, limits), the tokenizer and its chat template, and the backend's artifact: ``model.onnx`` +
``model.onnx.data`` (onnxruntime), ``weights.safetensors`` (torch), or ``model.plan`` (tensorrt);
and ``build_report.json``, what Polygraphy sees in the artifact (:mod:`kvflow.build.report`).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvflow.build.engine_config import (
    BACKEND_DTYPES,
    BACKENDS,
    QUANTIZED_BACKENDS,
    BuildLimits,
    EngineConfig,
    EngineConfigError,
    checkpoint_source,
)
from kvflow.build.report import PLUGIN_OP, REPORT_FILE, write_report

if TYPE_CHECKING:
    from kvflow.model.checkpoint_tensors import CheckpointTensors
    from kvflow.model.loader import Checkpoint

ProgressFn = Callable[[str], None]


def _print_progress(msg: str) -> None:
    print(f"[build-engine] {msg}", flush=True)


def tensorrt_available() -> str | None:
    """None when TensorRT, cuda-python and an NVIDIA GPU are usable; else the reason they are
    not."""
    try:
        import tensorrt
    except ImportError:
        tensorrt = None
    if getattr(tensorrt, "Builder", None) is None:  # missing, or only a namespace of stubs
        return "TensorRT is not installed (pip install 'kvflow[tensorrt]' on a GPU machine)"
    from kvflow.runtime.cuda_runtime import CudaError, device_count

    try:
        device_count()
    except (ImportError, CudaError) as e:
        return str(e)
    return None


def build_engine(
    model: str,
    output: str | Path,
    backend: str = "onnxruntime",
    dtype: str | None = None,
    max_model_len: int | None = None,
    max_num_tokens: int = 2048,
    max_batch_size: int = 64,
    block_size: int = 16,
    overwrite: bool = True,
    progress: ProgressFn = _print_progress,
    quantize: str | None = None,
    group_size: int = 32,
    checkpoint: Checkpoint | CheckpointTensors | None = None,
) -> EngineConfig:
    """Build an engine folder; see ``kvflow build-engine --help`` for the arguments.

    ``checkpoint``: ``model`` already opened (:func:`~kvflow.model.loader.open_checkpoint`) or
    loaded (:func:`~kvflow.model.loader.load_checkpoint`), so that several engines of one model
    convert its tokenizer once; it is not modified.

    The checkpoint is streamed: the graph is exported from a model without weights, then each
    weight is read, converted and written on its own (:mod:`kvflow.build.streamed_graph`).

    Weights: a GGUF's Q4_0 / Q4_1 / Q8_0 tensors stay quantized on ``--backend onnxruntime``
    unless ``dtype`` is given (``float32``: dequantized, exact to HF); ``quantize`` (``int4`` or
    ``int8``, ``group_size`` 32 or 128) rounds any checkpoint's linear weights to nearest.
    """
    from kvflow.model.quant import check_rtn_args

    if backend not in BACKENDS:
        raise EngineConfigError(f"--backend must be one of {BACKENDS}, got {backend!r}")
    if quantize is not None:
        try:
            check_rtn_args(quantize, group_size)
        except ValueError as e:
            raise EngineConfigError(str(e)) from None
        if backend not in QUANTIZED_BACKENDS:
            raise EngineConfigError(f"--quantize needs --backend in {QUANTIZED_BACKENDS}, got "
                                    f"{backend!r}")
    keep_gguf_quantization = dtype is None and quantize is None and backend in QUANTIZED_BACKENDS
    dtype = dtype or ("float16" if backend == "tensorrt" else "float32")
    if dtype not in BACKEND_DTYPES[backend]:
        raise EngineConfigError(
            f"--dtype {dtype!r} is not supported by --backend {backend} "
            f"(supported: {BACKEND_DTYPES[backend]})"
        )
    if backend == "tensorrt":
        reason = tensorrt_available()
        if reason:
            raise EngineConfigError(f"--backend tensorrt cannot build here: {reason}")
    # Validate the cheap arguments before loading gigabytes of weights.
    BuildLimits(max_model_len or 1 << 30, max_num_tokens, max_batch_size, block_size)

    from kvflow.build.streamed_graph import quantization_name, weight_plan
    from kvflow.model.loader import as_tensors, open_checkpoint

    t0 = time.perf_counter()
    progress(f"[1/4] opening {model} (weights are read one tensor at a time)")
    source = as_tensors(checkpoint) if checkpoint is not None else open_checkpoint(model)
    cfg = source.config
    limit = cfg.max_position_embeddings
    max_model_len = max_model_len or min(limit, 4096)
    if max_model_len > limit:
        raise EngineConfigError(
            f"--max-model-len {max_model_len} exceeds the model's limit of {limit} positions"
        )
    limits = BuildLimits(max_model_len, max_num_tokens, max_batch_size, block_size)
    progress(f"      {cfg.architecture}: {cfg.num_hidden_layers} layers, hidden "
             f"{cfg.hidden_size}, heads {cfg.num_attention_heads}/{cfg.num_key_value_heads}, "
             f"{cfg.num_parameters / 1e6:.1f}M parameters")

    out = Path(output)
    if out.exists() and overwrite:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    progress("[2/4] writing tokenizer and chat template")
    source.save_tokenizer(out)

    plan = weight_plan(source, dtype, quantize, group_size,
                       keep_gguf_quantization and backend != "torch")
    files: dict[str, str] = {}
    engine = EngineConfig(cfg, backend, dtype, limits, checkpoint_source(source.source), files,
                          quantization=quantization_name(plan, quantize, group_size))
    if backend == "torch":
        from kvflow.build.stream import write_safetensors

        progress("[3/4] writing weights.safetensors, tensor by tensor")
        names = [k for k in source.names()
                 if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
        write_safetensors(source, names, out / "weights.safetensors", progress)
        files["weights"] = "weights.safetensors"
        write_report(out, limits, cfg, backend, dtype)
        files["report"] = REPORT_FILE
    else:
        from kvflow.build.streamed_graph import write_streamed_graph

        progress(f"[3/4] exporting ONNX ({cfg.num_hidden_layers} PagedAttention nodes), then "
                 "its weights from the checkpoint")
        write_streamed_graph(source, plan, block_size, max_model_len, out, progress)
        files.update(_finish_graph(engine, out, progress))
    engine.save(out)
    if backend == "onnxruntime":
        _prepare_runtime_weights(out, engine, progress)
    progress(f"[4/4] engine written to {out} in {time.perf_counter() - t0:.1f}s")
    return engine


def _prepare_runtime_weights(out: Path, engine: EngineConfig, progress: ProgressFn) -> None:
    """The ONNX Runtime runner's prepared weights for its default options, made now so that
    the first load is fast (:func:`kvflow.runtime.ort_runner.prepare`)."""
    from kvflow.runtime.ort_runner import prepare

    progress("      preparing the ONNX Runtime weights for the default options")
    prepare(out, engine, progress)


def _quantized_weights(ckpt: Any, scheme: str, group_size: int) -> dict:
    """Round-to-nearest quantization of every linear layer's weight of ``ckpt``."""
    from kvflow.model.quant import quantize_rtn

    linear = (".self_attn.", ".mlp.")
    names = [k for k, v in ckpt.state_dict.items()
             if v.ndim == 2 and k.endswith(".weight") and any(p in k for p in linear)]
    head = "model.embed_tokens.weight" if ckpt.config.tie_word_embeddings else "lm_head.weight"
    names.append(head)
    return {k: quantize_rtn(ckpt.state_dict[k].numpy(), scheme, group_size) for k in names}


def write_graph_artifacts(net: Any, engine: EngineConfig, out: Path,
                          progress: ProgressFn = _print_progress,
                          quantized: dict | None = None) -> dict[str, str]:
    """Export ``net`` (a ``LlamaForCausalLM``) in the engine's dtype to ``out/model.onnx`` and,
    for ``--backend tensorrt``, compile ``out/model.plan``; returns the ``files`` entries.
    ``quantized``: block-quantized weights by name, put into the graph in their blocked form
    (:mod:`kvflow.build.quantize`). It holds the model in memory: ``build_engine`` streams
    instead (:mod:`kvflow.build.streamed_graph`); benchmarks and tests call this on weights
    they made."""
    import torch

    from kvflow.build.export import export_onnx, save_graph

    net = net.to(getattr(torch, engine.dtype)).eval()
    export_onnx(net, engine.limits.block_size, out / "model.onnx")
    files = {"onnx": "model.onnx", "onnx_data": "model.onnx.data"}
    if quantized:
        import onnx

        from kvflow.build.quantize import quantize_graph

        model = onnx.load(str(out / "model.onnx"))
        report = quantize_graph(model, quantized)
        save_graph(model, out / "model.onnx")
        schemes = ", ".join(f"{n} {s}" for s, n in report.schemes.most_common())
        progress(f"      quantized weights: {schemes} layers, {report.fp32_bytes / 1e6:.0f} MB "
                 f"-> {report.quantized_bytes / 1e6:.0f} MB")
    files.update(_finish_graph(engine, out, progress))
    return files


def _finish_graph(engine: EngineConfig, out: Path, progress: ProgressFn) -> dict[str, str]:
    """After ``out/model.onnx`` is written: the TensorRT plan (``--backend tensorrt``) and the
    build report; returns the ``files`` entries."""
    files = {"onnx": "model.onnx", "onnx_data": "model.onnx.data"}
    network = None
    if engine.backend == "tensorrt":
        from kvflow.build.tensorrt_build import build_plan

        progress("      compiling the TensorRT plan (Polygraphy)")
        network = build_plan(out / "model.onnx", out / "model.plan", engine.limits,
                             engine.model)
        files["plan"] = "model.plan"
    onnx_part = write_report(out, engine.limits, engine.model, engine.backend, engine.dtype,
                             out / "model.onnx", network)["onnx"]
    progress(f"      {REPORT_FILE}: {onnx_part['num_layers']} ONNX nodes, "
             f"{onnx_part['num_plugins']} {PLUGIN_OP} (polygraphy inspect model)")
    files["report"] = REPORT_FILE
    return files
