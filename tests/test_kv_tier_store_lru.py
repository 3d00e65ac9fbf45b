"""The secondary KV tiers' stores, by property (hypothesis): random puts, gets, discards,
restarts and corruptions never exceed the byte budget, never return another hash's payload,
evict exactly a model LRU's oldest blocks, and keep the disk tier's index equal to its files."""

from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvflow.kv_manager.tier_disk import DiskBlockStore
from kvflow.kv_manager.tier_store import BlockStore, HostBlockStore
from tests.test_kv_tier_store import CORRUPTIONS, NS, block_files, block_hash, payload

# Each hash's payload size: with the disk tier's header, the last but one never fits in 1,200.
SIZES = [0, 60, 150, 250, 400, 550, 1_200, 90]


class TierStoreMachine(RuleBasedStateMachine):
    """Random puts, gets, discards, restarts and corruptions against a model LRU: the store
    never holds more than its budget, never returns another hash's payload, evicts exactly the
    model's least recently used blocks, and its index matches its files."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="kv-tier-"))
        self.told: list[bytes] = []
        self.model: OrderedDict[bytes, int] = OrderedDict()
        self.capacity = 1_200
        self.store: BlockStore = self.open()

    def open(self) -> BlockStore:
        store: BlockStore = (DiskBlockStore(self.tmp, self.capacity, NS) if self.disk
                             else HostBlockStore(self.capacity))
        store.on_evict = self.told.append
        return store

    disk = True

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.tmp)

    def drop(self, h: bytes) -> None:
        del self.model[h]
        self.expected_told.append(h)

    @rule(i=st.integers(0, 7))
    def put(self, i):
        h, self.expected_told = block_hash(i), []
        size = self.store.block_bytes(h, SIZES[i])
        stored = self.store.put(h, payload(i, SIZES[i]))
        if h in self.model:
            assert stored
            self.model.move_to_end(h)
        elif size > self.capacity:
            assert not stored
        else:
            assert stored
            while sum(self.model.values()) + size > self.capacity:
                self.drop(next(iter(self.model)))
            self.model[h] = size
        assert self.told == self.expected_told
        self.told.clear()

    @rule(i=st.integers(0, 7))
    def get(self, i):
        h = block_hash(i)
        got = self.store.get(h)
        if h in self.model:
            assert got == payload(i, SIZES[i])
            self.model.move_to_end(h)
        else:
            assert got is None

    @rule(i=st.integers(0, 7))
    def discard(self, i):
        self.store.discard(block_hash(i))
        self.model.pop(block_hash(i), None)
        self.told.clear()

    @precondition(lambda self: self.disk)
    @rule()
    def restart(self):
        self.store.close()
        self.store = self.open()

    @precondition(lambda self: self.disk and self.model)
    @rule(data=st.data(), kind=st.sampled_from(sorted(CORRUPTIONS)))
    def corrupt(self, data, kind):
        h = data.draw(st.sampled_from(list(self.model)))
        assert isinstance(self.store, DiskBlockStore)
        others = [x for x in self.model if x != h]
        if kind == "another_blocks_file" and others:
            shutil.copyfile(self.store.path(others[0]), self.store.path(h))
        elif kind != "another_blocks_file":
            CORRUPTIONS[kind](self.store.path(h), self.store)
        else:
            CORRUPTIONS["truncated"](self.store.path(h), self.store)
        corrupt = self.store.stats.corrupt
        assert self.store.get(h) is None
        assert self.store.stats.corrupt == corrupt + 1
        del self.model[h]
        self.told.clear()

    @invariant()
    def matches_the_model(self):
        assert self.store.hashes() == list(self.model)
        assert self.store.stats.bytes == sum(self.model.values()) <= self.capacity
        assert self.store.stats.blocks == len(self.model)
        if isinstance(self.store, DiskBlockStore):
            assert block_files(self.store) == dict(self.model)
            assert not list(self.store.folder.glob("*/*.tmp"))


TestDiskTierStoreMachine = TierStoreMachine.TestCase
TestDiskTierStoreMachine.settings = settings(max_examples=60, stateful_step_count=30,
                                             deadline=None)


class HostTierStoreMachine(TierStoreMachine):
    disk = False


TestHostTierStoreMachine = HostTierStoreMachine.TestCase
TestHostTierStoreMachine.settings = settings(max_examples=40, stateful_step_count=30,
                                             deadline=None)
