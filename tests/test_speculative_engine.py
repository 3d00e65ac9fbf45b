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
                              num_speculative_tokens=5, speculative_draft_length="fixed",
                              **options)
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


# Low temperatures: the tiny model's (random) output then loops, as its greedy output does,
# and prompt lookup drafts it.
SAMPLED = [SamplingParams(max_tokens=40, temperature=0.2, top_p=0.9, seed=5, ignore_eos=True),
           SamplingParams(max_tokens=40, temperature=0.25, top_k=20, seed=6, n=2,
                          ignore_eos=True),
           SamplingParams(max_tokens=40, temperature=0.2, min_p=0.1, presence_penalty=0.1,
                          seed=7, ignore_eos=True),
           SamplingParams(max_tokens=40, temperature=0.5, seed=8, ignore_eos=True,
                          speculative=False)]


@pytest.mark.parametrize("spec", [
    {"num_speculative_tokens": 1, "speculative_draft_length": "fixed"},
    {"num_speculative_tokens": 5, "speculative_draft_length": "fixed"},
    {"num_speculative_tokens": 3, "speculative_draft_length": "fixed",
     "max_num_batched_tokens": 8},  # drafts cut by the budget
    {"num_speculative_tokens": 4},  # as many as the step-time fit grants (maybe none)
], ids=["one", "five", "budget", "dynamic"])
def test_seeded_sampling_equals_the_non_speculative_engine(tiny_engines, spec):
    """Seeded sampled requests (``n = 2`` among them) emit the non-speculative engine's
    tokens, token for token, whatever their draft count; alone or beside others."""
    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    budget = {k: v for k, v in spec.items() if k == "max_num_batched_tokens"}
    plain, _ = generate(engine, prompts, SAMPLED, **budget)
    both, counters = generate(engine, prompts, SAMPLED, speculative="ngram", **spec)
    alone, _ = generate(engine, prompts[:1], SAMPLED[:1], speculative="ngram", **spec)
    assert_same_tokens(both, plain)
    assert_same_tokens(alone, plain[:1])
    if spec.get("speculative_draft_length") == "fixed":
        assert counters.spec_accepted_tokens > 0
    assert both[3].num_draft_tokens == 0  # it asked for no speculation
    assert len({t for o in plain for c in o.outputs for t in c.token_ids}) > 10  # it sampled


@pytest.mark.slow
def test_default_model_greedy_equals_without_speculation(default_engines):
    """The default model on the fp32 path: prompt lookup on text that repeats."""
    text = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
            "Rewrite the code above with type hints.\n")
    params = SamplingParams(max_tokens=60, temperature=0)
    options = {"quantized_matmul": "fp32", "kv_cache_dtype": "fp32"}
    plain, _ = generate(default_engines["onnxruntime"], [text], params, **options)
    spec, counters = generate(default_engines["onnxruntime"], [text], params,
                              speculative="ngram", speculative_draft_length="fixed", **options)
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
    # Fixed length: the dynamic fit may grant a poor drafter no drafts on a busy machine.
    with LLM(target, debug_checks=True, speculative="draft", draft_engine=str(drafter),
             num_speculative_tokens=4, speculative_draft_length="fixed", **options) as llm:
        spec = llm.generate(PROMPTS, params)
        counters = llm.engine.counters.copy()
        before = llm.engine.counters.copy()
        sampled = llm.generate(PROMPTS, SAMPLED)
        sampled_drafts = llm.engine.counters.spec_draft_tokens - before.spec_draft_tokens
        sampled_accepted = (llm.engine.counters.spec_accepted_tokens
                            - before.spec_accepted_tokens)
        proposer = llm.engine.speculation.proposer
        llm.generate(["x"], SamplingParams(max_tokens=3))  # a step after the others ended
        assert set(proposer.kv.block_tables) <= {r.request_id for r in
                                                 llm.engine.scheduler.running}
        proposer.kv.check_integrity()
        racing = llm.engine.sampler.coupled  # a draft model may have it draw by the race
    assert_same_tokens(spec, plain)
    # Sampled: the seeded non-speculative tokens (drawn the same way), token for token.
    with LLM(target, **options) as alone:
        alone.engine.sampler.coupled = racing
        assert_same_tokens(sampled, alone.generate(PROMPTS, SAMPLED))
    assert counters.spec_draft_tokens > 0 and sampled_drafts > 0
    if draft == "llama-gqa4":
        assert counters.spec_accepted_tokens >= 0.8 * counters.spec_draft_tokens
        # The draft draws with the request's own uniforms: the target's own weights draft
        # the very tokens the target samples.
        assert sampled_accepted >= 0.8 * sampled_drafts


def test_draft_model_racing_equals_the_racing_engine(tiny_engines):
    """Drafts and tokens drawn by the race (``Sampler.coupled``, the draft proposer's
    ``coupled``): seeded outputs are the non-speculative racing engine's, token for token,
    and the target's own weights drafting are accepted nearly always."""
    target = tiny_engines["llama-gqa4", "onnxruntime"]
    with LLM(target) as llm:
        llm.engine.sampler.coupled = True
        plain = llm.generate(PROMPTS, SAMPLED)
    with LLM(target, speculative="draft", draft_engine=str(target),
             num_speculative_tokens=4, speculative_draft_length="fixed") as llm:
        llm.engine.sampler.coupled = llm.engine.speculation.proposer.coupled = True
        spec = llm.generate(PROMPTS, SAMPLED)
        counters = llm.engine.counters.copy()
    assert_same_tokens(spec, plain)
    assert counters.spec_accepted_tokens >= 0.8 * counters.spec_draft_tokens > 0


def test_draft_catch_up_is_chunked_under_the_token_budget(tiny_engines):
    """A prompt longer than the budget is caught up chunk by chunk, drafting nothing until
    it is; then its drafts are those of a catch-up in one go (greedy)."""
    from kvflow.orchestrator.request import Request

    target = tiny_engines["llama-gqa4", "onnxruntime"]
    with LLM(target, speculative="draft", draft_engine=str(target)) as llm:
        proposer = llm.engine.speculation.proposer
        prompt = [(7 * i) % 50 + 3 for i in range(30)]
        params = SamplingParams(temperature=0, max_tokens=10)
        chunked = Request("chunked", prompt, params, 0.0)
        computed = []
        for _ in range(3):
            assert proposer.propose([chunked], [3], token_budget=8) == [[]]
            computed.append(len(chunked.proposer_state.tokens))
        assert computed == [8, 16, 24]
        # Six tokens left: they fit; the drafts come. Another request's catch-up (30
        # tokens) does not fit beside them: it waits.
        other = Request("other", prompt, params, 0.0)
        drafts = proposer.propose([chunked, other], [3, 3], token_budget=8)
        assert len(drafts[0]) == 3 and drafts[1] == []
        assert len(other.proposer_state.tokens) == 2  # what was left of the budget
        whole = Request("whole", prompt, params, 0.0)
        assert proposer.propose([whole], [3]) == [drafts[0]]
        proposer.kv.check_integrity()
        proposer.retain(set())
        assert not proposer.kv.block_tables


def test_draft_engine_is_checked(tiny_engines):
    target = tiny_engines["llama-gqa4", "onnxruntime"]
    with pytest.raises(ValueError, match="draft_engine"):
        LLM(target, speculative="draft")
    with pytest.raises(ValueError, match="draft_engine"):
        LLM(target, draft_engine=str(target))


def test_a_group_whose_prompt_ends_one_token_into_a_step_gets_every_first_token(tiny_engines):
    """``n = 2`` with drafts, and a prompt whose last chunk is one token (17 = 8 + 8 + 1): the
    leader's first token is every member's too, so that step is not speculative; every
    sequence then runs to its length (it once hung with the member's first token missing)."""
    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    prompt = [5, 6, 7, 8] * 4 + [5]  # repeats: the n-gram proposer drafts while it prefills
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=3, n=2, ignore_eos=True)
    with LLM(engine, debug_checks=True, speculative="ngram", num_speculative_tokens=3,
             speculative_draft_length="fixed", max_num_batched_tokens=8,
             max_step_ms=0) as llm:
        llm.engine.add_request(prompt, params, request_id="g")
        outputs = []
        for _ in range(200):  # bounded: a missing first token would step forever
            outputs += [o for o in llm.engine.step() if o.finished]
            if not llm.engine.has_unfinished_requests():
                break
        assert not llm.engine.has_unfinished_requests()
    (out,) = outputs
    assert [len(c.token_ids) for c in out.outputs] == [12, 12]
