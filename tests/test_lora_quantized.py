"""LoRA on a quantized engine's graph: a tiny model written as a Q8_0 GGUF (as llama.cpp's
converter would) keeps its blocks on the onnxruntime backend. With fp32 matmuls (the blocks
dequantized at load) an adapter in a slot gives the logits of the dequantized model with the
adapter merged; with int8 activations (``kvflow::MatMulQ``) the LoraMatMul nodes sit after the
native matmuls, and a sequence of the base model beside one of an adapter is exactly the base's.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from kvflow.build.engine_config import EngineConfig  # noqa: E402
from kvflow.plugins import ort_custom_ops  # noqa: E402
from kvflow.runtime.ort_graph_lora import LORA_OP_TYPE  # noqa: E402
from kvflow.runtime.ort_runner import OnnxRuntimeRunner  # noqa: E402
from kvflow.runtime.torch_runner import TorchRunner, load_model  # noqa: E402
from tests.test_lora_runners import (  # noqa: E402
    ALL,
    PROMPT_A,
    PROMPT_B,
    SOME,
    merged,
    random_adapter,
    with_slots,
)
from tests.test_ort_runner import step  # noqa: E402

pytestmark = pytest.mark.skipif(
    ort_custom_ops.library() is None,
    reason=f"the native op is unavailable: {ort_custom_ops.unavailable_reason()}")


@pytest.fixture(scope="module")
def q8_engines(tiny_models, tmp_path_factory):
    """backend -> engine folder built from the Q8_0 GGUF of the tiny llama (the torch one holds
    the dequantized weights)."""
    from kvflow.build.builder import build_engine
    from tests.gguf_convert import convert

    folder, _ = tiny_models["llama-gqa4"]
    root = tmp_path_factory.mktemp("lora-q8")
    gguf = convert(folder, root / "tiny-q8_0.gguf", outtype="Q8_0")
    out = {}
    for backend in ("onnxruntime", "torch"):
        out[backend] = root / backend
        build_engine(str(gguf), out[backend], backend=backend, max_model_len=256,
                     max_num_tokens=256, max_batch_size=16, block_size=4,
                     progress=lambda _m: None)
    return out


def ort_runner(path, quantized_matmul: str) -> OnnxRuntimeRunner:
    return OnnxRuntimeRunner(path, EngineConfig.load(path), 64, threads=1, attention="native",
                             quantized_matmul=quantized_matmul, max_loras=2, max_lora_rank=8)


def test_fp32_matmuls_equal_the_dequantized_merged_model(q8_engines):
    engine = EngineConfig.load(q8_engines["torch"])
    base = load_model(q8_engines["torch"], engine)
    adapter = random_adapter(base, "all", ALL, seed=7)
    reference = TorchRunner(q8_engines["torch"], engine, 64, model=merged(base, adapter))
    runner = ort_runner(q8_engines["onnxruntime"], "fp32")
    try:
        runner.load_lora(0, adapter)
        seq = (PROMPT_A, 0, 31, [3, 1, 4, 15, 9, 2, 6, 5])
        np.testing.assert_allclose(runner.execute(with_slots([seq], [0], 4)),
                                   reference.execute(step([seq], 4)), atol=1e-4, rtol=0)
    finally:
        runner.close()
        reference.close()


def test_int8_activations_keep_base_rows_exact_beside_an_adapter(q8_engines):
    engine = EngineConfig.load(q8_engines["torch"])
    base = load_model(q8_engines["torch"], engine)
    adapter = random_adapter(base, "some", SOME, seed=8)
    reference = TorchRunner(q8_engines["torch"], engine, 64, model=merged(base, adapter))
    runner = ort_runner(q8_engines["onnxruntime"], "int8")
    try:
        graph = runner.graphs[0].graph
        ops = [n.op_type for n in graph.node]
        assert ops.count("MatMulQ") >= 4 * engine.model.num_hidden_layers
        assert ops.count(LORA_OP_TYPE) == 4 * engine.model.num_hidden_layers
        runner.load_lora(1, adapter)
        a = (PROMPT_A, 0, 31, [1, 2, 3, 4, 5, 6, 7, 8])
        b = (PROMPT_B, 0, 13, [9, 10, 11, 12])
        mixed = runner.execute(with_slots([a, b], [1, -1], 4))
        np.testing.assert_array_equal(mixed[1], runner.execute(step([a, b], 4))[1])
        # int8 activations round: near the dequantized merged model, nowhere near the base's.
        want = reference.execute(step([a], 4))[0]
        cos = float(np.dot(mixed[0], want) / np.linalg.norm(mixed[0]) / np.linalg.norm(want))
        assert cos > 0.99
        base_a = runner.execute(step([a], 4))[0]
        assert np.abs(mixed[0] - want).max() < np.abs(base_a - want).max()
    finally:
        runner.close()
        reference.close()
