"""Sliding-window block release in the KV manager: by example, and by a stateful property test
that tracks what every slot holds (kv_manager/window.py, kv_cache_manager.py, swap.py)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvflow.kv_manager import KVCacheManager
from kvflow.kv_manager.window import max_blocks_held, windowed_hit


def test_blocks_wholly_before_the_window_are_released_when_the_next_step_is_allocated():
    kv = KVCacheManager(16, 4, sliding_window=6)
    assert kv.allocate_slots("a", 20, num_computed_tokens=0)  # a prompt of 20: nothing dead
    table = list(kv.block_tables["a"])
    assert len(table) == 5 and 0 not in table
    free = kv.num_free_blocks
    # The query at 20 sees 15..20: blocks 0-2 (positions 0..11) are dead; block 3 (12..15)
    # still holds position 15. One new block for position 20.
    assert kv.allocate_slots("a", 21, num_computed_tokens=20)
    assert kv.block_tables["a"][:4] == [0, 0, 0, table[3]]
    assert kv.num_free_blocks == free + 3 - 1
    assert kv.release_outside_window("a", 20) == 0  # already released: idempotent
    kv.check_integrity()
    assert kv.free("a") == 3  # the null entries are no blocks it holds
    kv.check_integrity()
    assert kv.num_free_blocks == 15


def test_without_a_window_nothing_is_released():
    kv = KVCacheManager(16, 4)
    assert kv.allocate_slots("a", 20)
    assert kv.allocate_slots("a", 40, num_computed_tokens=39)
    assert kv.release_outside_window("a", 39) == 0 and 0 not in kv.block_tables["a"]
    kv.check_integrity()


def test_a_released_cached_block_stays_findable_as_an_evictable_cached_block():
    kv = KVCacheManager(16, 4, enable_caching=True, sliding_window=4)
    tokens = list(range(100, 117))
    assert kv.allocate_slots("a", 16, num_computed_tokens=0)
    kv.cache_blocks("a", tokens, 16)
    head = kv.block_tables["a"][0]
    assert kv.allocate_slots("a", 17, num_computed_tokens=16)  # sees 13..16: blocks 0-2 dead
    assert kv.block_tables["a"][:3] == [0, 0, 0]
    assert kv.pool.ref_counts[head] == 0 and kv.pool.lookup(kv.block_hashes("a", tokens)[0]) == head
    assert head in kv.pool.free_queue()
    # A new request with the same prompt: the hit need only hold the block its window reaches.
    hits, n = kv.get_computed_blocks("b", tokens)
    assert n == 16 and hits[:3] == [0, 0, 0] and hits[3] == kv.block_tables["a"][3]
    assert kv.allocate_slots("b", 17, computed_blocks=hits)
    assert kv.block_tables["b"][:3] == [0, 0, 0] and kv.pool.ref_counts[hits[3]] == 2
    kv.check_integrity()


def test_a_windowed_hit_survives_the_eviction_of_the_prefix_head():
    kv = KVCacheManager(9, 2, enable_caching=True, sliding_window=3)  # 8 usable blocks of 2
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert kv.allocate_slots("a", 8)
    kv.cache_blocks("a", tokens, 8)
    last = kv.block_tables["a"][3]
    assert kv.allocate_slots("a", 9, num_computed_tokens=8)  # sees 6..8: blocks 0-2 released
    kv.free("a")
    assert kv.allocate_slots("y", 12)  # 6 blocks: the 3 empty ones, then a's released 3
    assert kv.pool.num_evictions == 3
    # The full-attention rule would find nothing (block 0 is gone); the run of one block
    # (W - 1 = 2 tokens) ending at block 3 is a hit of all 8 tokens.
    hits, n = kv.get_computed_blocks("b", tokens)
    assert (hits, n) == ([0, 0, 0, last], 8)
    assert kv.allocate_slots("b", 9, computed_blocks=hits)
    kv.check_integrity()


def test_windowed_hit_prefers_the_longest_run_and_falls_back_to_the_leading_blocks():
    cached = {b"h1": 11, b"h2": 12, b"h4": 14}
    hashes = [b"h0", b"h1", b"h2", b"h3", b"h4", b"h5"]
    # window 5, block 2: a hit must end with ceil(4 / 2) = 2 cached blocks: 1-2 is the run.
    assert windowed_hit(cached.get, hashes, 6, 5, 2) == [0, 11, 12]
    assert windowed_hit(cached.get, hashes, 2, 5, 2) == []  # block 0 missing, no run of 2
    assert windowed_hit({**cached, b"h0": 10}.get, hashes, 2, 5, 2) == [10, 11]
    assert windowed_hit({b"h0": 10}.get, hashes, 6, 5, 2) == [10]  # a leading block is a hit


def test_a_cut_hit_keeps_the_blocks_its_window_reaches_or_is_no_hit():
    kv = KVCacheManager(16, 2, sliding_window=3)
    assert kv.trim_hit([0, 0, 7, 8], 4) == [0, 0, 7, 8]
    assert kv.trim_hit([0, 0, 7, 8], 3) == [0, 0, 7]  # position 6 sees 4..6: block 2
    assert kv.trim_hit([0, 0, 7, 8], 2) == []
    assert KVCacheManager(16, 2).trim_hit([5, 6, 7], 2) == [5, 6]


def test_fork_shares_the_null_entries_and_refuses_a_child_that_would_see_them():
    kv = KVCacheManager(16, 2, sliding_window=3)
    assert kv.allocate_slots("p", 10, num_computed_tokens=0)
    assert kv.allocate_slots("p", 11, num_computed_tokens=10)  # sees 8..10: blocks 0-3 dead
    kv.fork("p", "c", 10)
    assert kv.block_tables["c"] == kv.block_tables["p"][:5]
    kv.check_integrity()
    with pytest.raises(AssertionError, match="still sees"):
        kv.fork("p", "d", 6)
    assert kv.free("c") == 1 and kv.free("p") == 2
    kv.check_integrity()


def test_a_windowed_sequence_swaps_only_its_live_blocks():
    kv = KVCacheManager(16, 2, num_host_blocks=4, sliding_window=3)
    assert kv.allocate_slots("a", 10, num_computed_tokens=0)
    table = list(kv.block_tables["a"])
    # At 10 computed tokens the next query sees 8..10: only block 4 moves, 0-3 are released.
    assert kv.can_swap_out("a", 10)
    out = kv.swap_out("a", 10)
    assert [d for d, _ in out] == [table[4]] and kv.host_tables["a"][:4] == [0, 0, 0, 0]
    kv.check_integrity()
    back = kv.swap_in("a", 11)
    assert back is not None and len(back) == 1
    assert kv.block_tables["a"][:4] == [0, 0, 0, 0] and len(kv.block_tables["a"]) == 6
    kv.check_integrity()


def test_a_bad_window_is_refused_by_name():
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window must be None or a positive"):
            KVCacheManager(8, 4, sliding_window=bad)  # type: ignore[arg-type]


def test_the_resident_capacity_of_a_windowed_sequence_is_unbounded_when_its_window_fits():
    kv = KVCacheManager(9, 4, sliding_window=8)  # 8 usable blocks
    assert kv.max_sequence_tokens(16) > 10**9  # ceil((7 + 16) / 4) + 1 = 7 blocks fit
    assert kv.max_sequence_tokens(32) == 32  # 11 blocks do not: the whole pool's tokens
    assert KVCacheManager(9, 4).max_sequence_tokens(16) == 32
    assert kv.max_blocks_per_sequence(16) == max_blocks_held(8, 4, 16) == 7


# --- the stateful property test: a model of every slot's contents -----------------------------


def _key(tokens: list[int], p: int) -> tuple[int, ...]:
    """What slot ``p`` of a sequence holds: its KV depends on the whole prefix."""
    return tuple(tokens[:p + 1])


class Seq:
    """A sequence as the scheduler sees it: known tokens, computed tokens, the token span of
    its last allocation (the bound on what it holds) and the computed tokens its blocks were
    last released at (a fork's least token count)."""

    def __init__(self, tokens: list[int], computed: int = 0) -> None:
        self.tokens, self.computed = tokens, computed
        self.span = (computed, computed)
        self.released_at = computed


class WindowedKVMachine(RuleBasedStateMachine):
    """Random admit (prefix-cached) / step / fork / free / preempt / swap out and in, under a
    random window, block size and pool. Beside the manager, the machine keeps what every
    device and host slot holds, moved as the runner would move it (copies on write, swaps),
    and checks after each rule: integrity; each sequence holds at most the window's bound of
    blocks; and every position inside a sequence's window is in a real block holding that
    sequence's own prefix (a block released, evicted or reused too early shows there)."""

    def __init__(self) -> None:
        super().__init__()
        self.seqs: dict[int, Seq] = {}  # resident
        self.swapped: list[dict[int, Seq]] = []  # groups swapped out together
        self.dev: dict[int, tuple[int, ...]] = {}  # slot -> prefix
        self.host: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    @initialize(window=st.integers(1, 12), bs=st.sampled_from([1, 2, 4]),
                num_blocks=st.integers(6, 28), host=st.integers(0, 12))
    def setup(self, window, bs, num_blocks, host):
        self.w, self.bs = window, bs
        self.kv = KVCacheManager(num_blocks, bs, enable_caching=True, num_host_blocks=host,
                                 sliding_window=window)

    # --- the runner's side ---------------------------------------------------------------------
    def _move(self, src: dict, dst: dict, pairs: list[tuple[int, int]]) -> None:
        saved = {s: [src.get(s * self.bs + o) for o in range(self.bs)] for s, _ in pairs}
        for s, d in pairs:
            for o, v in enumerate(saved[s]):
                dst[d * self.bs + o] = v

    def _run(self, rid: int, n: int) -> None:
        """Compute ``n`` tokens of a resident sequence (its blocks allocated): check the window
        its first query reads, write the new slots, index the full blocks, sample a token."""
        seq, kv, bs = self.seqs[rid], self.kv, self.bs
        self._move(self.dev, self.dev, kv.take_copies())
        self._check_window(rid, kv.block_tables[rid], self.dev, seq)
        table = kv.block_tables[rid]
        for p in range(seq.computed, seq.computed + n):
            b = table[p // bs]
            assert b != 0, f"{rid}: writes position {p} into the null block"
            assert kv.pool.ref_counts[b] == 1 and kv.pool.block_hashes[b] is None, \
                f"{rid}: writes position {p} into a shared or cached block"
            self.dev[b * bs + p % bs] = _key(seq.tokens, p)
        seq.computed += n
        kv.cache_blocks(rid, seq.tokens, seq.computed)
        if seq.computed == len(seq.tokens):
            seq.tokens.append((seq.computed * 7 + rid) % 3)

    def _check_window(self, rid: int, table: list[int], slots: dict, seq: Seq) -> None:
        c, bs = seq.computed, self.bs
        for p in range(max(0, c - self.w + 1), c):
            b = table[p // bs]
            assert b != 0, f"{rid}: position {p} in the window of {c} is in the null block"
            assert slots.get(b * bs + p % bs) == _key(seq.tokens, p), \
                f"{rid}: position {p} in the window of {c} holds another prefix"

    # --- the scheduler's side --------------------------------------------------------------------
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=30), chunk=st.integers(1, 12))
    def admit(self, tokens, chunk):
        rid, kv = self.next_id, self.kv
        self.next_id += 1
        hits, cached = kv.get_computed_blocks(rid, tokens)
        n = min(chunk, len(tokens) - cached)
        if kv.allocate_slots(rid, cached + n, computed_blocks=hits):
            self.seqs[rid] = seq = Seq(tokens, cached)
            seq.span = (cached, cached + n)
            self._run(rid, n)
        else:
            kv.free(rid)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def step(self, data, chunk):
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[rid]
        n = min(chunk, len(seq.tokens) - seq.computed)
        ok = self.kv.allocate_slots(rid, seq.computed + n, num_computed_tokens=seq.computed)
        seq.released_at = seq.computed  # released even when the allocation fails
        if ok:
            seq.span = (seq.computed, seq.computed + n)
            self._run(rid, n)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        # As the scheduler forks a group's member: at a token count the parent reached in
        # its last step (its prompt's end), never before the tokens its last release assumed.
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        parent = self.seqs[rid]
        low = max(parent.released_at, 1)
        at = data.draw(st.integers(low, parent.computed)) if parent.computed >= low else 0
        if at == 0:
            return
        child = self.next_id
        self.next_id += 1
        self.kv.fork(rid, child, at)
        self.seqs[child] = seq = Seq(parent.tokens[:at] + [(at + child) % 3], at)
        seq.span, seq.released_at = parent.span, parent.released_at

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), forget=st.booleans())
    def free(self, data, forget):
        """Finish, or preempt by recompute (``forget=False``, then re-admitted at once)."""
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs.pop(rid)
        self.kv.free(rid, forget=forget)
        if not forget:
            self.admit_again(rid, seq.tokens)

    def admit_again(self, rid: int, tokens: list[int]) -> None:
        hits, cached = self.kv.get_computed_blocks(rid, tokens)
        if self.kv.allocate_slots(rid, cached + 1, computed_blocks=hits):
            self.seqs[rid] = seq = Seq(tokens, cached)
            seq.span = (cached, cached + 1)
            self._run(rid, 1)
        else:
            self.kv.free(rid)

    @precondition(lambda self: self.seqs and self.kv.host_pool is not None)
    @rule(data=st.data())
    def swap_out(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.seqs)), min_size=1, max_size=3,
                                 unique=True))
        items = [(r, self.seqs[r].computed) for r in ids]
        if not self.kv.can_swap_out_many(items):
            return
        self._move(self.dev, self.host, self.kv.take_copies())
        self._move(self.dev, self.host, self.kv.swap_out_many(items))
        self.swapped.append({r: self.seqs.pop(r) for r in ids})
        for seq in self.swapped[-1].values():
            seq.released_at = seq.computed  # what is dead at its computed tokens stays behind

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), extra=st.integers(0, 4))
    def swap_in(self, data, extra):
        group = self.swapped[data.draw(st.integers(0, len(self.swapped) - 1))]
        first, *rest = group
        room = min(extra, len(group[first].tokens) - group[first].computed)
        items = [(first, group[first].computed + room), *((r, group[r].computed) for r in rest)]
        pairs = self.kv.swap_in_many(items)
        if pairs is None:
            return
        self._move(self.host, self.dev, pairs)
        self.swapped.remove(group)
        self.seqs.update(group)
        for r, seq in group.items():
            seq.span = (seq.computed, seq.computed + (room if r == first else 0))

    # --- the checks ------------------------------------------------------------------------------
    @invariant()
    def windows_hold_their_own_prefix(self):
        if not hasattr(self, "kv"):
            return
        kv = self.kv
        kv.check_integrity()
        for rid, seq in self.seqs.items():
            table = kv.block_tables[rid]
            assert len(table) >= kv.blocks_needed(seq.computed)
            self._check_window(rid, table, self.dev, seq)
            start, end = seq.span
            held = sum(1 for b in table if b != 0)
            assert held <= max_blocks_held(self.w, self.bs, end - start), (rid, table, seq.span)
        for group in self.swapped:
            for rid, seq in group.items():
                self._check_window(rid, kv.host_tables[rid], self.host, seq)

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for rid in [*self.seqs, *(r for g in self.swapped for r in g)]:
            self.kv.free(rid)
        self.kv.check_integrity()
        assert self.kv.pool.num_used_blocks == 0
        assert self.kv.host_pool is None or self.kv.host_pool.num_used_blocks == 0


TestWindowedKVMachine = WindowedKVMachine.TestCase
TestWindowedKVMachine.settings = settings(max_examples=150, stateful_step_count=40,
                                          deadline=None)
