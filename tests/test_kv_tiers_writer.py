"""The KV tiers' writer thread: evicted blocks are stored off the engine thread, stay visible
(found, restored, never stored twice) until their write is done, and hold at most
``max_writing_bytes`` in flight; ``persist`` and ``close`` finish the writes first, and
``close`` leaves no thread.

The writer is real; a test holds it back by giving it a task that waits on an event first (its
one thread then takes the evictions only after that), never by replacing a method.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import settings

from kvflow.kv_manager import KVCacheManager
from kvflow.kv_manager.tier_disk import DiskBlockStore
from kvflow.kv_manager.tier_store import HostBlockStore
from kvflow.kv_manager.tiers import KVTiers
from kvflow.runtime.kv_cache import HostKVPool
from tests.test_kv_tiers_state import BLOCK, TiersMachine, content

NUM_BLOCKS = 7  # 6 usable: a 6-block request evicts every cached block of the one before


class WriterTiersMachine(TiersMachine):
    """The tiers state machine with a loader and a writer thread, and room for two blocks in
    flight: evictions wait for the writer, loads overlap writes."""

    def make_tiers(self, stores):
        return KVTiers(stores, self.mem.read_blocks, max_writing_bytes=2 * self.mem.block_nbytes,
                       loader=ThreadPoolExecutor(1), writer=ThreadPoolExecutor(1))


WriterTiersMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=30,
                                                deadline=None)
test_tiers_state_machine_with_a_writer = WriterTiersMachine.TestCase


@pytest.fixture
def mem():
    pool = HostKVPool(num_layers=1, num_blocks=NUM_BLOCKS, block_size=BLOCK, num_kv_heads=1,
                      head_dim=2)
    yield pool
    pool.close()


def hold_writer(tiers: KVTiers) -> threading.Event:
    """Keep the writer busy until the returned event is set."""
    gate = threading.Event()
    assert tiers.writer is not None
    tiers.writer.submit(gate.wait)
    return gate


def compute(kv: KVCacheManager, mem: HostKVPool, rid: str, tokens: list[int]) -> list[bytes]:
    """Admit ``tokens`` as request ``rid`` (its pool hits shared), "compute" the rest: each
    block's KV is derived from its hash, then index its full blocks. Returns its hashes."""
    hits, _ = kv.get_computed_blocks(rid, tokens)
    assert kv.allocate_slots(rid, len(tokens), computed_blocks=hits)
    hashes = kv.block_hashes(rid, tokens)
    table = kv.get_block_table(rid)
    for i in range(len(hits), len(tokens) // BLOCK):
        mem.k[0][table[i]], mem.v[0][table[i]] = content(hashes[i]), -content(hashes[i])
    kv.cache_blocks(rid, tokens, len(tokens))
    return hashes


def tier_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvflow-test-tier")]


def make_tiers(mem, stores, **kw) -> KVTiers:
    return KVTiers(stores, mem.read_blocks,
                   loader=ThreadPoolExecutor(1, thread_name_prefix="kvflow-test-tier-load"),
                   writer=ThreadPoolExecutor(1, thread_name_prefix="kvflow-test-tier-write"),
                   **kw)


def test_a_block_being_written_is_found_restored_and_stored_once(mem, tmp_path):
    tiers = make_tiers(mem, [DiskBlockStore(str(tmp_path), 1 << 20, b"ns")])
    kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_caching=True)
    kv.attach_tiers(tiers)
    disk = tiers.stores[0]
    gate = hold_writer(tiers)
    prefix = list(range(3, 15))  # 3 full blocks
    hashes = compute(kv, mem, "a", prefix + [1])[:3]
    kv.free("a")
    compute(kv, mem, "b", list(range(100, 124)))  # 6 blocks: a's 3 cached ones are evicted
    kv.free("b")
    assert kv.pool.num_evictions == 3 and disk.stats.blocks == 0  # all 3 still in flight
    assert tiers.num_hits(hashes) == 3
    kv.prefetch_prefix("a2", prefix + [2])  # loads from the writes in flight
    assert kv.restore_prefix("a2", prefix + [2], b"", kv.num_free_blocks - 1) == 3
    assert tiers.flush_restores(mem.write_blocks) == 3
    hits, _ = kv.get_computed_blocks("a2", prefix + [2])
    assert [mem.k[0][b, 0, 0, 0] for b in hits] == [content(h) for h in hashes]
    compute(kv, mem, "a2", prefix + [2])
    kv.free("a2")
    compute(kv, mem, "c", list(range(200, 224)))  # evicts a's blocks again while in flight
    kv.free("c")
    gate.set()
    tiers.drain()
    assert all(disk.contains(h) for h in hashes)
    # a's 3 blocks were evicted twice, the second time while in flight: stored once.
    assert tiers.counters["disk"].stored_blocks == disk.stats.blocks == 9
    assert kv.pool.num_evictions == 9 + 3
    assert tiers.counters["disk"].hits == 3
    kv.check_integrity()
    tiers.close()
    assert tier_threads() == []


def test_evictions_wait_for_the_writer_past_the_bytes_in_flight(mem):
    block_bytes = mem.block_nbytes
    tiers = make_tiers(mem, [HostBlockStore(1 << 20)], max_writing_bytes=2 * block_bytes)
    gate = hold_writer(tiers)
    tiers.evicted(1, b"one")
    tiers.evicted(2, b"two")
    third = threading.Thread(target=tiers.evicted, args=(3, b"three"))
    third.start()
    third.join(0.3)
    # NOTE: it cannot finish while the writer is held; a slow machine only makes this surer.
    assert third.is_alive()
    assert tiers.num_hits([b"one", b"two"]) == 2 and tiers.num_hits([b"three"]) == 0
    gate.set()
    third.join()
    tiers.drain()
    host = tiers.stores[0]
    assert sorted(host.hashes()) == sorted([b"one", b"two", b"three"])
    assert host.get(b"three") == mem.read_blocks([3])[0]
    tiers.close()
    assert tier_threads() == []


def test_persist_and_close_finish_the_writes_first(mem, tmp_path):
    # A host tier of one block above the disk: the second eviction moves the first down.
    tiers = make_tiers(mem, [HostBlockStore(mem.block_nbytes),
                             DiskBlockStore(str(tmp_path), 1 << 20, b"ns")])
    kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_caching=True)
    gate = hold_writer(tiers)
    for block, h in ((1, b"one"), (2, b"two"), (3, b"three")):
        tiers.evicted(block, h)
    persist = threading.Thread(target=tiers.persist, args=(kv.pool,))
    persist.start()
    persist.join(0.3)
    assert persist.is_alive()  # draining: the writes are held back
    gate.set()
    persist.join()
    disk = tiers.stores[1]
    assert sorted(disk.hashes()) == sorted([b"one", b"two", b"three"])
    assert disk.get(b"one") == mem.read_blocks([1])[0]
    tiers.evicted(4, b"four")
    tiers.close()  # the write of "four" is done before the stores close
    assert tiers.counters["cpu"].stored_blocks == 4
    assert tier_threads() == []
    reopened = DiskBlockStore(str(tmp_path), 1 << 20, b"ns")
    assert reopened.contains(b"three")
    reopened.close()
