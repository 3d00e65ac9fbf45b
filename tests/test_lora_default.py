"""LoRA on the default model's engines (SmolLM2-135M, its GGUF's Q4_1 + Q8_0 blocks kept on the
onnxruntime backend): the LoraMatMul nodes land in every layer of every precision variant, an
adapter gives the same logits on the onnxruntime runner (fp32 matmuls) as on the PyTorch
runner, and with int8 activations (``kvflow::MatMulQ``) base rows beside adapters stay exact."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvflow.build.engine_config import EngineConfig  # noqa: E402
from kvflow.plugins import ort_custom_ops  # noqa: E402
from kvflow.runtime import create_runner  # noqa: E402
from kvflow.runtime.ort_graph_lora import LORA_OP_TYPE  # noqa: E402
from tests.test_lora_runners import ALL, SOME, random_adapter, with_slots  # noqa: E402
from tests.test_ort_runner import step  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    ort_custom_ops.library() is None,
    reason=f"the native op is unavailable: {ort_custom_ops.unavailable_reason()}")]


def test_default_model_adapters_on_both_runners(default_engines):
    engine = EngineConfig.load(default_engines["torch"])
    layers = engine.model.num_hidden_layers
    torch_runner = create_runner("torch", default_engines["torch"], 64, max_loras=2,
                                 max_lora_rank=16)
    fp32 = create_runner("onnxruntime", default_engines["onnxruntime"], 64,
                         quantized_matmul="fp32", kv_cache_dtype="fp32", max_loras=2,
                         max_lora_rank=16)
    auto = create_runner("onnxruntime", default_engines["onnxruntime"], 64,
                         quantized_matmul="auto", max_loras=2, max_lora_rank=16)
    runners = (torch_runner, fp32, auto)
    try:
        model = torch_runner.model  # type: ignore[attr-defined]
        adapters = [random_adapter(model, "all", {m: 16 for m in ALL}, seed=11, scale=0.03),
                    random_adapter(model, "some", SOME, seed=12, scale=0.03)]
        for r in runners:
            for slot, adapter in enumerate(adapters):
                r.load_lora(slot, adapter)
        for graph in auto.graphs:  # type: ignore[attr-defined]
            assert sum(n.op_type == LORA_OP_TYPE for n in graph.graph.node) == 4 * layers
        rng = np.random.default_rng(3)
        prompts = [rng.integers(3, 40000, size=n).tolist() for n in (40, 23, 31)]
        seqs = [(p, 0, len(p), [1 + 3 * i + j for j in range(3)]) for i, p in enumerate(prompts)]
        mixed = with_slots(seqs, [0, 1, -1], 16)
        want = torch_runner.execute(mixed)
        got = fp32.execute(mixed)
        np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)
        assert (got.argmax(1) == want.argmax(1)).all()
        base = torch_runner.execute(step(seqs, 16))
        assert np.abs(want[:2] - base[:2]).max() > 0.1, "the adapters change the logits"
        np.testing.assert_array_equal(auto.execute(mixed)[2], auto.execute(step(seqs, 16))[2])
    finally:
        for r in runners:
            r.close()
