"""kvflow::MatMulQ (kvflow/plugins/matmul_q_ort.h), the native quantized matmul: in a one-node
graph against a NumPy reference of the same arithmetic (llama.cpp's q8_1 activations, the
exact Q4_1 / Q8_0 weight blocks) and against the fp32 matmul of the dequantized weights; the
portable (non-AVX2) build against the AVX2 one; bad input refused by name; the graph pass on
Q4_0 zero points and on scales fp16 would round; and a GGUF Q4_1 tiny engine through
``fuse_for_ort(native_matmul=True)`` in one session against fp32. The tiled GEMM (16 rows and
more) on every ISA variant: tests/test_matmul_q_gemm.py."""

from __future__ import annotations

import platform

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvflow.build.engine_config import EngineConfig
from kvflow.plugins import ort_custom_ops
from kvflow.runtime.ort_graph import fuse_for_ort
from kvflow.runtime.ort_graph_linear import NATIVE_MATMUL, pack_blocks
from tests.test_ort_graph import quantized_engines, run_steps  # noqa: F401 (a fixture)

BLOCK = 32
# Against the reference of the same arithmetic: only the fp32 sums' order differs.
SAME_ARITHMETIC_TOL = 1e-5
# Against x @ dequantized W in fp32, relative to max |y|: int8 activations (amax / 127 steps)
# over K = 576..1536 of random normal inputs and weights give about 0.5% of max |y|.
INT8_ACTIVATIONS_TOL = 2e-2
# The tiny engine's logits (every layer and the head in MatMulQ) against the fp32 path,
# relative to the largest logit: the error of int8 activations grown through the layers, as
# test_ort_graph's INT8_TOL for MatMulNBits.
ENGINE_TOL = 3e-2

needs_library = pytest.mark.skipif(
    ort_custom_ops.library() is None,
    reason=f"no native op library: {ort_custom_ops.unavailable_reason()}")


def make_weight(scheme: str, k: int, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Graph-form blocks: ``codes`` [K, N], ``scale`` (and Q4_1 ``minimum``) [K/32, N], fp16
    values as a GGUF holds them; ``w`` the fp32 dequantized weight [K, N]."""
    rng = np.random.default_rng(seed)
    nb = k // BLOCK
    scale = (rng.uniform(0.5, 2.0, (nb, n)) * 0.01).astype(np.float16).astype(np.float32)
    if scheme == "Q8_0":
        codes = rng.integers(-127, 128, (k, n)).astype(np.int8)
        w = np.repeat(scale, BLOCK, axis=0) * codes.astype(np.float32)
        return {"codes": codes, "scale": scale, "w": w}
    codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
    minimum = (-8 * scale * rng.uniform(0.8, 1.2, (nb, n))).astype(np.float16).astype(np.float32)
    w = np.repeat(scale, BLOCK, axis=0) * codes + np.repeat(minimum, BLOCK, axis=0)
    return {"codes": codes, "scale": scale, "minimum": minimum, "w": w.astype(np.float32)}


def q8_1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's q8_1 of ``x`` [M, K]: per 32-block codes [M, K/32, 32], d and s [M, K/32]."""
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse[..., None])
    d = amax / np.float32(127)
    return q, d, (d * q.sum(axis=-1, dtype=np.float32)).astype(np.float32)


def reference(x: np.ndarray, weight: dict[str, np.ndarray]) -> np.ndarray:
    """The op's arithmetic in float64: exact integer block dots, scaled by d_w * d_x (fp32),
    plus m_w * s_x for Q4_1."""
    q, d, s = q8_1(x)
    codes = weight["codes"].astype(np.float64)
    y = np.zeros((x.shape[0], codes.shape[1]))
    for b in range(q.shape[1]):
        dots = q[:, b].astype(np.float64) @ codes[b * BLOCK:(b + 1) * BLOCK]
        y += (d[:, b, None] * weight["scale"][b]).astype(np.float32) * dots
    if "minimum" in weight:
        y += s.astype(np.float64) @ weight["minimum"].astype(np.float64)
    return y


def matmul_q_model(weight: dict[str, np.ndarray], x_dims: tuple = ("M", "K"),
                   **attrs: int) -> bytes:
    k, n = weight["codes"].shape
    x_dims = tuple(k if d == "K" else d for d in x_dims)
    packed = pack_blocks(weight["codes"], weight["scale"], weight.get("minimum"))
    assert packed is not None
    values = {"bits": 4 if "minimum" in weight else 8, "K": k, "N": n, **attrs}
    node = helper.make_node("MatMulQ", ["x", "w"], ["y"], domain="kvflow")
    node.attribute.extend(helper.make_attribute(key, v) for key, v in values.items())
    graph = helper.make_graph(
        [node], "matmul_q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(packed, "w")])
    return helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("kvflow", 1)]).SerializeToString()


def session(model: bytes, library=None, threads: int = 1) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.register_custom_ops_library(str(library or ort_custom_ops.library()))
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def inputs(m: int, k: int, seed: int = 1) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    if m > 1:
        x[1, :BLOCK] = 0  # a block of zeros: d = 0, codes 0
    return x


@needs_library
@pytest.mark.parametrize("scheme", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (576, 49152)])
@pytest.mark.parametrize("m", [1, 3, 8, 64])
def test_matmul_q_equals_its_reference_and_the_fp32_matmul(scheme, k, n, m):
    weight = make_weight(scheme, k, n)
    x = inputs(m, k)
    # Two threads and no inline threshold: the column tiles run in ORT's pool too.
    y = session(matmul_q_model(weight, parallel_min_work=0), threads=2).run(None, {"x": x})[0]
    assert y.shape == (m, n) and y.dtype == np.float32
    ref = reference(x, weight)
    np.testing.assert_allclose(y, ref, rtol=0, atol=SAME_ARITHMETIC_TOL * np.abs(ref).max())
    exact = x.astype(np.float64) @ weight["w"].astype(np.float64)
    np.testing.assert_allclose(y, exact, rtol=0, atol=INT8_ACTIVATIONS_TOL * np.abs(exact).max())


def test_pack_blocks_refuses_scales_that_fp16_would_round():
    weight = make_weight("Q4_1", 64, 8)
    assert pack_blocks(weight["codes"], weight["scale"] * np.float32(1 + 2 ** -20),
                       weight["minimum"]) is None
    assert pack_blocks(weight["codes"], weight["scale"], weight["minimum"]) is not None


@needs_library
def test_bad_input_is_refused_by_name():
    weight = make_weight("Q4_1", 64, 8)
    with pytest.raises(Exception, match="last dimension must be K = 64"):
        session(matmul_q_model(weight, ("M", "free"))).run(
            None, {"x": np.zeros((2, 32), np.float32)})
    with pytest.raises(Exception, match="bits 5 is none of 4"):
        session(matmul_q_model(weight, bits=5))
    with pytest.raises(Exception, match="w has shape \\[8, 40\\], expected \\[8, 68\\]"):
        session(matmul_q_model(weight, bits=8)).run(None, {"x": np.zeros((1, 64), np.float32)})


@needs_library
@pytest.mark.skipif(platform.machine() != "x86_64", reason="SIMD against portable: x86 only")
def test_the_portable_build_computes_what_the_simd_one_does():
    """The portable variant (plain C++) against the one this CPU loads by default (AVX2 or
    AVX-512 VNNI row kernels); tests/test_matmul_q_gemm.py covers every variant's GEMM."""
    portable = ort_custom_ops.library(isa="portable")
    assert portable is not None, ort_custom_ops.unavailable_reason(isa="portable")
    for scheme in ("Q4_1", "Q8_0"):
        weight = make_weight(scheme, 576, 96)
        x = inputs(5, 576)
        model = matmul_q_model(weight)
        y_avx2 = session(model).run(None, {"x": x})[0]
        y_portable = session(model, portable).run(None, {"x": x})[0]
        np.testing.assert_allclose(y_portable, y_avx2, rtol=0,
                                   atol=SAME_ARITHMETIC_TOL * np.abs(y_avx2).max())


@needs_library
def test_gguf_engine_with_native_matmuls_matches_the_fp32_path(quantized_engines):  # noqa: F811
    folder = quantized_engines["Q4_1"]
    engine = EngineConfig.load(folder)
    model = onnx.load(str(folder / "model.onnx"))
    fused, report = fuse_for_ort(model, native_matmul=True)
    layers = engine.model.num_hidden_layers
    # per layer: qkv, o, gate_up, down; and the head
    assert report.applied[NATIVE_MATMUL] == 4 * layers + 1
    assert NATIVE_MATMUL not in report.skipped
    assert not [n for n in fused.graph.node if n.op_type in ("DequantizeLinear", "ReduceSum")]
    reference_logits = run_steps(model, engine, int8=False)
    native_logits = run_steps(fused, engine, int8=False, native=True)
    for ref, got in zip(reference_logits, native_logits, strict=True):
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=0, atol=ENGINE_TOL * np.abs(ref).max())


def dequantize_linear_model(weight: dict[str, np.ndarray],
                            zero_point: int | None) -> onnx.ModelProto:
    """``y = x @ DequantizeLinear(codes, scale[, zero_point])``, 4-bit codes, as the build
    writes a Q4_0 (zero point 8) or int4 layer."""
    k, n = weight["codes"].shape
    codes = helper.make_tensor("w.q", TensorProto.UINT4, [k, n],
                               weight["codes"].ravel().tolist())
    inits = [codes, numpy_helper.from_array(weight["scale"], "w.scale")]
    if zero_point is not None:
        inits.append(helper.make_tensor("w.zero_point", TensorProto.UINT4, [k // BLOCK, n],
                                        [zero_point] * (k // BLOCK * n)))
    nodes = [helper.make_node("DequantizeLinear", [i.name for i in inits], ["w.dq"], axis=0,
                              block_size=BLOCK),
             helper.make_node("MatMul", ["x", "w.dq"], ["y"])]
    graph = helper.make_graph(
        nodes, "dq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                   helper.make_opsetid("kvflow", 1)])


@needs_library
def test_q4_0_zero_points_become_exact_minima():
    """Q4_0's ``d * (q - 8)`` is Q4_1's ``d * q + m`` with ``m = -8 d``, exact in fp16."""
    weight = make_weight("Q4_1", 128, 48)
    model = dequantize_linear_model(weight, zero_point=8)
    fused, report = fuse_for_ort(model, native_matmul=True)
    assert report.applied[NATIVE_MATMUL] == 1
    assert [n.op_type for n in fused.graph.node] == ["MatMulQ"]
    x = inputs(3, 128)
    y = session(fused.SerializeToString()).run(None, {"x": x})[0]
    ref = reference(x, {**weight, "minimum": -8 * weight["scale"]})
    np.testing.assert_allclose(y, ref, rtol=0, atol=SAME_ARITHMETIC_TOL * np.abs(ref).max())


def test_scales_fp16_would_round_stay_with_ort():
    """RTN scales (fp32 amax / 15) are not fp16 values: the layer is left, counted unmatched."""
    weight = make_weight("Q4_1", 64, 16)
    weight["scale"] = weight["scale"] * np.float32(1 + 2 ** -20)
    fused, report = fuse_for_ort(dequantize_linear_model(weight, zero_point=3),
                                 native_matmul=True)
    assert report.skipped[NATIVE_MATMUL] == 1 and NATIVE_MATMUL not in report.applied
    assert [n.op_type for n in fused.graph.node] == ["DequantizeLinear", "MatMul"]


@needs_library
def test_leading_dimensions_are_rows_and_none_is_fine():
    weight = make_weight("Q8_0", 64, 24)
    s = session(matmul_q_model(weight, ("B", "T", "K")))
    x = inputs(6, 64).reshape(2, 3, 64)
    y = s.run(None, {"x": x})[0]
    assert y.shape == (2, 3, 24)
    ref = reference(x.reshape(6, 64), weight).reshape(2, 3, 24)
    np.testing.assert_allclose(y, ref, rtol=0, atol=SAME_ARITHMETIC_TOL * np.abs(ref).max())
    assert s.run(None, {"x": np.zeros((0, 3, 64), np.float32)})[0].shape == (0, 3, 24)
