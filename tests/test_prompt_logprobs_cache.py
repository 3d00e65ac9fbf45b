"""The prompt-logprob entries kept beside the prefix cache: keyed by block hash, k and the next
prompt token; bounded, least recently used out first; gone with their block's eviction."""

from __future__ import annotations

import pytest

from kvflow.kv_manager import KVCacheManager
from kvflow.kv_manager.prompt_logprobs_cache import PromptLogprobsCache

BS = 4


def entries_for(prompt: list[int], k: int = 1) -> list[dict[int, float] | None]:
    """Made-up entries, one per position (the first None), k + 1 items each."""
    return [None] + [{t: -1.0, 1000 + p: -0.5} if k else {t: -1.0}
                     for p, t in enumerate(prompt[1:], start=1)]


def test_a_prompt_keeps_its_complete_blocks_and_gives_them_back():
    kv = KVCacheManager(16, BS, enable_caching=True)
    cache = kv.prompt_logprobs
    assert cache is not None
    prompt = list(range(50, 61))  # 11 tokens: blocks 0 and 1 full, each with a next token
    hashes = kv.block_hashes("a", prompt)
    entries = entries_for(prompt)
    cache.store(hashes, prompt, 1, entries[:6], range(0, 2))  # entries 1..5: block 0 only
    assert len(cache) == 1 and cache.num_usable(hashes, prompt, 1, 2) == 1
    cache.store(hashes, prompt, 1, entries, range(0, 3))  # block 2 has no full entry run
    assert len(cache) == 2 and cache.num_usable(hashes, prompt, 1, 2) == 2
    assert cache.entries_of(hashes, prompt, 1, 2) == entries[1:9]
    assert cache.num_usable(hashes, prompt, 5, 2) == 0  # another k
    other = prompt[:8] + [99, 98, 97]  # the same two blocks, another token after them
    assert cache.num_usable(kv.block_hashes("b", other), other, 1, 2) == 1
    cache.check_integrity()


def test_the_bound_evicts_the_least_recently_used():
    cache = PromptLogprobsCache(BS, max_items=3 * BS * 2)  # three blocks of k=1 entries
    prompt = list(range(100, 100 + 5 * BS + 1))
    kv = KVCacheManager(32, BS, enable_caching=True)
    hashes = kv.block_hashes("a", prompt)
    entries = entries_for(prompt)
    cache.store(hashes, prompt, 1, entries, range(0, 3))
    cache.get(hashes[0], 1, prompt[BS])  # block 0 used again: block 1 is now the oldest
    cache.store(hashes, prompt, 1, entries, range(3, 4))
    assert cache.num_items == 3 * BS * 2 and len(cache) == 3
    assert cache.get(hashes[1], 1, prompt[2 * BS]) is None
    assert cache.get(hashes[0], 1, prompt[BS]) is not None
    cache.put(hashes[4], 1, 0, [{i: 0.0 for i in range(100)}])  # larger than the bound
    assert cache.get(hashes[4], 1, 0) is None
    cache.check_integrity()


def test_entries_go_with_their_blocks_eviction():
    kv = KVCacheManager(4, BS, enable_caching=True)  # three usable blocks
    cache = kv.prompt_logprobs
    assert cache is not None
    prompt = list(range(10, 10 + 2 * BS + 1))
    assert kv.allocate_slots("a", len(prompt))
    kv.cache_blocks("a", prompt, len(prompt))
    hashes = kv.block_hashes("a", prompt)
    cache.store(hashes, prompt, 1, entries_for(prompt), range(0, 2))
    assert len(cache) == 2
    kv.free("a")  # the blocks stay cached, and their entries with them
    assert len(cache) == 2
    assert kv.allocate_slots("b", 3 * BS)  # takes the whole pool: every cached block evicted
    assert len(cache) == 0 and cache.num_items == 0
    kv.check_integrity()


def test_a_bad_bound_is_refused():
    with pytest.raises(ValueError, match="max_items must be >= 1"):
        PromptLogprobsCache(BS, max_items=0)


def test_no_prefix_cache_keeps_nothing():
    assert KVCacheManager(8, BS, enable_caching=False).prompt_logprobs is None
