"""The ONNX Runtime runner's weights mapped, not copied (kvflow.runtime.ort_weights): the
prepared-weights file is made once and reused, remade when the engine's data changes; the
mapped graph gives exactly the logits of today's in-memory fusion; the sessions get every large
initializer as external data, and no fp32 copy of a quantized weight; the tied embedding
becomes GatherQ only where its table is the dequantized head."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kvflow.build.engine_config import EngineConfig
from kvflow.plugins import ort_custom_ops
from kvflow.runtime.ort_graph import fuse_for_ort
from kvflow.runtime.ort_runner import KV_DTYPE_CODES, OnnxRuntimeRunner, prepare
from kvflow.runtime.ort_sessions import (
    Executor,
    OneSession,
    Segmented,
    attention_nodes,
    session_options,
    with_argmax,
)
from kvflow.runtime.ort_weights import (
    INLINE_MAX_BYTES,
    PreparedWeights,
    WeightSource,
    external_info,
    graph_data_files,
    is_external,
    resident_bytes,
)
from tests.test_ort_graph import BUILD, quantized_engines  # noqa: F401 (a fixture)
from tests.test_ort_graph import executor_logits as run

pytest.importorskip("torch")


def copy_engine(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("prepared-*"))
    return dest


def make_runner(folder: Path, **kw) -> OnnxRuntimeRunner:
    return OnnxRuntimeRunner(folder, EngineConfig.load(folder), 64, threads=1, **kw)


def prepared_files(folder: Path) -> dict[str, tuple[int, int]]:
    """prepared file name -> (inode, mtime in ns)."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sorted(folder.glob("prepared-*"))}


def test_prepared_weights_are_made_once_and_reused(quantized_engines, tmp_path):  # noqa: F811
    folder = copy_engine(quantized_engines["Q4_1"], tmp_path / "e")
    first = make_runner(folder, quantized_matmul="int8")
    try:
        assert [p.written for p in first.prepared] == [True]
        assert first.prepared[0].path.parent == folder
    finally:
        first.close()
    made = prepared_files(folder)
    assert len(made) == 2  # the file and its index
    again = make_runner(folder, quantized_matmul="int8")
    try:
        assert [p.written for p in again.prepared] == [False]
    finally:
        again.close()
    prepare(folder, EngineConfig.load(folder))  # the build's call: nothing left to do for int8
    assert {k: v for k, v in prepared_files(folder).items() if k in made} == made


def test_changed_engine_data_makes_new_prepared_weights(quantized_engines, tmp_path):  # noqa: F811
    folder = copy_engine(quantized_engines["Q4_1"], tmp_path / "e")
    make_runner(folder, quantized_matmul="int8").close()
    before = prepared_files(folder)
    data = folder / "model.onnx.data"
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as a rebuild would
    runner = make_runner(folder, quantized_matmul="int8")
    try:
        assert [p.written for p in runner.prepared] == [True]
        assert runner.prepared[0].path.name not in before
    finally:
        runner.close()
    assert not set(before) & set(prepared_files(folder))  # the stale file is gone


def in_memory_executor(folder: Path, engine: EngineConfig, int8: bool, native: bool) -> Executor:
    """Today's path: the whole graph loaded, fused in memory, serialized with its weights."""
    library = ort_custom_ops.library() if native else None
    model, _ = fuse_for_ort(onnx.load(str(folder / "model.onnx")), fp32_matmul=not int8,
                            native_matmul=int8 and library is not None)
    model = with_argmax(model)
    opts = session_options(1, False, int8, library, engine.quantization is not None)
    if library is None:
        return Segmented(model, opts)
    for node in attention_nodes(model):
        node.attribute.extend([helper.make_attribute("kv_dtype", KV_DTYPE_CODES[np.dtype(
            np.float32)]), helper.make_attribute("num_blocks", 64)])
    return OneSession(model, opts)


@pytest.mark.parametrize("case", ["fp32-engine", "Q4_1-fp32", "Q4_1-int8", "Q4_1-segmented"])
def test_mapped_weights_give_the_in_memory_fusions_logits(tiny_engines, quantized_engines,  # noqa: F811
                                                          tmp_path, case):
    src = tiny_engines["llama-gqa4", "onnxruntime"] if case == "fp32-engine" \
        else quantized_engines["Q4_1"]
    folder = copy_engine(src, tmp_path / "e")
    engine = EngineConfig.load(folder)
    int8 = case == "Q4_1-int8"
    attention = "segmented" if case == "Q4_1-segmented" else "auto"
    runner = make_runner(folder, quantized_matmul="int8" if int8 else "fp32",
                         attention=attention)
    try:
        native = runner.attention == "native"
        want = run(in_memory_executor(folder, engine, int8, native), engine)
        got = run(runner.executor_for(1), engine)
    finally:
        runner.close()
    for ref, out in zip(want, got, strict=True):
        np.testing.assert_array_equal(out, ref)


def test_sessions_get_mapped_weights_and_no_fp32_copy(quantized_engines, tmp_path):  # noqa: F811
    folder = copy_engine(quantized_engines["Q4_1"], tmp_path / "e")
    exported = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    quantized = {tuple(t.dims) for t in exported.graph.initializer if t.name.endswith(".q")}
    own = {t.name for t in exported.graph.initializer}
    runner = make_runner(folder, quantized_matmul="int8")
    try:
        files = {p.name for p in graph_data_files(exported, folder)}
        files |= {p.path.name for p in runner.prepared}
        for graph in runner.graphs:
            for t in graph.graph.initializer:
                if is_external(t):
                    assert external_info(t)["location"] in files, t.name
                else:
                    assert len(t.raw_data) < INLINE_MAX_BYTES, t.name
                if t.data_type == TensorProto.FLOAT and len(t.dims) == 2:
                    dims = tuple(t.dims)
                    # an embedding table is the checkpoint's own, not a copy (see GatherQ)
                    assert t.name in own or (dims not in quantized and
                                             dims[::-1] not in quantized), t.name
        mapped, _ = resident_bytes([folder / "model.onnx.data",
                                    *(p.path for p in runner.prepared)])
        assert mapped > 0  # ORT mapped the files rather than reading them
    finally:
        runner.close()


@pytest.fixture(scope="module")
def tied_engines(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """A tied model with a Q4_1 head, its embedding table either the dequantized head (as a
    GGUF's) or the original fp32 one (as ``--quantize``'s)."""
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    from kvflow.build.builder import write_graph_artifacts
    from kvflow.build.engine_config import BuildLimits, checkpoint_source
    from kvflow.model.llama import LlamaForCausalLM
    from kvflow.model.loader import load_checkpoint
    from kvflow.model.quant import dequantize, from_gguf_blocks

    folder, _ = tiny_models["llama-mha-tied"]
    root = tmp_path_factory.mktemp("tied")
    out = {}
    for table in ("dequantized", "original"):
        ckpt = load_checkpoint(str(folder))
        state = ckpt.state_dict
        table_weight = state["model.embed_tokens.weight"]
        blocks = gguf_quantize(table_weight.numpy(), GGMLQuantizationType.Q4_1)
        head = from_gguf_blocks("Q4_1", blocks, *table_weight.shape)
        if table == "dequantized":
            state["model.embed_tokens.weight"] = torch.from_numpy(dequantize(head))
        limits = BuildLimits(256, 256, 16, 4)
        engine = EngineConfig(ckpt.config, "onnxruntime", "float32", limits,
                              checkpoint_source(ckpt.source), {}, quantization="Q4_1")
        net = LlamaForCausalLM(ckpt.config, limits.block_size, limits.max_model_len)
        net.load_hf_state_dict(state)
        out[table] = root / table
        out[table].mkdir()
        with torch.no_grad():
            engine.files.update(write_graph_artifacts(net, engine, out[table], lambda _m: None,
                                                      {"lm_head.weight": head}))
        engine.save(out[table])
    return out


@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("table", ["dequantized", "original"])
def test_gather_q_takes_the_tied_table_only_when_it_is_the_head(tied_engines, table, mapped):
    folder = tied_engines[table]
    model = onnx.load(str(folder / "model.onnx"), load_external_data=not mapped)
    fused, report = fuse_for_ort(model, native_matmul=True, gather_q=True,
                                 weights=WeightSource(folder) if mapped else None)
    ops = [n.op_type for n in fused.graph.node]
    names = {t.name for t in fused.graph.initializer}
    if table == "dequantized":
        assert report.applied["gather_q"] == 1 and "GatherQ" in ops
        assert "lm_head.weight" not in names  # no fp32 table left to page in
    else:
        assert report.skipped["gather_q"] == 1 and "GatherQ" not in ops
        assert "lm_head.weight" in names


def test_prepared_weights_in_the_cache_dir_give_the_same_logits(quantized_engines,  # noqa: F811
                                                                 tmp_path, monkeypatch):
    """An engine folder that cannot be written: the prepared file goes to the cache dir and
    reaches ORT as OrtValues over its mapping."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    folder = copy_engine(quantized_engines["Q4_1"], tmp_path / "e")
    engine = EngineConfig.load(folder)
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != folder)
    runner = make_runner(folder, quantized_matmul="fp32", attention="segmented")
    try:
        assert all(isinstance(p, PreparedWeights) and not p.in_engine_dir
                   for p in runner.prepared)
        want = run(in_memory_executor(folder, engine, False, False), engine)
        got = run(runner.executor_for(1), engine)
    finally:
        runner.close()
    assert not list(folder.glob("prepared-*"))
    for ref, out in zip(want, got, strict=True):
        np.testing.assert_array_equal(out, ref)


def test_auto_runs_int8_at_every_size_only_where_matmul_q_takes_every_layer(tiny_engines):
    """With the native GEMM, ``auto`` is one int8 variant for a GGUF's blocks; an engine of
    round-to-nearest weights (fp32 scales: ORT's MatMulNBits, 4.6x the KL) keeps fp32 above
    16 tokens, and an unquantized one is fp32 throughout."""
    import dataclasses

    from kvflow.build.engine_config import EngineConfig
    from kvflow.plugins import ort_custom_ops
    from kvflow.runtime.ort_runner import AUTO_INT8_MAX_TOKENS, plan

    library = ort_custom_ops.library()
    if library is None or not ort_custom_ops.native_gemm():
        pytest.skip("the native op library with its GEMM is unavailable here")
    engine = EngineConfig.load(tiny_engines["llama-gqa4", "onnxruntime"])
    gguf = dataclasses.replace(engine, quantization="Q4_1+Q8_0")
    rtn = dataclasses.replace(engine, quantization="int4-g32")
    assert plan(gguf, "auto", library) == [(1 << 62, True)]
    assert plan(rtn, "auto", library) == [(AUTO_INT8_MAX_TOKENS, True), (1 << 62, False)]
    assert plan(engine, "auto", library) == [(1 << 62, False)]
    assert plan(rtn, "int8", library) == [(1 << 62, True)]
