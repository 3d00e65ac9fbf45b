"""The streaming build (kvflow/build/streamed_graph.py) writes the engine that exporting a model
holding the checkpoint's weights wrote: the same graph nodes, every initializer the same bytes,
for fp32 and for each GGUF block type and ``--quantize`` scheme; each weight at an offset
aligned to 4096 bytes; and the exporter never receives a model with weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from kvflow.build.builder import _quantized_weights, build_engine, write_graph_artifacts
from kvflow.build.engine_config import BuildLimits, EngineConfig, checkpoint_source
from kvflow.model.loader import load_checkpoint

LIMITS = {"max_model_len": 256, "max_num_tokens": 256, "max_batch_size": 16, "block_size": 4}
ALIGN = 4096


def reference_engine(model: str, out: Path, quantize: str | None = None,
                     dtype: str | None = None) -> None:
    """Today's in-memory build, kept as the reference: the whole checkpoint in fp32, a model
    holding it exported, then the blocked rewrite on the loaded graph."""
    from kvflow.model.llama import LlamaForCausalLM

    ckpt = load_checkpoint(model)
    cfg = ckpt.config
    keep = dtype is None and quantize is None
    weights = (_quantized_weights(ckpt, quantize, 32) if quantize
               else dict(ckpt.quantized) if keep else {})
    if weights and cfg.tie_word_embeddings and "model.embed_tokens.weight" in weights:
        weights["lm_head.weight"] = weights.pop("model.embed_tokens.weight")
    net = LlamaForCausalLM(cfg, LIMITS["block_size"], LIMITS["max_model_len"])
    net.load_hf_state_dict(ckpt.state_dict)
    out.mkdir(parents=True)
    engine = EngineConfig(cfg, "onnxruntime", "float32", BuildLimits(**LIMITS),
                          checkpoint_source(ckpt.source), {})
    write_graph_artifacts(net, engine, out, lambda _m: None, weights)


def initializer_bytes(path: Path) -> dict[str, tuple[int, list[int], bytes]]:
    graph = onnx.load(str(path / "model.onnx")).graph
    return {t.name: (t.data_type, list(t.dims), numpy_helper.to_array(t).tobytes())
            for t in graph.initializer}


def assert_same_engine(streamed: Path, reference: Path) -> None:
    a = onnx.load(str(streamed / "model.onnx"), load_external_data=False)
    b = onnx.load(str(reference / "model.onnx"), load_external_data=False)
    assert [n.SerializeToString() for n in a.graph.node] == \
        [n.SerializeToString() for n in b.graph.node]
    assert (a.graph.input, a.graph.output, a.opset_import) == \
        (b.graph.input, b.graph.output, b.opset_import)
    got, want = initializer_bytes(streamed), initializer_bytes(reference)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name] == value, name
    files = set()
    for t in a.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            assert int(info["offset"]) % ALIGN == 0, t.name
            files.add(info["location"])
    assert files == {"model.onnx.data"}


def test_exporter_receives_a_model_without_weights():
    from kvflow.build.export import export_graph, is_placeholder, is_weightless, weightless_model
    from kvflow.model.config import ModelConfig
    from kvflow.model.llama import LlamaForCausalLM

    cfg = ModelConfig("llama", 320, 64, 96, 2, 4, 2, 16)
    net, inputs = weightless_model(cfg, 4, 64)
    from torch._subclasses.fake_tensor import FakeTensor

    params = list(net.parameters())
    assert params and all(isinstance(p, FakeTensor) for p in params)
    assert is_weightless(net)
    real = LlamaForCausalLM(cfg, 4, 64)
    values = {k: v.detach().numpy() for k, v in real.state_dict().items()}
    values.update(rope_cos=real.rope_cos.numpy(), rope_sin=real.rope_sin.numpy())
    asked: list[str] = []

    def known_value(name: str) -> np.ndarray:
        asked.append(name)
        return values[name]

    graph = export_graph(net, inputs, known_value)
    # Only the norms (1-D) and the computed RoPE tables are read; every matrix stays a
    # placeholder for the stream.
    assert asked and all(values[n].ndim == 1 or n.startswith("rope_") for n in asked)
    placeholders = {t.name for t in graph.graph.initializer if is_placeholder(t)}
    assert {k for k, v in values.items() if v.ndim == 2 and not k.startswith("rope_")} <= \
        placeholders
    # The build's only way to the exporter refuses a model that holds its weights.
    with pytest.raises(ValueError, match="without weights"):
        export_graph(real, inputs, known_value)


@pytest.mark.parametrize("name", ["llama-mha-tied", "qwen2-bias", "llama-gqa4"])
def test_fp32_engine_equals_the_in_memory_build(tiny_models, tmp_path, name):
    folder, _ = tiny_models[name]
    build_engine(str(folder), tmp_path / "s", progress=lambda _m: None, **LIMITS)
    reference_engine(str(folder), tmp_path / "r")
    assert_same_engine(tmp_path / "s", tmp_path / "r")


@pytest.mark.parametrize(("name", "scheme"), [("qwen2-bias", "int4"), ("llama-gqa4", "int8"),
                                              ("llama-mha-tied", "int4")])
def test_rtn_quantized_engine_equals_the_in_memory_build(tiny_models, tmp_path, name, scheme):
    folder, _ = tiny_models[name]
    build_engine(str(folder), tmp_path / "s", quantize=scheme, progress=lambda _m: None,
                 **LIMITS)
    reference_engine(str(folder), tmp_path / "r", quantize=scheme)
    assert_same_engine(tmp_path / "s", tmp_path / "r")
    config = json.loads((tmp_path / "s" / "engine_config.json").read_text())
    assert config["quantization"] == f"{scheme}-g32"


# --- GGUF ---------------------------------------------------------------------------------
def write_tiny_gguf(path: Path, main: str, embedding: str, tied: bool) -> None:
    """A random 2-layer llama GGUF: linear weights in ``main``, the embedding in
    ``embedding``, norms F32, with the default model's tokenizer (its vocabulary size)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import quantize

    from kvflow.model.loader import default_model_path

    try:
        source = GGUFReader(str(default_model_path()))
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tokens = source.fields["tokenizer.ggml.tokens"].contents()
    hidden, ffn, heads, kv_heads, vocab = 64, 96, 4, 2, len(tokens)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_token_list(tokens)
    w.add_token_types(source.fields["tokenizer.ggml.token_type"].contents())
    w.add_string("tokenizer.ggml.model", source.fields["tokenizer.ggml.model"].contents())
    w.add_array("tokenizer.ggml.merges", source.fields["tokenizer.ggml.merges"].contents())
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    rng = np.random.default_rng(7)

    def add(name: str, shape: tuple[int, ...], qtype: str) -> None:
        values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if len(shape) == 1:
            w.add_tensor(name, np.ones(shape, np.float32) + values)
        elif qtype in ("F16", "F32"):
            w.add_tensor(name, values.astype(np.float16 if qtype == "F16" else np.float32))
        else:
            t = GGMLQuantizationType[qtype]
            w.add_tensor(name, quantize(values, t), raw_shape=quantize(values, t).shape,
                         raw_dtype=t)

    add("token_embd.weight", (vocab, hidden), embedding)
    for i in range(2):
        add(f"blk.{i}.attn_norm.weight", (hidden,), "F32")
        for part, shape in (("attn_q", (hidden, hidden)), ("attn_k", (32, hidden)),
                            ("attn_v", (32, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))):
            add(f"blk.{i}.{part}.weight", shape, main)
        add(f"blk.{i}.ffn_norm.weight", (hidden,), "F32")
    add("output_norm.weight", (hidden,), "F32")
    if not tied:
        add("output.weight", (vocab, hidden), main)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GGUFS = {"q4_0": ("Q4_0", "Q4_0", False), "q4_1-tied": ("Q4_1", "Q8_0", True),
         "q8_0": ("Q8_0", "F16", False)}


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for key, (main, embedding, tied) in GGUFS.items():
        out[key] = root / f"{key}.gguf"
        write_tiny_gguf(out[key], main, embedding, tied)
    return out


@pytest.mark.parametrize("key", sorted(GGUFS))
def test_gguf_engine_keeps_its_blocks_as_the_in_memory_build(tiny_ggufs, tmp_path, key):
    build_engine(str(tiny_ggufs[key]), tmp_path / "s", progress=lambda _m: None, **LIMITS)
    reference_engine(str(tiny_ggufs[key]), tmp_path / "r")
    assert_same_engine(tmp_path / "s", tmp_path / "r")
    config = json.loads((tmp_path / "s" / "engine_config.json").read_text())
    assert GGUFS[key][0] in config["quantization"]


@pytest.mark.parametrize("key", ["q4_1-tied", "q8_0"])
def test_gguf_dequantized_engine_equals_the_in_memory_build(tiny_ggufs, tmp_path, key):
    build_engine(str(tiny_ggufs[key]), tmp_path / "s", dtype="float32",
                 progress=lambda _m: None, **LIMITS)
    reference_engine(str(tiny_ggufs[key]), tmp_path / "r", dtype="float32")
    assert_same_engine(tmp_path / "s", tmp_path / "r")


@pytest.mark.parametrize(("key", "quantize"), [("q4_1-tied", None), ("q4_0", None),
                                               ("q8_0", "int4")])
def test_small_chunks_write_the_same_bytes(tiny_ggufs, tmp_path, key, quantize):
    """Weights converted a few rows (fp32) or two blocks of columns (blocked) at a time: the
    same file contents as whole tensors."""
    from dataclasses import replace

    from kvflow.build.streamed_graph import weight_plan, write_streamed_graph
    from kvflow.model.loader import open_checkpoint

    source = open_checkpoint(str(tiny_ggufs[key]))
    for folder, chunk in (("whole", 1 << 30), ("chunked", 1)):
        plan = replace(weight_plan(source, "float32", quantize, 32, quantize is None),
                       chunk_bytes=chunk)
        (tmp_path / folder).mkdir()
        write_streamed_graph(source, plan, LIMITS["block_size"], LIMITS["max_model_len"],
                             tmp_path / folder, lambda _m: None)
    assert initializer_bytes(tmp_path / "chunked") == initializer_bytes(tmp_path / "whole")


def test_progress_reports_each_layer_with_bytes(tiny_models, tmp_path):
    folder, _ = tiny_models["llama-gqa4"]
    lines: list[str] = []
    build_engine(str(folder), tmp_path / "s", progress=lines.append, **LIMITS)
    wrote = [line for line in lines if line.strip().startswith("wrote model.layers.")]
    assert [line.split()[1] for line in wrote] == ["model.layers.0:", "model.layers.1:"]
    assert all("MB" in line for line in wrote)


def test_torch_weights_file_equals_the_checkpoint(tiny_models, tmp_path):
    from safetensors.torch import load_file

    folder, _ = tiny_models["llama-mha-tied"]
    build_engine(str(folder), tmp_path / "t", backend="torch", progress=lambda _m: None,
                 **LIMITS)
    got = load_file(str(tmp_path / "t" / "weights.safetensors"))
    want = load_checkpoint(str(folder)).state_dict
    assert set(got) == set(want) - {"lm_head.weight"}
    for name, value in got.items():
        assert value.dtype == want[name].dtype and bool((value == want[name]).all()), name


def test_float16_graph_equals_the_in_memory_export(tiny_models, tmp_path):
    """The TensorRT engine's graph (float16): weights cast as ``Module.to`` casts them."""
    import torch

    from kvflow.build.export import export_onnx
    from kvflow.build.streamed_graph import weight_plan, write_streamed_graph
    from kvflow.model.llama import LlamaForCausalLM
    from kvflow.model.loader import open_checkpoint

    folder, _ = tiny_models["llama-gqa4"]
    source = open_checkpoint(str(folder))
    (tmp_path / "s").mkdir()
    write_streamed_graph(source, weight_plan(source, "float16", None, 32, False),
                         LIMITS["block_size"], LIMITS["max_model_len"], tmp_path / "s",
                         lambda _m: None)
    net = LlamaForCausalLM(source.config, LIMITS["block_size"], LIMITS["max_model_len"])
    net.load_hf_state_dict(load_checkpoint(str(folder)).state_dict)
    (tmp_path / "r").mkdir()
    export_onnx(net.to(torch.float16).eval(), LIMITS["block_size"], tmp_path / "r" / "model.onnx")
    assert_same_engine(tmp_path / "s", tmp_path / "r")


def test_safetensors_reader_converts_as_torch_does(tmp_path):
    """The memory-mapped reader gives what ``load_file(...)[k].float()`` gives, whole or by
    rows, for every dtype it takes; and names a dtype it does not take."""
    import torch
    from safetensors.torch import load_file, save_file

    from kvflow.model.checkpoint_tensors import SafetensorsTensors
    from kvflow.model.config import ModelConfig, UnsupportedModelError

    cfg = ModelConfig("llama", 320, 64, 96, 2, 4, 2, 16)
    gen = torch.Generator().manual_seed(0)
    tensors = {f"w.{d}": (torch.randn(7, 5, generator=gen) * 3).to(getattr(torch, d))
               for d in ("float32", "float16", "bfloat16")}
    tensors["norm"] = torch.randn(5, generator=gen).to(torch.bfloat16)
    save_file(tensors, str(tmp_path / "a.safetensors"))
    source = SafetensorsTensors(tmp_path, cfg, lambda _p: None)
    want = {k: v.float().numpy() for k, v in load_file(str(tmp_path / "a.safetensors")).items()}
    assert sorted(source.names()) == sorted(want)
    for name, value in want.items():
        assert source.fp32(name).tobytes() == value.tobytes(), name
        assert source.shape(name) == value.shape
    assert source.fp32_rows("w.bfloat16", 2, 5).tobytes() == want["w.bfloat16"][2:5].tobytes()
    save_file({"i": torch.zeros(3, dtype=torch.int64)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(UnsupportedModelError, match="I64"):
        SafetensorsTensors(tmp_path, cfg, lambda _p: None)
