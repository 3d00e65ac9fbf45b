"""kv_manager: block pool and block tables, by example and by property (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvflow.kv_manager import BlockPool, KVCacheManager, KVCacheSpec, NoFreeBlocksError


def test_null_block_is_reserved_and_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4
    assert BlockPool.NULL_BLOCK not in pool.allocate(4)
    with pytest.raises(NoFreeBlocksError, match="asked for 1 blocks, 0 free"):
        pool.allocate(1)
    with pytest.raises(ValueError, match="null block"):
        pool.free([0])


def test_double_free_is_refused():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([b])
    pool.check_integrity()


def test_slots_follow_the_block_table():
    kv = KVCacheManager(10, 4)
    assert kv.allocate_slots("a", 6)
    table = kv.get_block_table("a")
    assert len(table) == 2
    assert kv.slot("a", 0) == table[0] * 4
    assert kv.slot("a", 5) == table[1] * 4 + 1
    assert kv.allocate_slots("a", 8) and len(kv.get_block_table("a")) == 2  # fits, no new block
    assert kv.allocate_slots("a", 9) and len(kv.get_block_table("a")) == 3


def test_allocation_is_all_or_nothing_and_honours_the_reserve():
    kv = KVCacheManager(5, 4)  # 4 usable blocks
    assert not kv.allocate_slots("a", 17)  # needs 5
    assert "a" not in kv.block_tables and kv.num_free_blocks == 4
    assert not kv.allocate_slots("a", 16, reserve=1)
    assert kv.allocate_slots("a", 12, reserve=1)
    assert kv.num_free_blocks == 1
    assert kv.free("a") == 3 and kv.num_free_blocks == 4
    kv.check_integrity()


def test_sizing_from_a_byte_budget():
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype_bytes=4)
    assert spec.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 4
    assert spec.num_blocks_for_bytes(10 * spec.bytes_per_block + 5) == 10
    with pytest.raises(ValueError, match="at least 2"):
        spec.num_blocks_for_bytes(spec.bytes_per_block)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        KVCacheSpec(1, 1, 1, 0, 2)


@given(st.integers(2, 64), st.lists(st.integers(0, 8), max_size=40))
def test_pool_allocate_free_round_trip(num_blocks, sizes):
    pool = BlockPool(num_blocks)
    held = []
    for n in sizes:
        if n <= pool.num_free_blocks:
            held.append(pool.allocate(n))
        else:
            with pytest.raises(NoFreeBlocksError):
                pool.allocate(n)
        pool.check_integrity()
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_usable_blocks
    for blocks in held:
        pool.free(blocks)
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_usable_blocks


class KVCacheMachine(RuleBasedStateMachine):
    """Random allocate / append / free sequences keep every invariant and lose no block."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(24, 4)
        self.lengths: dict[int, int] = {}
        self.next_id = 0

    @rule(n=st.integers(1, 40))
    def add_sequence(self, n):
        ok = self.kv.allocate_slots(self.next_id, n)
        assert ok == (self.kv.blocks_needed(n) <= 23 - self._used())
        if ok:
            self.lengths[self.next_id] = n
        self.next_id += 1

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), extra=st.integers(1, 9))
    def append_tokens(self, data, extra):
        rid = data.draw(st.sampled_from(sorted(self.lengths)))
        free_before = self.kv.num_free_blocks
        new = self.kv.num_new_blocks(rid, self.lengths[rid] + extra)
        ok = self.kv.allocate_slots(rid, self.lengths[rid] + extra)
        assert ok == (new <= free_before)
        if ok:
            self.lengths[rid] += extra
            assert self.kv.num_free_blocks == free_before - new

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def free_sequence(self, data):
        rid = data.draw(st.sampled_from(sorted(self.lengths)))
        assert self.kv.free(rid) == self.kv.blocks_needed(self.lengths.pop(rid))

    def _used(self) -> int:
        return sum(self.kv.blocks_needed(n) for n in self.lengths.values())

    @invariant()
    def integrity(self):
        self.kv.check_integrity()
        assert self.kv.pool.num_used_blocks == self._used()
        for rid, n in self.lengths.items():
            table = self.kv.get_block_table(rid)
            assert len(table) == self.kv.blocks_needed(n)
            assert 0 not in table

    def teardown(self):
        for rid in list(self.lengths):
            self.kv.free(rid)
        self.kv.check_integrity()
        assert self.kv.num_free_blocks == 23


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


# --- prefix cache ---------------------------------------------------------------------------
def test_eviction_is_lru_among_unreferenced_blocks_and_never_touches_referenced_ones():
    kv = KVCacheManager(7, 2, enable_caching=True)  # 6 usable blocks of 2 tokens
    seqs = {name: [base, base + 1, base + 2, base + 3] for name, base in
            (("a", 10), ("b", 20), ("c", 30))}
    for name, toks in seqs.items():  # 2 full blocks each, all cached
        assert kv.allocate_slots(name, 4)
        kv.cache_blocks(name, toks, 4)
    a_blocks, c_blocks = list(kv.block_tables["a"]), list(kv.block_tables["c"])
    kv.free("a")  # freed first: least recently used
    kv.free("b")
    assert kv.pool.num_cached_blocks == 6 and kv.num_free_blocks == 4
    # 'a' tail block first, then its head, then b's: a new 3-block sequence evicts a's 2 + 1 of b.
    assert kv.pool.free_queue()[:2] == [a_blocks[1], a_blocks[0]]
    assert kv.allocate_slots("d", 6)
    assert kv.pool.num_evictions == 3
    assert kv.get_computed_blocks("a2", seqs["a"] + [0])[1] == 0  # a's content is gone
    assert kv.get_computed_blocks("b2", seqs["b"] + [0])[1] == 2  # b's head survived
    # c is referenced: never evicted, even when the pool runs dry.
    assert not kv.allocate_slots("e", 4)
    assert kv.block_tables["c"] == c_blocks
    assert kv.get_computed_blocks("c2", seqs["c"] + [0])[1] == 4
    kv.check_integrity()


def test_cache_hits_share_blocks_and_revive_free_ones():
    kv = KVCacheManager(10, 4, enable_caching=True)
    toks = list(range(100, 112))
    kv.allocate_slots("a", 12)
    kv.cache_blocks("a", toks, 12)
    kv.free("a")
    hits, n = kv.get_computed_blocks("b", toks + [7])
    assert n == 12 and len(hits) == 3
    free_before = kv.num_free_blocks
    assert kv.allocate_slots("b", 13, computed_blocks=hits)
    assert kv.num_free_blocks == free_before - 3 - 1  # 3 revived + 1 new
    hits_c, _ = kv.get_computed_blocks("c", toks + [8])
    assert kv.allocate_slots("c", 13, computed_blocks=hits_c)
    assert [kv.pool.ref_counts[b] for b in hits] == [2, 2, 2]
    kv.check_integrity()
    kv.free("b")
    kv.free("c")
    kv.check_integrity()
    assert kv.num_free_blocks == kv.pool.num_usable_blocks


def test_salt_changes_every_block_hash():
    kv = KVCacheManager(10, 4, enable_caching=True)
    toks = list(range(8))
    assert kv.block_hashes("x", toks, b"s1") != kv.block_hashes("y", toks, b"s2")
    assert kv.block_hashes("z", toks, b"s1") == kv.block_hashes("x", toks, b"s1")


def test_swap_out_and_in_round_trip():
    kv = KVCacheManager(6, 4, num_host_blocks=4)
    kv.allocate_slots("a", 10)
    device = list(kv.block_tables["a"])
    assert kv.can_swap_out("a", 9)
    out_pairs = kv.swap_out("a", 9)
    assert [d for d, _ in out_pairs] == device and kv.is_swapped("a")
    assert kv.num_free_blocks == 5 and kv.host_pool.num_free_blocks == 1
    kv.check_integrity()
    in_pairs = kv.swap_in("a", 12)
    assert [h for h, _ in in_pairs] == [h for _, h in out_pairs]
    assert len(kv.block_tables["a"]) == 3 and not kv.is_swapped("a")
    assert kv.host_pool.num_free_blocks == 4
    kv.check_integrity()
    kv.free("a")
    kv.check_integrity()


class CachingKVMachine(RuleBasedStateMachine):
    """Random requests over a small vocabulary (so prefixes repeat), with caching on."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(16, 2, enable_caching=True)
        self.live: dict[int, list[int]] = {}
        self.next_id = 0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def admit(self, tokens):
        rid = self.next_id
        self.next_id += 1
        hits, n = self.kv.get_computed_blocks(rid, tokens)
        assert n <= len(tokens) - 1 and n == len(hits) * 2
        if self.kv.allocate_slots(rid, len(tokens), computed_blocks=hits):
            self.kv.cache_blocks(rid, tokens, len(tokens))
            self.live[rid] = tokens
        else:
            self.kv.free(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        del self.live[rid]
        self.kv.free(rid)

    @invariant()
    def integrity(self):
        self.kv.check_integrity()

    def teardown(self):
        for rid in list(self.live):
            self.kv.free(rid)
        self.kv.check_integrity()
        assert self.kv.num_free_blocks == 15


TestCachingKVMachine = CachingKVMachine.TestCase
TestCachingKVMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
