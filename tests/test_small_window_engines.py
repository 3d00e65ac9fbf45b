"""Engines whose limits are smaller than the thread-policy probe's defaults load and serve: the
probe steps stay within ``max_model_len``, ``max_num_tokens`` and ``max_batch_size``."""

from __future__ import annotations

import pytest

from kvflow.runtime import ort_threads

pytest.importorskip("torch")

PROMPT = [5, 6, 7, 8]


@pytest.mark.parametrize("max_model_len,max_num_tokens,max_batch_size", [
    (16, 16, 4), (16, 64, 2), (16, 256, 16), (100, 256, 1), (1024, 512, 32), (1, 4, 4),
])
def test_every_probe_step_fits_the_engine_limits(max_model_len, max_num_tokens, max_batch_size):
    largest = ort_threads.max_step_tokens(max_model_len, max_num_tokens, max_batch_size)
    sizes = ort_threads.probe_sizes(largest)
    assert max(sizes) == min(largest, max(ort_threads.PROBE_TOKENS))
    for tokens in sizes:
        seqs = ort_threads.probe_layout(tokens, max_model_len, max_batch_size)
        assert sum(s.new_tokens for s in seqs) == tokens
        assert 1 <= len(seqs) <= max_batch_size
        for s in seqs:
            assert 1 <= s.new_tokens <= s.context <= max_model_len


def test_a_default_size_engine_probes_as_before():
    """1, 8 and 64 decoding sequences 128 tokens long, and one 256-token prefill chunk."""
    sizes = ort_threads.probe_sizes(ort_threads.max_step_tokens(1024, 512, 64))
    assert sizes == (1, 8, 64, 256)
    for tokens in (1, 8, 64):
        assert ort_threads.probe_layout(tokens, 1024, 64) == [
            ort_threads.ProbeSequence(1, 128)] * tokens
    assert ort_threads.probe_layout(256, 1024, 64) == [ort_threads.ProbeSequence(256, 256)]


def test_a_probe_step_beyond_the_limits_is_refused_by_name():
    with pytest.raises(ValueError, match="max_model_len 16 x max_batch_size 2"):
        ort_threads.probe_layout(33, 16, 2)


@pytest.fixture(scope="module")
def small_window_engines(tiny_models, tmp_path_factory):
    """backend -> an engine of llama-gqa4 with a 16-token window."""
    from kvflow.build.builder import build_engine

    root = tmp_path_factory.mktemp("small-window")
    out = {}
    for backend in ("onnxruntime", "torch"):
        out[backend] = root / backend
        build_engine(str(tiny_models["llama-gqa4"][0]), out[backend], backend=backend,
                     max_model_len=16, max_num_tokens=64, max_batch_size=4, block_size=4,
                     progress=lambda _msg: None)
    return out


def greedy(engine, **kwargs) -> list[int]:
    from kvflow import LLM, SamplingParams

    with LLM(engine, **kwargs) as llm:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0,
                                                    ignore_eos=True))
    return list(out[0].outputs[0].token_ids)


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_an_engine_with_a_16_token_window_loads_and_generates_to_its_end(
        backend, small_window_engines, tiny_engines, tmp_path, monkeypatch):
    """The thread policy is measured afresh (an empty cache), and the 16-token engine's greedy
    tokens equal those of the same model built with a 256-token window."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    tokens = greedy(small_window_engines[backend])
    assert len(tokens) == 16 - len(PROMPT)
    assert tokens == greedy(tiny_engines["llama-gqa4", backend])


def test_a_quantized_small_engine_keeps_only_the_variants_its_steps_use(
        tiny_models, tmp_path, monkeypatch):
    """quantized_matmul=auto: steps of at most 16 tokens run int8 activations; an engine whose
    largest step is 16 tokens needs no fp32 variant for larger ones."""
    from kvflow.build.builder import build_engine
    from kvflow.build.engine_config import EngineConfig
    from kvflow.plugins import ort_custom_ops
    from kvflow.runtime.ort_runner import AUTO_INT8_MAX_TOKENS, OnnxRuntimeRunner

    if ort_custom_ops.library() is None:
        pytest.skip(f"the native op is unavailable: {ort_custom_ops.unavailable_reason()}")
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    engine = tmp_path / "engine"
    build_engine(str(tiny_models["llama-gqa4"][0]), engine, max_model_len=16,
                 max_num_tokens=AUTO_INT8_MAX_TOKENS, max_batch_size=1, block_size=4,
                 quantize="int4", group_size=32, progress=lambda _msg: None)
    with OnnxRuntimeRunner(engine, EngineConfig.load(engine), 16,
                           quantized_matmul="auto") as r:
        assert len(r._variants) == 1 and len(r.fusions) == 1
        assert r._variants[0][0] >= AUTO_INT8_MAX_TOKENS  # it covers every step
