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
