"""Block-quantized weights: GGUF blocks decoded exactly, round-to-nearest within half a step,
the blocked DequantizeLinear graph equal to HF on the dequantized weights, and the default
engine serving its GGUF's own 4-bit weights."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from kvflow.model.quant import dequantize, from_gguf_blocks, quantize_rtn

TOL = 1e-4


@pytest.mark.parametrize("scheme", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_decode_to_gguf_py_dequantization_bit_for_bit(scheme):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize as gguf_quantize

    qtype = GGMLQuantizationType[scheme]
    w = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    w[2, :32] = 0.0  # an all-zero block: scale 0
    blocks = gguf_quantize(w, qtype)
    ours = from_gguf_blocks(scheme, blocks, 6, 96)
    assert ours.bits == (8 if scheme == "Q8_0" else 4)
    assert ours.q.shape == (6, 96) and ours.scale.shape == (6, 3)
    np.testing.assert_array_equal(dequantize(ours), gguf_dequantize(blocks, qtype))


def test_unsupported_gguf_type_names_the_way_out():
    with pytest.raises(ValueError, match="--dtype float32"):
        from_gguf_blocks("Q6_K", np.zeros((1, 210), np.uint8), 1, 256)


@pytest.mark.parametrize(("scheme", "group"), [("int4", 32), ("int4", 128), ("int8", 32)])
def test_round_to_nearest_is_within_half_a_step(scheme, group):
    w = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    q = quantize_rtn(w, scheme, group)
    step = np.repeat(q.scale, group, axis=1)
    err = np.abs(dequantize(q) - w)
    assert (err <= step / 2 + 1e-6).all()
    levels = 15 if scheme == "int4" else 254
    assert q.q.min() >= (0 if scheme == "int4" else -127) and q.q.max() <= levels


def test_rtn_refuses_bad_group_size():
    with pytest.raises(ValueError, match="--group-size"):
        quantize_rtn(np.zeros((2, 64), np.float32), "int4", 64)


@pytest.fixture(scope="module")
def quantized_tiny(tiny_models, tmp_path_factory):
    """(name, scheme) -> (engine folder, HF model holding the dequantized weights)."""
    import torch

    from kvflow.build.builder import _quantized_weights, build_engine
    from kvflow.model.loader import load_checkpoint

    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for name, scheme in (("qwen2-bias", "int4"), ("llama-gqa4", "int8")):
        folder, hf = tiny_models[name]
        path = root / f"{name}-{scheme}"
        build_engine(str(folder), path, max_model_len=256, max_num_tokens=256,
                     max_batch_size=16, block_size=4, quantize=scheme, group_size=32,
                     progress=lambda _msg: None)
        ref = type(hf)(hf.config).eval()
        ref.load_state_dict(hf.state_dict())
        weights = _quantized_weights(load_checkpoint(str(folder)), scheme, 32)
        with torch.no_grad():
            params = dict(ref.named_parameters())
            for key, w in weights.items():
                if key == "model.embed_tokens.weight":  # tied: only the head reads it quantized
                    ref.lm_head.weight = torch.nn.Parameter(torch.from_numpy(dequantize(w)))
                else:
                    params[key].copy_(torch.from_numpy(dequantize(w)))
        out[name, scheme] = path, ref
    return out


@pytest.mark.slow
@pytest.mark.parametrize("key", [("qwen2-bias", "int4"), ("llama-gqa4", "int8")])
def test_quantized_engine_equals_hf_on_the_dequantized_weights(quantized_tiny, key):
    import torch

    from kvflow.runtime import create_runner
    from tests.helpers import greedy_generate

    path, ref = quantized_tiny[key]
    assert json.loads((path / "engine_config.json").read_text())["quantization"] == \
        f"{key[1]}-g32"
    graph = onnx.load(str(path / "model.onnx"), load_external_data=False).graph
    assert sum(n.op_type == "DequantizeLinear" for n in graph.node) == 2 * 7 + 1
    prompt = np.random.default_rng(2).integers(3, 320, size=19).tolist()
    runner = create_runner(None, path, 64, quantized_matmul="fp32", kv_cache_dtype="fp32")
    try:
        tokens, logits = greedy_generate(runner, prompt, 6, chunk=7)
    finally:
        runner.close()
    for i, step_logits in enumerate(logits):
        with torch.no_grad():
            expected = ref(torch.tensor([prompt + tokens[:i]])).logits[0, -1].numpy()
        np.testing.assert_allclose(step_logits, expected, atol=TOL, rtol=0)
    runner = create_runner(None, path, 64, quantized_matmul="int8")
    try:
        _, int8_logits = greedy_generate(runner, prompt, 1)
    finally:
        runner.close()
    # int8 activations round; a wrong code layout would leave nothing of the logits.
    a, b = int8_logits[0], logits[0]
    assert np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b) > 0.98


@pytest.mark.slow
def test_default_engine_keeps_the_gguf_4bit_weights(default_engines):
    folder = default_engines["onnxruntime"]
    config = json.loads((folder / "engine_config.json").read_text())
    assert config["quantization"] == "Q4_1+Q8_0"
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    codes = {t.name: t for t in graph.initializer if t.name.endswith(".q")}
    assert len(codes) == 30 * 7 + 1
    assert codes["model.layers.0.mlp.up_proj.weight.q"].data_type == onnx.TensorProto.UINT4
    assert codes["lm_head.weight.q"].data_type == onnx.TensorProto.INT8
    assert not any(t.name == "model.layers.0.mlp.up_proj.weight" for t in graph.initializer)


def test_quantize_needs_the_onnxruntime_backend(tiny_models, tmp_path):
    from kvflow.build.builder import build_engine
    from kvflow.build.engine_config import EngineConfigError

    folder, _ = tiny_models["llama-gqa4"]
    with pytest.raises(EngineConfigError, match="--quantize needs --backend"):
        build_engine(str(folder), tmp_path / "e", backend="torch", quantize="int4")
    with pytest.raises(EngineConfigError, match="--group-size must be one of"):
        build_engine(str(folder), tmp_path / "e", quantize="int4", group_size=64)


@pytest.mark.parametrize("scheme", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocked_graph_of_a_gguf_weight_with_bias_equals_its_dequantization(scheme):
    """One ``Gemm(x, W^T) + b`` rewritten: ORT in both modes against NumPy on the
    dequantized weight (Q4_1: the block minima's extra Gemm, fed the biased product)."""
    import onnxruntime as ort
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize
    from onnx import TensorProto, helper, numpy_helper

    from kvflow.build.quantize import quantize_graph

    rng = np.random.default_rng(3)
    out_f, in_f = 48, 64
    w = rng.standard_normal((out_f, in_f)).astype(np.float32)
    bias = rng.standard_normal(out_f).astype(np.float32)
    qw = from_gguf_blocks(scheme, gguf_quantize(w, GGMLQuantizationType[scheme]), out_f, in_f)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", in_f])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", out_f])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    report = quantize_graph(model, {"w": qw})
    assert report.schemes == {scheme: 1}
    assert "w" not in {t.name for t in model.graph.initializer}
    x = rng.standard_normal((5, in_f)).astype(np.float32)
    expected = x.astype(np.float64) @ dequantize(qw).T.astype(np.float64) + bias
    for config, tol in (("session.disable_quant_qdq", 1e-5),
                        ("session.qdq_matmulnbits_accuracy_level", 0.05)):
        opts = ort.SessionOptions()
        opts.add_session_config_entry(config, "1" if "disable" in config else "4")
        sess = ort.InferenceSession(model.SerializeToString(), opts,
                                    providers=["CPUExecutionProvider"])
        got = sess.run(None, {"x": x})[0]
        np.testing.assert_allclose(got, expected, atol=tol * np.abs(expected).max(), rtol=0)
