"""Sliding-window release on a real model: a tiny random-weight Mistral (every layer windowed,
7 tokens) through the engine on the torch and ONNX Runtime runners, with prefix caching on and a
pool too small for a whole sequence, gives HF's greedy tokens and those of a pool that holds
everything (the kernels never read the null entries of released blocks)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvflow import SamplingParams  # noqa: E402
from kvflow.orchestrator.llm import create_engine  # noqa: E402
from tests.helpers import assert_same_or_near_tie  # noqa: E402
from tests.test_model_families import hf_greedy, make_family_model  # noqa: E402

WINDOW, NEW_TOKENS, STEP_TOKENS = 7, 14, 16


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(HF model, backend -> engine folder) of the families' tiny Mistral (window 7, block 4),
    each engine built when first asked for."""
    from kvflow.build.builder import build_engine

    root = tmp_path_factory.mktemp("kv-window-mistral")
    hf = make_family_model("mistral", root / "hf")
    built: dict[str, object] = {}

    def engine(backend: str):  # type: ignore[no-untyped-def]
        if backend not in built:
            built[backend] = root / backend
            build_engine(str(root / "hf"), root / backend, backend=backend, max_model_len=128,
                         max_num_tokens=64, max_batch_size=4, block_size=4,
                         progress=lambda _m: None)
        return built[backend]

    return hf, engine


def run_waves(engine_dir, runner, waves, num_kv_blocks):  # type: ignore[no-untyped-def]
    """Greedy tokens and cached prompt tokens per request of each wave (a wave starts once the
    previous one finished), and the most real blocks one sequence held."""
    engine = create_engine(engine_dir, runner=runner, kv_cache_dtype="fp32",
                           num_kv_blocks=num_kv_blocks, enable_prefix_caching=True,
                           max_num_batched_tokens=STEP_TOKENS, kv_watermark=0.0,
                           debug_checks=True)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    tokens, cached, held = {}, {}, 0
    try:
        assert engine.kv.sliding_window == WINDOW
        for wave in waves:
            for rid, prompt in wave.items():
                _, rejected = engine.add_request(prompt, params, request_id=rid)
                assert rejected is None, rejected.error
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        tokens[o.request_id] = list(o.outputs[0].token_ids)
                        cached[o.request_id] = o.cached_tokens
                held = max([held, *(sum(1 for b in t if b) for t in
                                    engine.kv.block_tables.values())])
        assert engine.kv.pool.num_used_blocks == 0
    finally:
        engine.close()
    return tokens, cached, held


@pytest.mark.parametrize("runner", ["torch", "onnxruntime"])
def test_a_small_pool_that_releases_gives_hf_tokens_and_hits_the_cache_past_the_window(
        mistral, runner):
    hf, engines = mistral
    engine_dir = engines(runner)
    rng = np.random.default_rng(7)
    a = rng.integers(3, 320, 40).tolist()
    b = a[:32] + rng.integers(3, 320, 8).tolist()  # shares 8 full blocks with a
    waves = [{"a": a}, {"b": b, "c": list(a)}]
    # 13 usable blocks hold 52 tokens; each sequence is 40 + 14 = 54 tokens long, and two run
    # together: only released blocks make room.
    tight, tight_cached, tight_held = run_waves(engine_dir, runner, waves, num_kv_blocks=14)
    roomy, _, _ = run_waves(engine_dir, runner, waves, num_kv_blocks=200)
    bound = -(-(WINDOW - 1 + STEP_TOKENS) // 4) + 1
    assert tight_held <= bound
    assert tight_cached["c"] > 0 and tight_cached["b"] > 0  # hits that end in the window
    assert tight == roomy
    for rid, prompt in (("a", a), ("b", b), ("c", a)):
        want, want_logits = hf_greedy(hf, prompt, NEW_TOKENS)
        assert_same_or_near_tie(tight[rid], want, want_logits)
