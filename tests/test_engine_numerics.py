"""Both CPU runners against HF transformers on tiny random-weight models of each family."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import onnx  # noqa: E402

from kvflow.kv_manager import KVCacheManager  # noqa: E402
from kvflow.runtime import create_runner  # noqa: E402
from kvflow.runtime.step_builder import SeqChunk, build_step  # noqa: E402
from tests.conftest import TINY_MODELS  # noqa: E402

RUNNERS = ["onnxruntime", "torch"]
TOL = 1e-4  # fp32 throughout: the KV cache too (the onnxruntime runner's default is fp16)
FP32 = {"kv_cache_dtype": "fp32"}
# The ONNX export is what makes a tiny engine slow to build (seconds): the quick run
# (-m "not slow") builds two families' ONNX engines, the full run every family's.
QUICK_ONNX = ("llama-gqa4", "qwen2-bias")


def quick_unless_onnx(model_name: str, runner_name: str = "onnxruntime") -> tuple:
    """The slow marker for a tiny engine the quick run does not build."""
    quick = runner_name != "onnxruntime" or model_name in QUICK_ONNX
    return () if quick else (pytest.mark.slow,)


def hf_last_logits(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].numpy()


@pytest.mark.parametrize(("model_name", "runner_name"), [
    pytest.param(m, r, marks=quick_unless_onnx(m, r), id=f"{m}-{r}")
    for m in TINY_MODELS for r in RUNNERS])
def test_prefill_and_decode_match_hf(tiny_models, tiny_engines, model_name, runner_name):
    _, hf = tiny_models[model_name]
    runner = create_runner(runner_name, tiny_engines[model_name, runner_name], 64, **FP32)
    kv = KVCacheManager(64, 4)
    rng = np.random.default_rng(1)
    seq = rng.integers(3, 320, size=23).tolist()
    try:
        kv.allocate_slots("s", len(seq))
        logits = runner.execute(build_step(kv, [SeqChunk("s", seq, 0, len(seq), True)]))
        np.testing.assert_allclose(logits[0], hf_last_logits(hf, seq), atol=TOL, rtol=0)
        for _ in range(5):  # decode steps, each feeding the greedy token back
            seq.append(int(np.argmax(logits[0])))
            kv.allocate_slots("s", len(seq))
            logits = runner.execute(build_step(kv, [SeqChunk("s", seq, len(seq) - 1, 1, True)]))
            np.testing.assert_allclose(logits[0], hf_last_logits(hf, seq), atol=TOL, rtol=0)
    finally:
        runner.close()


@pytest.mark.parametrize("runner_name", RUNNERS)
def test_packed_mixed_step_equals_each_sequence_alone(tiny_models, tiny_engines, runner_name):
    """Three+ sequences in one step: one prefilling a chunk mid-prompt, one starting its prompt,
    two decoding; each sequence's logits equal those of running it alone."""
    _, hf = tiny_models["llama-gqa4"]
    runner = create_runner(runner_name, tiny_engines["llama-gqa4", runner_name], 128, **FP32)
    rng = np.random.default_rng(2)
    seqs = {name: rng.integers(3, 320, size=n).tolist()
            for name, n in (("chunked", 30), ("fresh", 9), ("dec1", 13), ("dec2", 6))}
    kv = KVCacheManager(128, 4)
    try:
        # Earlier steps: the first 17 tokens of "chunked", all but the last token of the decoders.
        pre = [SeqChunk("chunked", seqs["chunked"], 0, 17, False),
               SeqChunk("dec1", seqs["dec1"], 0, 12, False),
               SeqChunk("dec2", seqs["dec2"], 0, 5, False)]
        for c in pre:
            kv.allocate_slots(c.request_id, c.start + c.num_new)
        runner.execute(build_step(kv, pre))
        step = [SeqChunk("dec1", seqs["dec1"], 12, 1, True),
                SeqChunk("chunked", seqs["chunked"], 17, 8, True),
                SeqChunk("fresh", seqs["fresh"], 0, 9, True),
                SeqChunk("dec2", seqs["dec2"], 5, 1, True)]
        for c in step:
            kv.allocate_slots(c.request_id, c.start + c.num_new)
        kv.check_integrity()
        logits = runner.execute(build_step(kv, step))
        for row, c in enumerate(step):
            ref = hf_last_logits(hf, seqs[c.request_id][: c.start + c.num_new])
            np.testing.assert_allclose(logits[row], ref, atol=TOL, rtol=0,
                                       err_msg=f"sequence {c.request_id}")
    finally:
        runner.close()


def test_runners_agree_token_by_token(tiny_engines):
    """Chunked prefill (chunk 5) on one runner equals whole prefill on the other."""
    from tests.helpers import greedy_generate

    prompt = list(range(40, 77))
    outs = {}
    for name in RUNNERS:
        runner = create_runner(name, tiny_engines["qwen2-bias", name], 64, **FP32)
        try:
            outs[name] = greedy_generate(runner, prompt, 12, chunk=5 if name == "torch" else None)
        finally:
            runner.close()
    assert outs["torch"][0] == outs["onnxruntime"][0]
    np.testing.assert_allclose(np.stack(outs["torch"][1]), np.stack(outs["onnxruntime"][1]),
                               atol=TOL, rtol=0)


@pytest.mark.parametrize("model_name", [pytest.param(m, marks=quick_unless_onnx(m))
                                        for m in TINY_MODELS])
def test_onnx_graph_is_valid_with_one_paged_attention_per_layer(tiny_engines, model_name):
    path = tiny_engines[model_name, "onnxruntime"] / "model.onnx"
    onnx.checker.check_model(str(path))
    graph = onnx.load(str(path), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == "PagedAttention"]
    assert len(nodes) == 2  # num_hidden_layers of the tiny models
    assert {n.domain for n in nodes} == {"kvflow"}
    assert sorted(a.i for n in nodes for a in n.attribute if a.name == "layer_idx") == [0, 1]
    names = [i.name for i in graph.input]
    assert names == ["input_ids", "positions", "kv_cache_ptrs", "slot_mapping", "block_tables",
                     "seq_lens", "query_start_loc", "logits_indices"]
    assert [o.name for o in graph.output] == ["logits"]
