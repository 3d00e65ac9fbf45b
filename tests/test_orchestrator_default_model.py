"""The in-flight batching engine on the default model: batching changes nothing a request sees."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from tests.helpers import assert_same_or_near_tie, greedy_generate

pytestmark = pytest.mark.slow  # the default model

TOPICS = ["the ocean", "a robot", "mountains", "coffee", "the moon", "a library", "winter",
          "trains", "music", "a garden", "the desert", "cats", "rain", "a market", "bridges",
          "the sun"]
PROMPTS = [f"Write one sentence about {t}." if i % 2 else f"Here is a short story about {t}:"
           for i, t in enumerate(TOPICS)]


@pytest.fixture(scope="module")
def llm(default_engines):
    # 30 blocks of 16 tokens = 480 token slots for 16 requests of ~10 + 24 tokens: too few for
    # all at once, so the scheduler must preempt; a 24-token budget forces chunked prefill.
    # fp32 matmuls: only they are batch-invariant (the 4-bit auto and int8 paths are not: a
    # step's size picks the path, and int8 activations round; docs/design.md). No step-time
    # bound: the steps' composition must not depend on how fast this machine is.
    with LLM(default_engines["onnxruntime"], num_kv_blocks=31, max_num_batched_tokens=48,
             long_prefill_token_threshold=6, kv_watermark=0.0,
             quantized_matmul="fp32", max_step_ms=0.0) as llm:
        yield llm


def test_sixteen_concurrent_greedy_requests_equal_each_alone(llm):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    stats = list(llm.engine.step_stats)
    assert max(s.num_scheduled_seqs for s in stats) >= 8, "requests did not share steps"
    assert llm.engine.counters.preemptions > 0, "the small KV pool forced no preemption"
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats), \
        "no step mixed a prefill chunk with decodes"
    assert llm.engine.kv.pool.num_used_blocks == 0
    runner = llm.engine.runner
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.finish_reason == "length" and len(out.token_ids) == 24
        alone, logits = greedy_generate(runner, llm.tokenizer.encode(prompt), 24)
        assert_same_or_near_tie(out.token_ids, alone, logits)


def test_seeded_sampling_is_independent_of_the_batch(llm):
    target = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    prompt = "My favourite food is"
    alone = llm.generate([prompt], target)[0]
    crowd_params = [SamplingParams(max_tokens=12, temperature=1.0, seed=i) for i in range(5)]
    crowd = llm.generate(["Tell me a joke.", prompt, "Count: one, two,", "Hello", prompt],
                         [crowd_params[0], target, crowd_params[1], crowd_params[2], target])
    assert crowd[1].token_ids == alone.token_ids
    assert crowd[4].token_ids == alone.token_ids
    assert crowd[1].text == alone.text
    other_seed = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.9,
                                                       top_p=0.95, seed=99))[0]
    assert other_seed.token_ids != alone.token_ids


def test_stop_strings_and_stop_token_ids_end_requests(llm):
    prompt = "The capital of France is"
    free = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    assert "." in free.text
    cut = free.text.index(".")
    stopped = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0,
                                                    stop=["."]))[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "."
    assert stopped.text == free.text[:cut]
    third = free.token_ids[2]
    by_id = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0,
                                                  stop_token_ids=[third]))[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == third
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(third) + 1]
    assert llm.engine.kv.pool.num_used_blocks == 0


def test_metrics_are_recorded_per_request(llm):
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=5, temperature=0))[0]
    m = out.metrics
    assert m.queue_time_s is not None and m.queue_time_s >= 0
    assert m.ttft_s >= m.queue_time_s and m.tpot_s > 0 and m.e2e_s >= m.ttft_s
    assert len(m.token_times) == 5


def test_rejected_and_invalid_requests(llm):
    too_long = llm.generate([[5] * 5000], SamplingParams(max_tokens=4))[0]
    assert too_long.finish_reason == "rejected" and "max_model_len" in too_long.error
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    ok = llm.generate(["Hi"], SamplingParams(max_tokens=2))[0]
    assert ok.finish_reason == "length"
