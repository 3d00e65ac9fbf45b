"""Prompt logprobs (``SamplingParams.prompt_logprobs``): HF transformers' log-softmax on the
same weights, whatever the chunking, the prefix cache, preemption or ``n``."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow import LLM, SamplingParams
from kvflow.orchestrator.outputs import TokenLogprobs

torch = pytest.importorskip("torch")

TOL = 1e-4
K = 5


def hf_prompt_logprobs(hf, prompt: list[int]) -> np.ndarray:
    """HF's log-softmax at every prompt position ``[len(prompt), vocab]``."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def assert_match_hf(entries, prompt: list[int], reference: np.ndarray, k: int) -> None:
    """Entry p holds prompt token p's logprob and the top k at position p - 1, as HF's."""
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for p in range(1, len(prompt)):
        row, entry = reference[p - 1], entries[p]
        top = np.argsort(-row, kind="stable")[:k].tolist()
        assert set(entry) == {prompt[p], *top}, p
        for token, value in entry.items():
            assert abs(value - row[token]) < TOL, (p, token)


def prompts(seed: int, sizes: tuple[int, ...]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, size=n).tolist() for n in sizes]


def params(k: int | None = K, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 3, "temperature": 0.0, "ignore_eos": True,
                             "prompt_logprobs": k, **kw})


@pytest.mark.parametrize("runner_name", ["torch", "onnxruntime"])
def test_prompt_logprobs_equal_hf_log_softmax(tiny_models, tiny_engines, runner_name):
    _, hf = tiny_models["llama-gqa4"]
    batch = prompts(1, (23, 9, 2, 1))
    with LLM(tiny_engines["llama-gqa4", runner_name], quantized_matmul="fp32",
             kv_cache_dtype="fp32") as llm:
        outs = llm.generate(batch, [params(), params(0), params(20), params()])
    for out, prompt, k in zip(outs, batch, (K, 0, 20, K), strict=True):
        assert_match_hf(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), k)
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].num_tokens == 3  # the generation goes on as without them


def test_k0_gives_the_prompt_tokens_alone_and_typed_view(tiny_engines):
    prompt = prompts(2, (12,))[0]
    with LLM(tiny_engines["llama-gqa4", "torch"]) as llm:
        out = llm.generate([prompt], params(0))[0]
    assert [None if e is None else list(e) for e in out.prompt_logprobs] == [
        None, *([t] for t in prompt[1:])]
    typed = out.prompt_token_logprobs()
    assert typed[0] is None and len(typed) == len(prompt)
    assert all(isinstance(t, TokenLogprobs) and t.token_id == tok and t.logprob is not None
               and t.logprob <= 0 for t, tok in zip(typed[1:], prompt[1:], strict=True))


def test_not_asked_gives_none_and_outputs_carry_them_once(tiny_engines):
    prompt = prompts(3, (14,))[0]
    with LLM(tiny_engines["llama-gqa4", "torch"], max_num_batched_tokens=4) as llm:
        assert llm.generate([prompt], params(None))[0].prompt_logprobs is None
        engine = llm.engine
        engine.add_request(prompt, params(max_tokens=4), request_id="r")
        carried = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                carried.append(out.prompt_logprobs is not None)
    # Four outputs (one per token); the first carries them, the prompt's last chunk's step.
    assert carried == [True, False, False, False]


def test_chunked_prefill_equals_one_long_prefill(tiny_engines):
    batch = prompts(4, (30, 17))
    engine_dir = tiny_engines["llama-gqa4", "torch"]
    with LLM(engine_dir) as llm:
        whole = [o.prompt_logprobs for o in llm.generate(batch, params())]
    for options in ({"max_num_batched_tokens": 5}, {"long_prefill_token_threshold": 3}):
        with LLM(engine_dir, **options) as llm:
            chunked = [o.prompt_logprobs for o in llm.generate(batch, params())]
            assert max(n for s in llm.engine.step_stats for _, n in s.scheduled) <= 5
        for a, b in zip(whole, chunked, strict=True):
            assert a[0] is None and b[0] is None and len(a) == len(b)
            for x, y in zip(a[1:], b[1:], strict=True):
                assert x.keys() == y.keys()
                assert all(abs(x[t] - y[t]) < 1e-5 for t in x)


def test_cached_prefix_is_recomputed_and_counted(tiny_models, tiny_engines):
    _, hf = tiny_models["llama-gqa4"]
    prompt = prompts(5, (22,))[0]
    with LLM(tiny_engines["llama-gqa4", "torch"], enable_prefix_caching=True) as llm:
        llm.generate([prompt], params(None))  # fills the cache
        hits = llm.engine.counters.prefix_cache_hits
        out = llm.generate([prompt], params())[0]
        counters = llm.engine.counters
        assert counters.prefix_cache_hits == hits  # no hit taken
        assert counters.prompt_logprobs_recomputed_tokens == (len(prompt) - 1) // 4 * 4
        # Without prompt logprobs the same prompt takes its cached blocks again.
        llm.generate([prompt], params(None))
        assert llm.engine.counters.prefix_cache_hits > hits
    assert out.cached_tokens == 0
    assert_match_hf(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), K)


def test_chunked_under_the_step_budget_they_equal_hf(tiny_models, tiny_engines):
    """A time target (max_step_ms) chunks the prompt from the first step, before anything is
    measured (FIRST_STEP_TOKENS); later chunks follow the measured cost, whatever it is, and
    the entries do not depend on it."""
    from kvflow.orchestrator.scheduler.step_budget import FIRST_STEP_TOKENS

    _, hf = tiny_models["llama-gqa4"]
    prompt = prompts(8, (100,))[0]
    with LLM(tiny_engines["llama-gqa4", "torch"], max_step_ms=200.0,
             enable_prefix_caching=False) as llm:
        out = llm.generate([prompt], params())[0]
        first = llm.engine.step_stats[0]
    assert first.scheduled == [(out.request_id, FIRST_STEP_TOKENS)]
    assert_match_hf(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), K)


def test_a_repeat_takes_its_cached_prefix_with_the_kept_entries(tiny_models, tiny_engines):
    """A prompt computed with prompt logprobs keeps its full blocks' entries beside the prefix
    cache: a repeat (same k) takes the cached blocks and their entries and computes the rest;
    another k, or a prompt that diverges, takes only what was kept for it."""
    _, hf = tiny_models["llama-gqa4"]
    prompt = prompts(9, (30,))[0]
    fork = prompt[:13] + prompts(10, (9,))[0]
    with LLM(tiny_engines["llama-gqa4", "torch"], enable_prefix_caching=True) as llm:
        bs = llm.engine.kv.block_size
        c = llm.engine.counters
        first = llm.generate([prompt], params())[0]
        assert first.cached_tokens == 0
        hits = c.prefix_cache_hits
        again = llm.generate([prompt], params())[0]
        assert again.cached_tokens == (len(prompt) - 1) // bs * bs > 0
        assert c.prefix_cache_hits - hits == again.cached_tokens
        n = again.cached_tokens
        # The cached prefix's entries are the kept ones; the rest computed again, alike.
        assert all(a is b for a, b in zip(again.prompt_logprobs[1:n + 1],
                                          first.prompt_logprobs[1:n + 1], strict=True))
        for a, b in zip(again.prompt_logprobs[n + 1:], first.prompt_logprobs[n + 1:],
                        strict=True):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)
        other_k = llm.generate([prompt], params(2))[0]
        assert other_k.cached_tokens == 0  # kept for k=5, not for k=2
        diverged = llm.generate([fork], params())[0]
        assert diverged.cached_tokens == 13 // bs * bs
        llm.engine.kv.check_integrity()
    for out, p, k in ((again, prompt, K), (other_k, prompt, 2), (diverged, fork, K)):
        assert_match_hf(out.prompt_logprobs, p, hf_prompt_logprobs(hf, p), k)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_neither_repeats_nor_loses_an_entry(tiny_models, tiny_engines, mode):
    _, hf = tiny_models["llama-gqa4"]
    batch = prompts(6, (10, 10, 10, 10, 10, 10))
    with LLM(tiny_engines["llama-gqa4", "torch"], num_kv_blocks=12, preemption_mode=mode,
             kv_watermark=0.0, enable_prefix_caching=True, swap_space_bytes=1 << 20,
             max_num_batched_tokens=8) as llm:
        outs = llm.generate(batch, params(max_tokens=12))
        assert llm.engine.counters.preemptions > 0
        llm.engine.kv.check_integrity()
    for out, prompt in zip(outs, batch, strict=True):
        assert_match_hf(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), K)


def test_parallel_sampling_gives_them_once_per_request(tiny_models, tiny_engines):
    _, hf = tiny_models["llama-gqa4"]
    prompt = prompts(7, (13,))[0]
    with LLM(tiny_engines["llama-gqa4", "torch"]) as llm:
        out = llm.generate([prompt], params(n=3, temperature=1.0, seed=1))[0]
    assert len(out.outputs) == 3
    assert_match_hf(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), K)


@pytest.mark.parametrize("bad", [-1, 21, 1000])
def test_bad_k_is_a_value_error_naming_the_field(bad):
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\]"):
        SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams.from_dict({"prompt_logprobs": "3"})


def test_the_simulator_refuses_them_and_still_runs():
    from kvflow.orchestrator.engine import LLMEngine
    from kvflow.orchestrator.options import EngineOptions
    from kvflow.sim.cost_model import FixedCostModel
    from kvflow.sim.runner import SIM_EOS, SimClock, SimRunner, sim_engine_config

    clock = SimClock()
    runner = SimRunner(sim_engine_config(16, 256, 64, 8), 64, FixedCostModel(0.01), clock)
    engine = LLMEngine(runner, None, EngineOptions(max_model_len=256), (SIM_EOS,), clock=clock)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request([1, 2, 3], SamplingParams(prompt_logprobs=1))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.counters.finished == 1
