"""kvflow::GatherQ (kvflow/plugins/gather_q_ort.h): rows of a table in MatMulQ's packed blocks,
dequantized. Equal element for element to the fp32 dequantized table (d * q + m, the product
rounded first) at odd N and K, bits 4 and 8, any indices shape, on every ISA variant; an index
outside [0, N) is an ORT error naming it and N."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvflow.plugins import ort_custom_ops, ort_isa
from kvflow.runtime.ort_graph_linear import pack_blocks
from tests.test_matmul_q_op import make_weight, needs_library


def gather_q_model(weight: dict[str, np.ndarray], indices_dims: list) -> bytes:
    k, n = weight["codes"].shape
    packed = pack_blocks(weight["codes"], weight["scale"], weight.get("minimum"))
    assert packed is not None
    node = helper.make_node("GatherQ", ["blocks", "indices"], ["y"], domain="kvflow",
                            bits=4 if "minimum" in weight else 8, K=k, N=n)
    graph = helper.make_graph(
        [node], "gather_q",
        [helper.make_tensor_value_info("indices", TensorProto.INT64, indices_dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*indices_dims, k])],
        [numpy_helper.from_array(packed, "blocks")])
    return helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("kvflow", 1)]).SerializeToString()


def session(model: bytes, isa: str | None = None) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(ort_custom_ops.library(isa=isa)))
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def table(weight: dict[str, np.ndarray]) -> np.ndarray:
    """The dequantized table [N, K] in fp32, each element d * q (+ m) rounded as fp32 does."""
    k = weight["codes"].shape[0]
    scale = np.repeat(weight["scale"], 32, axis=0)[:k].astype(np.float32)
    w = scale * weight["codes"].astype(np.float32)
    if "minimum" in weight:
        w = w + np.repeat(weight["minimum"], 32, axis=0).astype(np.float32)
    return np.ascontiguousarray(w.T)


@needs_library
@pytest.mark.parametrize("isa", ort_isa.runnable())
@pytest.mark.parametrize("scheme", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("k,n", [(32, 1), (96, 37), (608, 129)])
def test_gather_q_equals_the_dequantized_table(isa, scheme, k, n):
    weight = make_weight(scheme, k, n, seed=n)
    expected = table(weight)
    rng = np.random.default_rng(k)
    s = session(gather_q_model(weight, ["B", "T"]), isa)
    for shape in ((1, 1), (2, 5), (3, n)):
        idx = rng.integers(0, n, shape).astype(np.int64)
        idx.flat[0] = n - 1
        y = s.run(None, {"indices": idx})[0]
        assert y.shape == (*shape, k) and y.dtype == np.float32
        np.testing.assert_array_equal(y, expected[idx])


@needs_library
def test_gather_q_one_dimensional_and_empty_indices():
    weight = make_weight("Q4_1", 64, 10)
    s = session(gather_q_model(weight, ["T"]))
    idx = np.array([9, 0, 3, 3], np.int64)
    np.testing.assert_array_equal(s.run(None, {"indices": idx})[0], table(weight)[idx])
    assert s.run(None, {"indices": np.zeros(0, np.int64)})[0].shape == (0, 64)


@needs_library
@pytest.mark.parametrize("bad", [10, -1, 1 << 40])
def test_an_index_out_of_range_is_an_error_naming_it_and_n(bad):
    weight = make_weight("Q8_0", 64, 10)
    s = session(gather_q_model(weight, ["T"]))
    with pytest.raises(Exception, match=rf"GatherQ: index {bad} .*outside \[0, N = 10\)"):
        s.run(None, {"indices": np.array([1, bad, 2], np.int64)})
