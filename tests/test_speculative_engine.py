"""Speculative decoding in the engine: greedy outputs equal the non-speculative engine's token
for token, on the tiny models (both CPU runners) and the default model, over chunked prefill,
preemption (recompute and swap), prefix-cache hits, ``n > 1``, stop conditions and logprobs;
drafts are verified and counted, and every KV block comes back."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams

# Prompts whose continuations repeat them, so that prompt lookup drafts and some drafts pass.
PROMPTS = ["abcabcabcabcabcabc", "the cat sat on the mat. the cat sat on the mat. the cat",
           "0101010101010101", "xyz xyz xyz xyz"]


def generate(engine_dir, prompts, params, before=(), **options):
    """The outputs of ``prompts`` (after ``before``'s, run first on the same engine: cached),
    and the engine's counters; every KV block comes back."""
    with LLM(engine_dir, debug_checks=True, **options) as llm:
        if before:
            llm.generate(list(before), SamplingParams(max_tokens=1))
        outs = llm.generate(prompts, params)
        assert llm.engine.kv.pool.num_used_blocks == 0
        counters = llm.engine.counters.copy()
    return outs, counters


def assert_same_tokens(spec, plain):
    for a, b in zip(spec, plain, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.finish_reason for c in a.outputs] == [c.finish_reason for c in b.outputs]
        assert a.text == b.text


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 8},  # chunked prefill, and drafts clamped by the budget
    {"num_kv_blocks": 24, "preemption_mode": "recompute"},
    {"num_kv_blocks": 24, "preemption_mode": "swap"},
], ids=["plain", "chunked", "recompute", "swap"])
def test_greedy_outputs_equal_the_non_speculative_engine(tiny_engines, backend, options):
    engine = tiny_engines["llama-gqa4", backend]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain, _ = generate(engine, PROMPTS, params, **options)
    spec, counters = generate(engine, PROMPTS, params, speculative="ngram",
                              num_speculative_tokens=5, **options)
    assert_same_tokens(spec, plain)
    assert counters.spec_draft_tokens > 0
    assert 0 < counters.spec_accepted_tokens <= counters.spec_draft_tokens
    assert sum(o.num_draft_tokens for o in spec) == counters.spec_draft_tokens
    assert sum(o.num_accepted_tokens for o in spec) == counters.spec_accepted_tokens
    assert counters.generation_tokens == sum(o.num_output_tokens for o in spec)


def test_prefix_cache_hits_parallel_sampling_and_stops(tiny_engines):
    """A repeated prompt hits the prefix cache; n = 3 forks; stop strings, stop tokens and
    max_tokens end verified drafts where they must; logprobs come once per token."""
    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=30, temperature=0, n=3, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, stop=["at"], ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0, stop_token_ids=[52])]
    plain, _ = generate(engine, prompts, params, before=[PROMPTS[0]])
    spec, counters = generate(engine, prompts, params, before=[PROMPTS[0]],
                              speculative="ngram")
    assert_same_tokens(spec, plain)
    assert counters.prefix_cache_hits > 0
    for a, b in zip(spec[0].outputs[0].logprobs, plain[0].outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        for token in a:
            assert a[token] == pytest.approx(b[token], abs=1e-4)


def test_sampling_is_seeded_and_requests_may_opt_out(tiny_engines):
    """With speculation on, a seeded sampled request repeats itself exactly, and one that
    asks ``speculative=False`` gets the non-speculative engine's own tokens."""
    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    seeded = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    out = SamplingParams(max_tokens=30, temperature=0.8, seed=6, ignore_eos=True,
                         speculative=False)
    plain, _ = generate(engine, [PROMPTS[0]], [out])
    first, _ = generate(engine, [PROMPTS[0], PROMPTS[0]], [seeded, out], speculative="ngram")
    again, _ = generate(engine, [PROMPTS[0]], [seeded], speculative="ngram")
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids
    assert first[1].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert first[1].num_draft_tokens == 0


@pytest.mark.slow
def test_default_model_greedy_equals_without_speculation(default_engines):
    """The default model on the fp32 path: prompt lookup on text that repeats."""
    text = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
            "Rewrite the code above with type hints.\n")
    params = SamplingParams(max_tokens=60, temperature=0)
    options = {"quantized_matmul": "fp32", "kv_cache_dtype": "fp32"}
    plain, _ = generate(default_engines["onnxruntime"], [text], params, **options)
    spec, counters = generate(default_engines["onnxruntime"], [text], params,
                              speculative="ngram", **options)
    assert_same_tokens(spec, plain)
    assert counters.spec_accepted_tokens > 0


@pytest.mark.parametrize("draft", ["llama-gqa4", "llama-mha-tied"], ids=["self", "other"])
def test_draft_model_greedy_equals_the_target_alone(tiny_engines, draft):
    """A second engine drafts: the target's own (nearly every draft accepted) or another
    model of the same vocabulary (few). Greedy outputs are the target's alone either way, over
    preemption; sampled requests run through the draft's distributions; no block leaks (the
    draft's pool included: the engine checks its own, and the draft frees what is not
    running)."""
    target = tiny_engines["llama-gqa4", "onnxruntime"]
    drafter = tiny_engines[draft, "onnxruntime"]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    options = {"num_kv_blocks": 40, "preemption_mode": "recompute"}
    plain, _ = generate(target, PROMPTS, params, **options)
    with LLM(target, debug_checks=True, speculative="draft", draft_engine=str(drafter),
             num_speculative_tokens=4, **options) as llm:
        spec = llm.generate(PROMPTS, params)
        counters = llm.engine.counters.copy()
        sampled = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.9,
                                                       seed=3, ignore_eos=True))
        assert all(o.num_output_tokens == 20 for o in sampled)
        proposer = llm.engine.speculation.proposer
        llm.generate(["x"], SamplingParams(max_tokens=3))  # a step after the others ended
        assert set(proposer.kv.block_tables) <= {r.request_id for r in
                                                 llm.engine.scheduler.running}
        proposer.kv.check_integrity()
    assert_same_tokens(spec, plain)
    assert counters.spec_draft_tokens > 0
    if draft == "llama-gqa4":
        assert counters.spec_accepted_tokens >= 0.8 * counters.spec_draft_tokens


def test_draft_engine_is_checked(tiny_engines):
    target = tiny_engines["llama-gqa4", "onnxruntime"]
    with pytest.raises(ValueError, match="draft_engine"):
        LLM(target, speculative="draft")
    with pytest.raises(ValueError, match="draft_engine"):
        LLM(target, draft_engine=str(target))
