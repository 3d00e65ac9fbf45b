"""The KV tiers under a small pool, as a hypothesis state machine: requests sharing prefixes
come and go, blocks fall to the host and disk tiers and come back, and every block the pool
caches or a tier keeps holds its own content (none lost, none served for another hash).

The "KV" is real: a :class:`~kvflow.runtime.kv_cache.HostKVPool` whose blocks the test fills
with a value derived from each block's hash, as a model step would fill them from its tokens.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvflow.kv_manager import KVCacheManager
from kvflow.kv_manager.tier_disk import DiskBlockStore
from kvflow.kv_manager.tier_store import HostBlockStore
from kvflow.kv_manager.tiers import KVTiers
from kvflow.runtime.kv_cache import HostKVPool

BLOCK = 4
NUM_BLOCKS = 12  # 11 usable: a few requests evict each other's prefixes
PREFIXES = [list(range(10 * i + 3, 10 * i + 3 + 12)) for i in range(4)]  # 3 blocks each


def content(block_hash: bytes) -> float:
    """What a block holding ``block_hash``'s tokens contains (exact in fp32: < 2**24)."""
    return float(int.from_bytes(block_hash[:3], "little"))


class TiersMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.mem = HostKVPool(num_layers=1, num_blocks=NUM_BLOCKS, block_size=BLOCK,
                              num_kv_heads=1, head_dim=2)
        self.tiers = self.make_tiers([HostBlockStore(3 * self.mem.block_nbytes),
                                      DiskBlockStore(self.tmp.name, 1 << 20, b"ns")])
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_caching=True)
        self.kv.attach_tiers(self.tiers)
        self.live: list[int] = []
        self.next_id = 0
        self.restored = 0

    def make_tiers(self, stores):
        """The tiers under test: here every load and store on the caller's thread."""
        return KVTiers(stores, self.mem.read_blocks)

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), tail=st.lists(st.integers(3, 300),
                                                                   max_size=6),
          keep=st.booleans())
    def run_request(self, prefix, tail, keep):
        rid, self.next_id = self.next_id, self.next_id + 1
        tokens = PREFIXES[prefix] + tail
        self.kv.prefetch_prefix(rid, tokens)  # the engine's order: loads start, then restore
        self.restored += self.kv.restore_prefix(rid, tokens, b"", self.kv.num_free_blocks - 1)
        self.tiers.flush_restores(self.mem.write_blocks)
        hits, _ = self.kv.get_computed_blocks(rid, tokens)
        hashes = self.kv.block_hashes(rid, tokens)
        for b, h in zip(hits, hashes, strict=False):
            assert self.mem.k[0][b, 0, 0, 0] == content(h), "a hit served another block's KV"
        if not self.kv.allocate_slots(rid, len(tokens), computed_blocks=hits):
            self.kv.free(rid)
            return
        table = self.kv.get_block_table(rid)
        for i in range(len(hits), len(tokens) // BLOCK):  # the step computes the rest
            self.mem.k[0][table[i]] = content(hashes[i])
            self.mem.v[0][table[i]] = -content(hashes[i])
        self.kv.cache_blocks(rid, tokens, len(tokens))
        if keep:
            self.live.append(rid)
        else:
            self.kv.free(rid)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10))
    def finish(self, i):
        self.kv.free(self.live.pop(i % len(self.live)))

    @invariant()
    def every_block_holds_its_own_content(self):
        self.kv.check_integrity()
        assert not self.tiers.pending
        for h, b in self.kv.pool.cached.items():
            assert self.mem.k[0][b, 0, 0, 0] == content(h)
            assert self.mem.v[0][b, 0, 0, 0] == -content(h)
        # NOTE: no drain: a store holds only whole writes, and the writes in flight are
        # checked as they are.
        in_flight = [(h, payload) for h, (payload, _) in dict(self.tiers._writing).items()]
        for h, payload in in_flight + [(h, store.get(h)) for store in self.tiers.stores
                                       for h in store.hashes()]:
            if payload is None:  # moved down (or dropped) since hashes() listed it
                continue
            kv = np.frombuffer(payload, dtype=np.float32)
            half = kv.size // 2
            assert (kv[:half] == content(h)).all() and (kv[half:] == -content(h)).all()
        assert all(store.stats.corrupt == 0 for store in self.tiers.stores)

    def teardown(self):
        if hasattr(self, "tiers"):
            self.tiers.close()
            self.mem.close()
            self.tmp.cleanup()


TiersMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30,
                                          deadline=None)
test_tiers_state_machine = TiersMachine.TestCase


def test_a_prefix_evicted_from_the_pool_comes_back_from_the_tiers():
    m = TiersMachine()
    m.setup()
    for p in range(len(PREFIXES)):  # 4 prompts of 3 full blocks each: the pool evicts
        m.run_request(p, [], keep=False)
    assert m.kv.pool.num_evictions > 0
    m.run_request(0, [1], keep=False)
    assert m.restored > 0
    m.every_block_holds_its_own_content()
    m.teardown()


def test_a_runner_that_cannot_copy_blocks_out_is_refused_at_start():
    from kvflow.orchestrator.engine import LLMEngine
    from kvflow.orchestrator.options import EngineOptions
    from kvflow.sim.cost_model import FixedCostModel
    from kvflow.sim.runner import SimClock, SimRunner, sim_engine_config

    runner = SimRunner(sim_engine_config(BLOCK, 128, 32, 8), 40, FixedCostModel(1.0),
                       SimClock())
    with pytest.raises(ValueError, match="kv_offload_bytes / kv_disk_dir: the sim"):
        LLMEngine(runner, None, EngineOptions(kv_offload_bytes=1 << 20), clock=runner.clock)
    # Without tiers the same runner serves as before.
    LLMEngine(runner, None, EngineOptions(), clock=runner.clock).close()
