"""Prefix caching and swap preemption through the real engine: outputs never change."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow import LLM, SamplingParams

pytestmark = pytest.mark.slow  # greedy runs of a tiny engine, seconds each

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_dir(tiny_engines):
    return tiny_engines["llama-gqa4", "torch"]


def block_size_of(engine_dir) -> int:
    from kvflow.build.engine_config import EngineConfig

    return EngineConfig.load(engine_dir).limits.block_size


def expected_cached_tokens(prompt: list[int], cached: list[list[int]], block_size: int) -> int:
    """Tokens of ``prompt`` the prefix cache serves, given the prompts computed before it:
    the full blocks of its longest shared prefix, short of its last token (which is always
    computed, for its logits)."""
    def shared(other: list[int]) -> int:
        n = 0
        while n < min(len(prompt), len(other)) and prompt[n] == other[n]:
            n += 1
        return n

    usable = min(max((shared(c) for c in cached), default=0), len(prompt) - 1)
    return usable // block_size * block_size


def shared_prefix_prompts() -> tuple[list[int], list[list[int]]]:
    rng = np.random.default_rng(7)
    base = rng.integers(3, 300, size=30).tolist()
    others = [
        base[:16] + [5, 6, 7],           # block-aligned shared prefix
        base[:18] + [8, 9],              # not aligned: 4 full blocks shared, 2 tokens not
        list(base),                      # the whole prompt is cached
        base + [11, 12, 13, 14, 15],     # cached prompt, extended
        rng.integers(3, 300, size=9).tolist(),  # nothing shared
    ]
    return base, others


def run(engine_dir, caching: bool):
    base, others = shared_prefix_prompts()
    with LLM(engine_dir, enable_prefix_caching=caching) as llm:
        first = llm.generate([base], GREEDY)
        rest = llm.generate(others, GREEDY)
        hits = llm.engine.counters.prefix_cache_hits
    return first + rest, hits


def test_greedy_outputs_identical_with_and_without_prefix_caching(engine_dir):
    on, hits = run(engine_dir, caching=True)
    off, no_hits = run(engine_dir, caching=False)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    # The first call computes ``base``; the second call's prompts find its blocks.
    base, others = shared_prefix_prompts()
    bs = block_size_of(engine_dir)
    expected = [0] + [expected_cached_tokens(p, [base], bs) for p in others]
    assert all(e > 0 for e in expected[1:5]) and expected[5] == 0  # what the prompts aim at
    assert [o.cached_tokens for o in on] == expected
    assert all(o.cached_tokens == 0 for o in off)
    assert hits == sum(expected) and no_hits == 0


def test_cache_salt_isolates_tenants(engine_dir):
    base, _ = shared_prefix_prompts()
    with LLM(engine_dir) as llm:
        llm.generate([base], GREEDY, cache_salts=["tenant-a"])
        b, a = llm.generate([base + [1], base + [1]], GREEDY,
                            cache_salts=["tenant-b", "tenant-a"])
    assert b.cached_tokens == 0
    assert a.cached_tokens == expected_cached_tokens(base + [1], [base], block_size_of(engine_dir))
    assert a.cached_tokens > 0
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_forced_swap_and_forced_recompute_give_the_same_tokens(engine_dir, mode):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 300, size=10).tolist() for _ in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(engine_dir) as llm:
        reference = [o.token_ids for o in llm.generate(prompts, params)]
    # 11 usable blocks of 4 tokens for six 22-token sequences: constant preemption.
    with LLM(engine_dir, num_kv_blocks=12, preemption_mode=mode, kv_watermark=0.0,
             enable_prefix_caching=False, swap_space_bytes=1 << 20) as llm:
        outs = llm.generate(prompts, params)
        assert llm.engine.counters.preemptions > 0
        assert (llm.engine.scheduler.preemptor.num_swapped_out > 0) == (mode == "swap")
        llm.engine.kv.check_integrity()
        assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_usable_blocks
    assert [o.token_ids for o in outs] == reference
