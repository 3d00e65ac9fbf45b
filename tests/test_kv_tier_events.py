"""KV events with a medium: a block evicted from the pool is announced in the host tier, demoted
to the disk tier, dropped by an LRU or as corrupt, restored into the pool; a restarted disk tier
announces what it holds; and the Dynamo wire format keeps the media apart.

The "KV" is real: a :class:`~kvflow.runtime.kv_cache.HostKVPool` (the runner's block copies),
under a :class:`~kvflow.kv_manager.KVCacheManager` and real host and disk stores.
"""

from __future__ import annotations

import struct
import threading
from pathlib import Path

import pytest

from kvflow.dynamo.events import ZmqEventPublisher, block_id, encode_events
from kvflow.kv_manager import KVCacheManager
from kvflow.kv_manager.block_pool import BlockRemoved, BlockStored, KVEvent
from kvflow.kv_manager.tier_disk import (
    HEADER,
    DiskBlockStore,
    decode_meta,
    encode_meta,
    meta_size,
)
from kvflow.kv_manager.tier_store import HostBlockStore
from kvflow.kv_manager.tiers import KVTiers
from kvflow.runtime.kv_cache import HostKVPool
from tests.helpers import received_events

BLOCK = 2
NS = b"test-namespace"
PROMPTS = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [9, 10, 11, 12]}  # two blocks each


class Setup:
    """A pool of two usable blocks over a host tier of one block and a disk tier of three,
    every event (the pool's and the tiers') in one list, in the order they happened."""

    def __init__(self, tmp_path: Path, record: bool = True) -> None:
        self.mem = HostKVPool(num_layers=1, num_blocks=3, block_size=BLOCK, num_kv_heads=1,
                              head_dim=2)
        self.dir = tmp_path / "kv"
        per_block = self.mem.block_nbytes
        file_bytes = (HEADER.size + len(NS) + 32 + per_block
                      + meta_size(BlockStored(bytes(32), bytes(32), (0,) * BLOCK)))
        self.disk = DiskBlockStore(self.dir, 3 * file_bytes, NS)
        self.tiers = KVTiers([HostBlockStore(per_block), self.disk], self.mem.read_blocks)
        self.kv = KVCacheManager(3, BLOCK, enable_caching=True)
        self.kv.attach_tiers(self.tiers)
        if record:
            self.kv.pool.record_events()
            for store in self.tiers.stores:
                store.record_events(self.sink)
        self.names: dict[bytes, str] = {}

    def sink(self, events: list[KVEvent]) -> None:
        assert self.kv.pool.events is not None
        self.kv.pool.events.extend(events)

    def run(self, rid: str) -> None:
        """Prefill ``rid``'s prompt (its blocks filled as a step would), cache it, free it."""
        tokens = PROMPTS[rid]
        assert self.kv.allocate_slots(rid, len(tokens))
        for i, (b, h) in enumerate(zip(self.kv.get_block_table(rid),
                                       self.kv.block_hashes(rid, tokens), strict=True)):
            self.names[h] = f"{rid}{i}"
            self.mem.k[0][b] = self.mem.v[0][b] = h[0]
        self.kv.cache_blocks(rid, tokens, len(tokens))
        self.kv.free(rid)

    def events(self) -> list[tuple]:
        """The events since the last call, hashes by name: (kind, block, medium[, parent,
        tokens])."""
        out: list[tuple] = []
        for e in self.kv.pool.take_events():
            if isinstance(e, BlockStored):
                parent = None if e.parent_hash is None else self.names[e.parent_hash]
                out.append(("stored", self.names[e.block_hash], e.medium, parent, e.token_ids))
            else:
                out.append(("removed", self.names[e.block_hash], e.medium))
        return out

    def hash_of(self, name: str) -> bytes:
        return next(h for h, n in self.names.items() if n == name)

    def restarted(self) -> tuple[DiskBlockStore, list[KVEvent]]:
        """Close the tiers, open the disk tier's folder as the next process does, and take the
        events it announces."""
        self.tiers.close()
        disk = DiskBlockStore(self.dir, self.disk.capacity_bytes, NS)
        told: list[KVEvent] = []
        disk.record_events(told.extend)
        return disk, told


def test_a_block_is_announced_in_each_medium_it_moves_through(tmp_path):
    s = Setup(tmp_path)
    s.run("a")
    assert s.events() == [("stored", "a0", "gpu", None, (1, 2)),
                          ("stored", "a1", "gpu", "a0", (3, 4))]
    s.run("b")  # evicts a1 (freed first: the tail), then a0, which pushes a1 down to disk
    assert s.events() == [
        ("removed", "a1", "gpu"), ("stored", "a1", "cpu", "a0", (3, 4)),
        ("removed", "a0", "gpu"),
        ("removed", "a1", "cpu"), ("stored", "a1", "disk", "a0", (3, 4)),  # demoted
        ("stored", "a0", "cpu", None, (1, 2)),
        ("stored", "b0", "gpu", None, (5, 6)), ("stored", "b1", "gpu", "b0", (7, 8))]
    s.run("c")
    assert s.events() == [
        ("removed", "b1", "gpu"),
        ("removed", "a0", "cpu"), ("stored", "a0", "disk", None, (1, 2)),
        ("stored", "b1", "cpu", "b0", (7, 8)),
        ("removed", "b0", "gpu"),
        ("removed", "b1", "cpu"), ("stored", "b1", "disk", "b0", (7, 8)),
        ("stored", "b0", "cpu", None, (5, 6)),
        ("stored", "c0", "gpu", None, (9, 10)), ("stored", "c1", "gpu", "c0", (11, 12))]
    # The returning "b": b0 on the host tier, b1 on disk, whose file is now corrupt. Making
    # room for the restore pushes b0 and c1 down to a full disk tier (a1, a0 dropped, LRU);
    # b0 comes back into the pool, b1 fails its check and is dropped.
    path = s.disk.path(s.hash_of("b1"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert s.kv.restore_prefix("b", PROMPTS["b"] + [0], b"", max_blocks=2) == 1
    assert s.events() == [
        ("removed", "c1", "gpu"),
        ("removed", "b0", "cpu"), ("removed", "a1", "disk"),
        ("stored", "b0", "disk", None, (5, 6)),
        ("stored", "c1", "cpu", "c0", (11, 12)),
        ("removed", "c0", "gpu"),
        ("removed", "c1", "cpu"), ("removed", "a0", "disk"),
        ("stored", "c1", "disk", "c0", (11, 12)),
        ("stored", "c0", "cpu", None, (9, 10)),
        ("stored", "b0", "gpu", None, (5, 6)),  # restored
        ("removed", "b1", "disk")]  # corrupt: the restore stops there
    assert s.disk.stats.corrupt == 1
    s.kv.check_integrity()
    # The pool keeps a cached block's event (for the tier it may go to), and only those.
    assert set(s.kv.pool.stored) == set(s.kv.pool.cached) == {s.hash_of("b0")}

    # Restarted: the disk tier announces the blocks it holds, least recently used first (b0
    # was read last), with the parents and tokens they had in the pool.
    disk, told = s.restarted()
    c0, c1, b0 = (s.hash_of(n) for n in ("c0", "c1", "b0"))
    assert told == [BlockStored(c1, c0, (11, 12), medium="disk"),
                    BlockStored(b0, None, (5, 6), medium="disk")]
    assert encode_events(told, BLOCK) == [
        ["BlockStored", [block_id(c1)], block_id(c0), [11, 12], BLOCK, None, "CPU_TIER2"],
        ["BlockStored", [block_id(b0)], None, [5, 6], BLOCK, None, "CPU_TIER2"]]
    disk.close()


def test_blocks_persisted_at_shutdown_keep_their_metadata_for_the_next_process(tmp_path):
    s = Setup(tmp_path)
    s.run("a")
    s.run("b")  # the pool holds b0, b1; the host tier a0; the disk a1
    s.events()
    assert s.tiers.persist(s.kv.pool) == 3
    assert s.events() == [("stored", "b0", "disk", None, (5, 6)),
                          ("stored", "b1", "disk", "b0", (7, 8)),
                          ("removed", "a1", "disk"),  # the disk tier holds three blocks
                          ("stored", "a0", "disk", None, (1, 2))]
    disk, told = s.restarted()
    a0, b0, b1 = (s.hash_of(n) for n in ("a0", "b0", "b1"))
    assert told == [BlockStored(b0, None, (5, 6), medium="disk"),
                    BlockStored(b1, b0, (7, 8), medium="disk"),
                    BlockStored(a0, None, (1, 2), medium="disk")]
    disk.close()


def test_without_events_no_metadata_is_kept_and_the_tiers_say_nothing(tmp_path):
    s = Setup(tmp_path, record=False)
    for rid in ("a", "b", "c"):
        s.run(rid)
    assert s.kv.pool.events is None and s.kv.pool.stored == {}
    held = s.disk.hashes()
    assert held and all(s.disk.meta(h) is None for h in held)
    # Such files announce nothing after a restart, and are kept (they still serve hits).
    disk, told = s.restarted()
    assert told == [] and disk.hashes() == held and disk.stats.corrupt == 0
    disk.close()


def test_salted_and_lora_metadata_survive_the_disk_and_salted_blocks_stay_unpublished(tmp_path):
    disk = DiskBlockStore(tmp_path, 1 << 20, NS)
    h1, h2 = bytes([1]) * 32, bytes([2]) * 32
    salted = BlockStored(h1, None, (7, 8), salted=True, lora_id=3)
    plain = BlockStored(h2, h1, (9, 10), lora_id=3)
    assert decode_meta(encode_meta(plain), h2, "disk") == BlockStored(h2, h1, (9, 10),
                                                                        lora_id=3,
                                                                        medium="disk")
    told: list[KVEvent] = []
    disk.record_events(told.extend)
    assert disk.put(h1, b"x" * 64, salted) and disk.put(h2, b"y" * 64, plain)
    assert disk.meta(h1) == BlockStored(h1, None, (7, 8), True, 3, "disk")
    assert disk.get(h2) == b"y" * 64
    assert encode_events(told, BLOCK) == [
        ["BlockStored", [block_id(h2)], block_id(h1), [9, 10], BLOCK, 3, "CPU_TIER2"]]
    disk.close()


@pytest.mark.parametrize("damage", ["format_1", "torn_metadata", "bad_flags"])
def test_a_file_unreadable_at_announce_is_dropped_counted_and_not_announced(tmp_path, damage):
    disk = DiskBlockStore(tmp_path, 1 << 20, NS)
    h1, h2 = bytes([1]) * 32, bytes([2]) * 32
    disk.put(h1, b"x" * 64, BlockStored(h1, None, (1, 2)))
    disk.put(h2, b"y" * 64, BlockStored(h2, h1, (3, 4)))
    disk.close()
    path = disk.path(h1)
    data = path.read_bytes()
    if damage == "format_1":  # what kvflow wrote before the metadata: no metadata length
        head = struct.Struct("<8sHHHQ32s")
        payload = b"x" * 64
        data = (head.pack(b"KVFTIER\x00", 1, len(NS), 32, len(payload), bytes(32)) + NS + h1
                + payload)
    elif damage == "torn_metadata":
        data = data[:struct.calcsize("<8sHHHIQ32s") + len(NS) + 32 + 5]
    else:
        at = struct.calcsize("<8sHHHIQ32s") + len(NS) + 32
        data = data[:at] + b"\xf0" + data[at + 1:]
    path.write_bytes(data)
    disk = DiskBlockStore(tmp_path, 1 << 20, NS)
    told: list[KVEvent] = []
    dropped: list[bytes] = []
    disk.on_evict = dropped.append
    disk.record_events(told.extend)
    assert told == [BlockStored(h2, h1, (3, 4), medium="disk")]
    assert disk.stats.corrupt == 1 and dropped == [h1] and not path.exists()
    assert disk.hashes() == [h2] and disk.get(h2) == b"y" * 64
    disk.close()


def test_the_events_of_concurrent_puts_and_discards_replay_to_what_the_store_holds():
    """The sink is told under the store's lock: replaying its events, in order, gives exactly
    the blocks the store holds, whatever the threads did."""
    store = HostBlockStore(8 * 64)
    told: list[KVEvent] = []
    store.record_events(told.extend)
    hashes = [bytes([i]) * 32 for i in range(24)]

    def work(offset: int) -> None:
        for n in range(300):
            h = hashes[(offset + 7 * n) % len(hashes)]
            if n % 5 == 4:
                store.discard(h)
            else:
                store.put(h, b"p" * 64, BlockStored(h, None, (n, n)))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held: set[bytes] = set()
    for e in told:
        assert e.medium == "cpu"
        if isinstance(e, BlockStored):
            assert e.block_hash not in held
            held.add(e.block_hash)
        else:
            held.remove(e.block_hash)
    assert held == set(store.hashes())
    store.close()


def test_wire_events_batch_each_medium_on_its_own():
    a, b, c, d = (bytes([i]) * 32 for i in range(1, 5))
    events: list[KVEvent] = [
        BlockStored(a, None, (1, 2)), BlockStored(a, None, (1, 2), medium="cpu"),
        BlockStored(b, a, (3, 4)), BlockStored(b, a, (3, 4), medium="cpu"),  # two chains
        BlockRemoved(c, "disk"), BlockStored(c, b, (5, 6), medium="cpu"),
        BlockRemoved(d, "disk"), BlockRemoved(a), BlockRemoved(b, "cpu"), BlockRemoved(b),
        BlockStored(d, None, (7, 8), medium="disk")]
    ids = {x: block_id(x) for x in (a, b, c, d)}
    assert encode_events(events, BLOCK) == [
        ["BlockStored", [ids[a], ids[b]], None, [1, 2, 3, 4], BLOCK, None, "GPU"],
        ["BlockStored", [ids[a], ids[b], ids[c]], None, [1, 2, 3, 4, 5, 6], BLOCK, None,
         "CPU_TIER1"],
        ["BlockRemoved", [ids[c], ids[d]], "CPU_TIER2"],
        ["BlockRemoved", [ids[a], ids[b]], "GPU"],
        ["BlockRemoved", [ids[b]], "CPU_TIER1"],
        ["BlockStored", [ids[d]], None, [7, 8], BLOCK, None, "CPU_TIER2"]]
    with pytest.raises(ValueError, match="medium 'nvme' has no Dynamo name"):
        encode_events([BlockRemoved(a, "nvme")], BLOCK)


def test_the_publisher_tracks_each_medium_apart():
    pub = ZmqEventPublisher(block_size=BLOCK)
    a, b, evicted = bytes([1]) * 32, bytes([2]) * 32, bytes([3]) * 32
    events = received_events(pub, [
        BlockStored(a, None, (1, 2)),
        BlockStored(b, evicted, (3, 4), medium="disk"),  # its parent is nowhere
        BlockRemoved(a, "cpu"),  # never stored on the host tier: not sent
        BlockRemoved(b, "disk"), BlockRemoved(a)], 5)
    assert events == [
        ["AllBlocksCleared"],
        ["BlockStored", [block_id(a)], None, [1, 2], BLOCK, None, "GPU"],
        ["BlockStored", [block_id(b)], block_id(evicted), [3, 4], BLOCK, None, "CPU_TIER2"],
        ["BlockRemoved", [block_id(b)], "CPU_TIER2"],
        ["BlockRemoved", [block_id(a)], "GPU"]]
