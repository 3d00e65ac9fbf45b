"""The ONNX Runtime runner: the engine's ONNX graph on ORT's CPU provider.

At load (the file on disk stays the one artifact TensorRT compiles):

1. the graph, read without its weights, is fused for ORT (:mod:`kvflow.runtime.ort_graph`:
   RMSNorm, RoPE, Q/K/V and gate/up into ORT's own fused kernels); the weights are mapped from
   the engine's data file and a prepared-weights file made once (:mod:`kvflow.runtime.ort_weights`),
   never copied, and shared by every session;
2. ``kvflow::PagedAttention`` runs as a native ORT custom op
   (:mod:`kvflow.plugins.ort_custom_ops`, built at install), so that one session runs the whole
   step (:class:`~kvflow.runtime.ort_sessions.OneSession`). When that library cannot be built
   or loaded, the runner says why once and cuts the graph at its attention nodes instead,
   running kvflow's compiled host kernel between the pieces
   (:class:`~kvflow.runtime.ort_sessions.Segmented`);
3. intra-op threads follow the step's size, from a measurement (:mod:`kvflow.runtime.ort_threads`).

Quantized engines' blocked ``DequantizeLinear`` + ``MatMul`` pairs become fp32 weights
(``quantized_matmul=fp32``), or are multiplied as they are with activations quantized to int8
per block (``int8``): by kvflow's native ``kvflow::MatMulQ`` (llama.cpp's ``q4_1 x q8_1``
arithmetic, in the same library as the attention op), or without that library by ORT's
``MatMulNBits``. ``auto`` picks by step size: int8 for steps of at most
:data:`AUTO_INT8_MAX_TOKENS` tokens (decodes, where reading 4-bit weights wins), fp32 GEMM for
larger ones; without the native library auto is fp32 throughout, because ``MatMulNBits``'
int8 arithmetic costs 4.6x llama.cpp's KL divergence (docs/benchmarks.md). When the library
has its tiled int8 GEMM (``ort_custom_ops.native_gemm()``), auto is int8 at every step size:
no fp32 copy of a quantized weight exists at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from kvflow.build.engine_config import EngineConfig
from kvflow.model.quant import GGUF_SCHEMES
from kvflow.plugins import ort_custom_ops
from kvflow.runtime import ort_threads
from kvflow.runtime.base import (
    QUANTIZED_MATMUL_MODES,
    PoolRunner,
    StepInput,
    kv_cache_numpy_dtype,
)
from kvflow.runtime.kv_cache import HostKVPool
from kvflow.runtime.lora_pool import LoraPool, fused_groups
from kvflow.runtime.lora_runner import LoraSlots, ort_lora_feeds
from kvflow.runtime.ort_graph import FusionReport, fuse_for_ort
from kvflow.runtime.ort_graph_gather import gather_q_available
from kvflow.runtime.ort_graph_lora import add_lora_nodes
from kvflow.runtime.ort_sessions import (
    ARGMAX_OUTPUT,
    Executor,
    OneSession,
    Segmented,
    attention_nodes,
    session_options,
    with_argmax,
)
from kvflow.runtime.ort_threads import ThreadPolicy, ThreadSetting
from kvflow.runtime.ort_weights import (
    MappedWeights,
    PreparedWeights,
    ProgressFn,
    WeightSource,
    graph_data_files,
    resident_bytes,
)

logger = logging.getLogger(__name__)

ONNX_FILE = "model.onnx"
# quantized_matmul=auto: the most tokens a step runs with int8 activations. Measured on this
# AVX2 CPU per matmul (benchmarks/matmul_q.py, one thread): kvflow::MatMulQ beats fp32 GEMM at
# 8 rows (gate/up 532 vs 697 us, the LM head 9.3 vs 13.0 ms) and loses at 32 (head 37 vs 28 ms).
AUTO_INT8_MAX_TOKENS = 16
ATTENTION_MODES = ("auto", "native", "segmented")
KV_DTYPE_CODES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}  # the op's kv_dtype attribute
_warned: set[str] = set()


class OnnxRuntimeRunner(LoraSlots, PoolRunner):
    """Executes the engine's ONNX graph with ONNX Runtime over a host KV pool.

    ``attention``: ``native`` (the custom op, one session; an error if it cannot load),
    ``segmented`` (the fallback), or ``auto`` (native when it loads). ``threads``: a fixed
    intra-op thread count instead of the measured policy. ``max_loras`` > 0: a LoRA slot pool
    of that many adapters of rank up to ``max_lora_rank``, applied by ``kvflow::LoraMatMul``
    nodes inserted into the graph at load (:mod:`kvflow.runtime.ort_graph_lora`; needs the
    native op library; A and B in float16 on a quantized engine without
    ``quantized_matmul=fp32``). The pool's size is fixed with the sessions: :meth:`enable_lora`
    only confirms it.
    """

    pool: HostKVPool

    name = "onnxruntime"
    supports_lora = True

    def __init__(self, engine_dir: str | Path, engine: EngineConfig, num_blocks: int,
                 num_host_blocks: int = 0, threads: int | None = None,
                 quantized_matmul: str = "fp32", kv_cache_dtype: str = "fp32",
                 attention: str = "auto", max_loras: int = 0, max_lora_rank: int = 16) -> None:
        super().__init__(engine, num_blocks, num_host_blocks)
        path = Path(engine_dir) / engine.files.get("onnx", ONNX_FILE)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: the ONNX Runtime runner needs an engine built with "
                "--backend onnxruntime"
            )
        if quantized_matmul not in QUANTIZED_MATMUL_MODES:
            raise ValueError(f"quantized_matmul must be one of {QUANTIZED_MATMUL_MODES}, got "
                             f"{quantized_matmul!r}")
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {max_loras}")
        kv_dtype = kv_cache_numpy_dtype(kv_cache_dtype)
        m = engine.model
        self.pool = HostKVPool(m.num_hidden_layers, num_blocks, engine.limits.block_size,
                               m.num_key_value_heads, m.head_dim, kv_dtype, num_host_blocks)
        self.kv_cache_dtype = kv_cache_dtype
        self.lora: LoraPool | None = None
        try:
            if max_loras:
                # float16 A and B where the matmuls round anyway (int8 activations): half the
                # bytes per decode step; the fp32 path keeps them exact.
                exact = engine.quantization is None or quantized_matmul == "fp32"
                self.lora = LoraPool(fused_groups(m), m.num_hidden_layers, max_loras,
                                     max_lora_rank, np.float32 if exact else np.float16)
            self._load(path, engine, threads, quantized_matmul, kv_dtype, attention)
        except BaseException:
            self.close()
            raise
        finally:
            _release_freed_memory()

    def _load(self, path: Path, engine: EngineConfig, threads: int | None, quantized_matmul: str,
              kv_dtype: np.dtype, attention: str) -> None:
        library = None if attention == "segmented" else ort_custom_ops.library()
        if library is None and attention == "native":
            raise RuntimeError("attention=native: the ONNX Runtime PagedAttention op is "
                               f"unavailable: {ort_custom_ops.unavailable_reason()}")
        if library is None and self.lora is not None:
            why = ("attention=segmented" if attention == "segmented"
                   else ort_custom_ops.unavailable_reason())
            raise RuntimeError("LoRA on the onnxruntime runner needs its native op library "
                               f"(kvflow::LoraMatMul): {why}")
        if library is None and attention == "auto":
            _warn_once("the ONNX Runtime PagedAttention op is unavailable "
                       f"({ort_custom_ops.unavailable_reason()}); running the graph in "
                       "segments around kvflow's host attention kernel instead")
        self.attention = "native" if library is not None else "segmented"
        executor_cls = OneSession if library is not None else Segmented
        t0 = time.perf_counter()
        self._variants: list[tuple[int, ThreadPolicy, dict[ThreadSetting, Executor]]] = []
        self.fusions: list[FusionReport] = []  # each variant's, in variant order
        self.prepared: list[PreparedWeights] = []
        self.graphs: list[onnx.ModelProto] = []  # each variant's, as its sessions got it
        # The graph's weights are mapped, not copied (ort_weights): prepacking would make
        # private copies of mapped fp32 matmul weights. Quantized engines' fp32 weights are
        # DequantizeLinear folds, new tensors either way, so they keep ORT's packed GEMM.
        prepacking = engine.quantization is not None
        low = 1
        for variant in fused_variants(path.parent, engine, quantized_matmul, library):
            max_tokens, int8, model = variant.max_tokens, variant.int8, variant.model
            fusion = variant.fusion
            self.fusions.append(fusion)
            self.prepared.append(variant.prepared)
            model = with_argmax(model)
            if self.lora is not None:
                add_lora_nodes(model, self.lora)
            if library is not None:
                for node in attention_nodes(model):
                    node.attribute.extend([
                        helper.make_attribute("kv_dtype", KV_DTYPE_CODES[kv_dtype]),
                        helper.make_attribute("num_blocks", self.num_blocks)])
            weights = MappedWeights.for_model(model, path.parent)
            self.graphs.append(model)

            def make(setting: ThreadSetting, int8: bool = int8, model: onnx.ModelProto = model,
                     weights: MappedWeights = weights) -> Executor:
                def opts() -> ort.SessionOptions:
                    return session_options(setting.threads, setting.spinning, int8, library,
                                           prepacking)
                return executor_cls(model, opts, weights)

            limits = engine.limits
            max_step = ort_threads.max_step_tokens(limits.max_model_len, limits.max_num_tokens,
                                                   limits.max_batch_size)
            probes = [t for t in ort_threads.probe_sizes(max_step)
                      if low <= t <= max_tokens] or [low]
            policy, executors = self._thread_policy(path, threads, make, probes, int8,
                                                    kv_dtype, fusion)
            self._variants.append((max_tokens, policy, executors))
            span = (f"steps of {low}-{max_tokens} tokens" if max_tokens < (1 << 62)
                    else f"steps of {low}+ tokens")
            logger.info("onnxruntime runner: %s attention, %s; %s activations for %s; "
                        "threads: %s", self.attention, fusion.summary(),
                        "int8" if int8 else "fp32", span, policy.describe())
            low = max_tokens + 1
        files = list(dict.fromkeys([*(f for p in self.prepared for f in p.data_files),
                                    *(p.path for p in self.prepared if p.entries)]))
        mapped, resident = resident_bytes(files)
        logger.info("onnxruntime runner: weights %.0f MB in files, %.0f MB mapped, %.0f MB of "
                    "them resident; loaded in %.1f s%s",
                    sum(f.stat().st_size for f in files) / 1e6, mapped / 1e6, resident / 1e6,
                    time.perf_counter() - t0,
                    " (prepared weights written)" if any(p.written for p in self.prepared)
                    else "")

    def _thread_policy(self, path: Path, threads: int | None, make, probes: list[int],
                       int8: bool, kv_dtype: np.dtype, fusion: FusionReport):
        if threads is not None:
            setting = ThreadSetting(threads, False)
            return ThreadPolicy.fixed(setting), {setting: make(setting)}
        limits = self.engine.limits
        key = ort_threads.cache_key(path, attention=self.attention, int8=int8,
                                    kv_dtype=str(kv_dtype), probes=probes,
                                    fusion=fusion.summary(),
                                    lora=self.lora is not None,
                                    max_model_len=limits.max_model_len,
                                    max_batch_size=limits.max_batch_size)
        policy = ort_threads.cached_policy(key)
        if policy is not None:
            return policy, {s: make(s) for s in policy.settings}
        settings = ort_threads.candidate_settings(ort_threads.available_cores())
        policy, executors = ort_threads.measure(make, self._probe_feeds, "logits", settings,
                                                probes)
        if ort_threads.machine_is_busy():
            logger.info("onnxruntime runner: the machine was busy while the thread policy was "
                        "measured; it holds for this process only")
        else:
            ort_threads.store_policy(key, policy)
        return policy, executors

    def _probe_feeds(self, tokens: int) -> dict[str, np.ndarray]:
        """A step of ``tokens`` tokens that writes nothing and reads only the null block, laid
        out within the engine's limits (:func:`~kvflow.runtime.ort_threads.probe_layout`)."""
        limits = self.engine.limits
        seqs = ort_threads.probe_layout(tokens, limits.max_model_len, limits.max_batch_size)
        positions = np.concatenate([np.arange(s.context - s.new_tokens, s.context)
                                    for s in seqs]).astype(np.int64)
        query_start_loc = np.concatenate([[0], np.cumsum([s.new_tokens for s in seqs])])
        width = -(-max(s.context for s in seqs) // self.block_size)
        return self._feeds(StepInput(
            input_ids=np.zeros(tokens, np.int64), positions=positions,
            slot_mapping=np.full(tokens, -1, np.int64),
            block_tables=np.zeros((len(seqs), width), np.int32),
            seq_lens=np.array([s.context for s in seqs], np.int32),
            query_start_loc=query_start_loc.astype(np.int32),
            logits_indices=(query_start_loc[1:] - 1).astype(np.int64)))

    def _feeds(self, step: StepInput) -> dict[str, np.ndarray]:
        feeds = {"input_ids": step.input_ids, "positions": step.positions,
                 "kv_cache_ptrs": self.pool.ptrs, "slot_mapping": step.slot_mapping,
                 "block_tables": step.block_tables, "seq_lens": step.seq_lens,
                 "query_start_loc": step.query_start_loc,
                 "logits_indices": step.logits_indices}
        self.check_lora_step(step)
        if self.lora is not None:
            feeds.update(ort_lora_feeds(self.lora, step))
        return feeds

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        """Confirm the pool made with the runner (``max_loras``/``max_lora_rank``): the graph's
        LoRA nodes are fixed with its sessions, so a pool cannot be added or resized later."""
        have = (self.lora.max_loras, self.lora.max_rank) if self.lora is not None else (0, 0)
        if have != (max_loras, max_rank):
            raise ValueError(f"the onnxruntime runner's LoRA pool is fixed when it is made "
                             f"(max_loras {have[0]}, max_lora_rank {have[1]}); asked for "
                             f"{max_loras}, {max_rank}: pass max_loras and max_lora_rank to "
                             "create_runner")

    def close(self) -> None:
        self.close_lora()
        super().close()

    def executor_for(self, num_tokens: int) -> Executor:
        """The session(s) a step of ``num_tokens`` tokens runs on."""
        for max_tokens, policy, executors in self._variants:
            if num_tokens <= max_tokens:
                return executors[policy.setting_for(num_tokens)]
        raise AssertionError("the last variant covers every size")  # pragma: no cover

    def execute(self, step: StepInput) -> np.ndarray:
        return self.executor_for(step.num_tokens).run(self._feeds(step), "logits")

    def execute_argmax(self, step: StepInput) -> np.ndarray:
        """The step's argmax rows from the graph's own ArgMax: the logits stay inside ORT."""
        return self.executor_for(step.num_tokens).run(self._feeds(step), ARGMAX_OUTPUT)


@dataclass
class FusedVariant:
    """One precision variant of the graph, fused, its weights mapped (see :func:`plan`)."""

    max_tokens: int
    int8: bool
    model: onnx.ModelProto
    fusion: FusionReport
    prepared: PreparedWeights


def plan(engine: EngineConfig, quantized_matmul: str,
         library: Path | None) -> list[tuple[int, bool]]:
    """The precision variants by step size: (most tokens, int8 activations), in order."""
    quantized = engine.quantization is not None
    variants = [(1 << 62, quantized and quantized_matmul == "int8")]
    if quantized and quantized_matmul == "auto" and library is not None:
        variants = [(AUTO_INT8_MAX_TOKENS, True), (1 << 62, False)]
        # The tiled int8 GEMM: no fp32 copy for large steps, where MatMulQ takes every layer
        # (a GGUF's blocks; round-to-nearest engines' fp32 scales stay with MatMulNBits, whose
        # int8 would cost 4.6x the KL divergence in prefill too).
        gguf = set(str(engine.quantization).split("+")) <= set(GGUF_SCHEMES)
        if gguf and ort_custom_ops.native_gemm():
            variants = [(1 << 62, True)]
    limits = engine.limits
    max_step = ort_threads.max_step_tokens(limits.max_model_len, limits.max_num_tokens,
                                           limits.max_batch_size)
    # A variant for steps larger than the engine can run would never be used.
    variants = [v for i, v in enumerate(variants) if i == 0 or variants[i - 1][0] < max_step]
    variants[-1] = (1 << 62, variants[-1][1])
    return variants


def fused_variants(engine_dir: Path, engine: EngineConfig, quantized_matmul: str,
                   library: Path | None,
                   progress: ProgressFn | None = None) -> Iterator[FusedVariant]:
    """Each variant of :func:`plan`, its graph read without weights and fused, the weights the
    fusions make taken from (or written once to) its prepared-weights file."""
    path = Path(engine_dir) / engine.files.get("onnx", ONNX_FILE)
    exported = onnx.load(str(path), load_external_data=False)
    source = WeightSource(path.parent)
    data_files = graph_data_files(exported, path.parent)
    for max_tokens, int8 in plan(engine, quantized_matmul, library):
        # A graph that never runs with int8 activations also folds Q4_1's block minima
        # into its fp32 weights (ort_graph.fold_minima).
        # One with int8 activations runs them through kvflow::MatMulQ when the native
        # library loads (layers it cannot take stay ORT's MatMulNBits).
        native = int8 and library is not None
        options = {"fp32_matmul": not int8, "native_matmul": native,
                   "gather_q": native and gather_q_available(library)}
        prepared = PreparedWeights(path.parent, data_files, options, graph_file=path)
        model, fusion = fuse_for_ort(exported, weights=source, prepared=prepared,
                                     progress=progress, **options)
        source.release()  # what the fusions read (scales, sampled rows) is ORT's to map now
        yield FusedVariant(max_tokens, int8, model, fusion, prepared)
    source.close()


def prepare(engine_dir: Path, engine: EngineConfig,
            progress: Callable[[str], None] | None = None) -> None:
    """Make the prepared-weights file(s) (:mod:`kvflow.runtime.ort_weights`) the runner's
    default options need (``quantized_matmul=auto``, the native op library when it loads), so
    that the first load is fast: the build's last step. Idempotent: a file already made for
    this data file and these options is kept."""
    for _fused in fused_variants(Path(engine_dir), engine, "auto", ort_custom_ops.library(),
                                 progress=progress):
        pass


def _release_freed_memory() -> None:
    """Hand back to the OS the heap the load freed: the graph's protobuf copies and serialized
    bytes, which glibc otherwise keeps (measured on the default engine, fp32: 2.85 GB resident
    after load, 1.23 GB after this)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
