"""The fused ORT graph (kvflow.runtime.ort_graph) against the graph as exported: the same logits
through the segmented runner's sessions, over a prefill chunk, a mixed step and a decode step,
on fp32 and block-quantized tiny engines (RTN int4/int8 and GGUF Q4_1), both matmul paths; the
report's counts; and a pattern that does not match left alone, still correct."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from kvflow.build.engine_config import EngineConfig
from kvflow.kv_manager import KVCacheManager
from kvflow.plugins import ort_custom_ops
from kvflow.runtime.kv_cache import HostKVPool
from kvflow.runtime.ort_graph import FusionReport, fuse_for_ort
from kvflow.runtime.ort_sessions import (
    Executor,
    OneSession,
    Segmented,
    attention_nodes,
    session_options,
)
from kvflow.runtime.step_builder import SeqChunk, build_step

# Tolerances relative to the largest logit. fp32: the fused kernels sum in other orders
# (RMSNorm in one pass). int8 activations: any fp32-level change before a MatMulNBits re-draws
# its int8 rounding, which grows through the layers to the int8 path's own error (on the
# default model the exported graph's int8 logits are as far from the fused graph's as from the
# fp32 ones); and ORT turns the exported graph's o_proj and down_proj (MatMul + residual Add ->
# Gemm) of RTN engines into fp32 Gemms, the fused graph's into MatMulNBits like the others.
FP32_TOL = 2e-5
INT8_TOL = 3e-2
BUILD = {"max_model_len": 256, "max_num_tokens": 256, "max_batch_size": 16, "block_size": 4,
         "progress": lambda _msg: None}


@pytest.fixture(scope="module")
def quantized_engines(tiny_models, tmp_path_factory) -> dict[str, object]:
    """scheme -> engine folder of llama-gqa4 with block-quantized weights: RTN int4/int8 from
    the builder, and GGUF Q4_1 blocks (gguf-py's own quantizer) put in as the builder does."""
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    from kvflow.build.builder import build_engine, write_graph_artifacts
    from kvflow.build.engine_config import BuildLimits, checkpoint_source
    from kvflow.model.llama import LlamaForCausalLM
    from kvflow.model.loader import load_checkpoint
    from kvflow.model.quant import from_gguf_blocks

    folder, _ = tiny_models["llama-gqa4"]
    root = tmp_path_factory.mktemp("fused")
    out = {}
    for scheme in ("int4", "int8"):
        out[scheme] = root / scheme
        build_engine(str(folder), out[scheme], quantize=scheme, group_size=32, **BUILD)
    ckpt = load_checkpoint(str(folder))
    weights = {}
    for name, w in ckpt.state_dict.items():
        if w.ndim == 2 and name.endswith("_proj.weight") or name == "lm_head.weight":
            blocks = gguf_quantize(w.numpy(), GGMLQuantizationType.Q4_1)
            weights[name] = from_gguf_blocks("Q4_1", blocks, *w.shape)
    limits = BuildLimits(256, 256, 16, 4)
    engine = EngineConfig(ckpt.config, "onnxruntime", "float32", limits,
                          checkpoint_source(ckpt.source), {}, quantization="Q4_1")
    net = LlamaForCausalLM(ckpt.config, limits.block_size, limits.max_model_len)
    net.load_hf_state_dict(ckpt.state_dict)
    out["Q4_1"] = root / "Q4_1"
    out["Q4_1"].mkdir()
    with torch.no_grad():
        engine.files.update(write_graph_artifacts(net, engine, out["Q4_1"], lambda _m: None,
                                                  weights))
    engine.save(out["Q4_1"])
    return out


def steps(block_size: int) -> Iterator:
    """A prefill chunk, then a mixed step (a prefill's last chunk + a decode), then a decode
    step of both: two sequences with fixed tokens, in one KV manager."""
    kv = KVCacheManager(64, block_size)
    rng = np.random.default_rng(5)
    a = rng.integers(3, 320, size=14).tolist()
    b = rng.integers(3, 320, size=6).tolist()
    plan = [[("a", a[:9], 0, 9, False), ("b", b[:5], 0, 5, True)],
            [("a", a[:13], 9, 4, True), ("b", b[:6], 5, 1, True)],
            [("a", a, 13, 1, True), ("b", b + [7], 6, 1, True)]]
    for step in plan:
        for rid, _tokens, start, n, _sample in step:
            assert kv.allocate_slots(rid, start + n)
        yield build_step(kv, [SeqChunk(rid, tokens, start, n, sample)
                              for rid, tokens, start, n, sample in step])


def run_steps(model: onnx.ModelProto, engine: EngineConfig, int8: bool,
              native: bool = False) -> list[np.ndarray]:
    """Each step's logits through the segmented runner's sessions (or, ``native``, one session
    with the ORT PagedAttention op) over a fresh KV pool."""
    if native:
        model = onnx.ModelProto.FromString(model.SerializeToString())
        for node in attention_nodes(model):
            node.attribute.extend([helper.make_attribute("kv_dtype", 0),
                                   helper.make_attribute("num_blocks", 64)])
        executor: Executor = OneSession(model, session_options(
            1, False, int8, ort_custom_ops.library()))
    else:
        executor = Segmented(model, session_options(1, False, int8))
    return executor_logits(executor, engine)


def executor_logits(executor: Executor, engine: EngineConfig) -> list[np.ndarray]:
    """Each step of :func:`steps` through ``executor``, over a fresh KV pool of 64 blocks."""
    m = engine.model
    pool = HostKVPool(m.num_hidden_layers, 64, engine.limits.block_size,
                      m.num_key_value_heads, m.head_dim)
    try:
        return [executor.run({
            "input_ids": s.input_ids, "positions": s.positions, "kv_cache_ptrs": pool.ptrs,
            "slot_mapping": s.slot_mapping, "block_tables": s.block_tables,
            "seq_lens": s.seq_lens, "query_start_loc": s.query_start_loc,
            "logits_indices": s.logits_indices}, "logits")
            for s in steps(engine.limits.block_size)]
    finally:
        pool.close()


def assert_same_logits(model: onnx.ModelProto, fused: onnx.ModelProto, engine: EngineConfig,
                       int8: bool = False, native: bool = False) -> None:
    """The fused graph's logits (segmented, or ``native``) against the exported graph's
    (segmented) over :func:`steps`."""
    tol = INT8_TOL if int8 else FP32_TOL
    for ref, got in zip(run_steps(model, engine, int8), run_steps(fused, engine, int8, native),
                        strict=True):
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=0, atol=tol * np.abs(ref).max())


def expect_every_layer(report: FusionReport, layers: int) -> None:
    assert report.nodes_after < report.nodes_before
    assert report.applied["RotaryEmbedding"] == 2 * layers
    assert report.applied["qkv_matmul"] == layers
    assert report.applied["gate_up_matmul"] == layers
    # Norms: each layer's two, and the final one; all but the first read a residual Add (the
    # final one too, once the logits rows are gathered before the last layer's MLP).
    assert report.applied["logits_rows_early"] == 1
    assert report.applied["SimplifiedLayerNormalization"] == 1
    assert report.applied["SkipSimplifiedLayerNormalization"] == 2 * layers
    assert not report.skipped


def file_hash(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", ["llama-gqa4", "llama-mha-tied", "llama3-rope", "qwen2-bias",
                                  "mistral"])
def test_fused_fp32_graph_gives_the_same_logits(tiny_engines, name):
    folder = tiny_engines[name, "onnxruntime"]
    engine = EngineConfig.load(folder)
    before = {p.name: file_hash(p) for p in folder.glob("model.onnx*")}
    model = onnx.load(str(folder / "model.onnx"))
    given = model.SerializeToString()
    fused, report = fuse_for_ort(model)
    assert model.SerializeToString() == given  # a copy is fused, not the model given
    expect_every_layer(report, engine.model.num_hidden_layers)
    assert report.nodes_before == len(model.graph.node)
    assert report.nodes_after == len(fused.graph.node)
    assert "RotaryEmbedding" in report.summary()
    assert {p.name: file_hash(p) for p in folder.glob("model.onnx*")} == before
    assert_same_logits(model, fused, engine)


@pytest.mark.parametrize("scheme", ["int4", "int8", "Q4_1"])
@pytest.mark.parametrize("int8", [False, True], ids=["fp32-matmul", "int8-matmul"])
def test_fused_quantized_graph_gives_the_same_logits(quantized_engines, scheme, int8):
    folder = quantized_engines[scheme]
    engine = EngineConfig.load(folder)
    model = onnx.load(str(folder / "model.onnx"))
    fused, report = fuse_for_ort(model)
    expect_every_layer(report, engine.model.num_hidden_layers)
    dq = [n for n in fused.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 4 * engine.model.num_hidden_layers + 1  # qkv, o, gate_up, down; head
    if scheme == "Q4_1":  # the minimum term: one Gemm per fused matmul, not per linear layer
        layers = engine.model.num_hidden_layers
        assert sum(n.op_type == "Gemm" for n in model.graph.node) == 7 * layers + 1
        assert sum(n.op_type == "Gemm" for n in fused.graph.node) == 4 * layers + 1
    assert_same_logits(model, fused, engine, int8)


def test_a_layer_that_does_not_match_is_left_unfused_and_correct(tiny_engines):
    """Layer 1's input RMSNorm and its q RoPE each get an Identity in the chain (a form the
    fusions do not know); layer 0's post-attention norm gets its own epsilon, which the fused
    node must carry."""
    folder = tiny_engines["llama-gqa4", "onnxruntime"]
    engine = EngineConfig.load(folder)
    model = onnx.load(str(folder / "model.onnx"))
    graph = model.graph
    nodes = list(graph.node)
    recips = [n for n in nodes if n.op_type == "Reciprocal"]
    means = [n for n in nodes if n.op_type == "ReduceMean"]
    negs = [n for n in nodes if n.op_type == "Neg"]
    _insert_identity(graph, recips[2].output[0])  # layer 1's input norm
    _insert_identity(graph, negs[2].output[0])  # layer 1's q rotation
    eps_add = next(n for n in graph.node if means[1].output[0] in n.input and n.op_type == "Add")
    graph.initializer.append(numpy_helper.from_array(np.array(1e-2, np.float32), "eps_1e-2"))
    eps_add.input[1] = "eps_1e-2"
    fused, report = fuse_for_ort(model)
    layers = engine.model.num_hidden_layers
    assert report.skipped == {"SimplifiedLayerNormalization": 1, "RotaryEmbedding": 1}
    assert report.applied["RotaryEmbedding"] == 2 * layers - 1
    assert report.applied["SkipSimplifiedLayerNormalization"] == 2 * layers - 1
    assert report.applied["qkv_matmul"] == layers
    assert sum(n.op_type == "Reciprocal" for n in fused.graph.node) == 1
    eps = [helper.get_attribute_value(a) for n in fused.graph.node for a in n.attribute
           if n.op_type == "SkipSimplifiedLayerNormalization" and a.name == "epsilon"]
    assert sorted(eps)[-1] == pytest.approx(1e-2)
    assert_same_logits(model, fused, engine)


def _insert_identity(graph: onnx.GraphProto, tensor: str) -> None:
    """Route ``tensor``'s consumers through a new Identity node."""
    relay = f"{tensor}.relay"
    for n in graph.node:
        for i, x in enumerate(n.input):
            if x == tensor:
                n.input[i] = relay
    index = next(i for i, n in enumerate(graph.node) if tensor in n.output)
    graph.node.insert(index + 1, helper.make_node("Identity", [tensor], [relay]))


def test_q4_1_minima_fold_into_the_fp32_weights(quantized_engines):
    """fp32_matmul=True: each Q4_1 matmul's block-minimum Gemm becomes constants added to the
    dequantized codes (d * q + m, gguf-py's order), which ORT folds into the fp32 weight."""
    folder = quantized_engines["Q4_1"]
    engine = EngineConfig.load(folder)
    model = onnx.load(str(folder / "model.onnx"))
    fused, report = fuse_for_ort(model, fp32_matmul=True)
    layers = engine.model.num_hidden_layers
    assert report.applied["q4_1_minimum_folded"] == 4 * layers + 1
    assert not any(n.op_type in ("Gemm", "ReduceSum") for n in fused.graph.node)
    assert_same_logits(model, fused, engine)


def test_a_graph_without_its_weights_is_refused_by_name(tiny_engines):
    folder = tiny_engines["llama-gqa4", "onnxruntime"]
    with pytest.raises(ValueError, match="weights are not loaded"):
        fuse_for_ort(onnx.load(str(folder / "model.onnx"), load_external_data=False))


@pytest.mark.parametrize("int8", [False, True], ids=["fp32-matmul", "int8-matmul"])
def test_fused_graph_runs_in_one_session_with_the_native_attention_op(quantized_engines, int8):
    if ort_custom_ops.library() is None:
        pytest.skip(f"no native op: {ort_custom_ops.unavailable_reason()}")
    folder = quantized_engines["Q4_1"]
    model = onnx.load(str(folder / "model.onnx"))
    fused, _ = fuse_for_ort(model, fp32_matmul=not int8)
    assert_same_logits(model, fused, EngineConfig.load(folder), int8, native=True)
