"""The block pool: fixed-size KV blocks, reference counts, and the prefix cache. Pure Python.

Block ids are integers ``0 .. num_blocks-1``. Block 0 is the null block: block tables are padded
with it, it is never handed out, and nothing meaningful is ever written to or read from it.

Prefix caching: a full block may carry a content hash (see :func:`hash_block`). When its last
reference goes, a hashed block stays in the pool, findable by its hash, until it is evicted to
make room: the free queue is ordered least recently freed first, and allocation evicts from its
front. A block with references is never on the free queue, so it is never evicted.

KV events: with ``events`` set to a list (``BlockPool.record_events()``), the pool appends a
:class:`BlockStored` each time a block's content enters the cache and a :class:`BlockRemoved`
each time one is evicted, for a distributed router (kvflow's Dynamo worker) to mirror the cache.
Whoever reads them takes them with ``take_events``. Each event names its ``medium``: the pool's
is ``"gpu"`` (whatever the device); the KV tiers below it (:mod:`kvflow.kv_manager.tier_store`)
emit theirs, ``"cpu"`` and ``"disk"``, for the blocks they keep. While events are recorded the
pool also keeps each cached block's :class:`BlockStored` (``stored``) and hands it to
``on_evict_block``, so that a tier can announce the block with the same parent and tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """The pool cannot hand out the blocks asked for."""


BlockHash = bytes
POOL_MEDIUM = "gpu"  # the KV pool's medium in events; the tiers' are their stores' ``medium``


@dataclass(frozen=True)
class BlockStored:
    """A full block's content entered a cache: its hash, its parent's (None for a sequence's
    first block), its token ids, whether a cache salt went into its hash, the LoRA adapter it
    was computed under (its ``lora_id``; None: the base model), and the ``medium`` that holds
    it (the pool, or a KV tier)."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    salted: bool = False
    lora_id: int | None = None
    medium: str = POOL_MEDIUM


@dataclass(frozen=True)
class BlockRemoved:
    """A block left a cache (evicted, dropped, found corrupt): ``medium`` can no longer hit it."""

    block_hash: BlockHash
    medium: str = POOL_MEDIUM


KVEvent = BlockStored | BlockRemoved


# NOTE: no cache salt (UTF-8 text) holds the byte 0xff, so an adapter's key never equals one.
_LORA_KEY = b"\xfflora:"


def block_extra(salt: bytes, lora_digest: str | None = None) -> bytes:
    """The extra keys of a request's block hashes: its cache salt and, under a LoRA adapter,
    the adapter's digest (the same tokens under two adapters, or an adapter and the base,
    hold different KV, so they never share a block)."""
    if lora_digest is None:
        return salt
    return _LORA_KEY + bytes.fromhex(lora_digest) + salt


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """SHA-256 of (parent block's hash, this block's token ids, extra keys such as a cache salt).

    Chaining makes a block's hash stand for its whole prefix. The 256-bit digest is the cache
    key itself, with no token check on a hit: a collision needs about 2**128 blocks.
    """
    h = hashlib.sha256(parent or b"\x00" * 32)
    h.update(array("q", token_ids).tobytes())
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    return h.digest()


class BlockPool:
    """Reference counts and the free queue of ``num_blocks`` KV blocks (block 0 reserved).

    ``allocate`` takes blocks from the front of the free queue (evicting their cached contents);
    ``free`` drops one reference per block, and blocks reaching zero go to the back, still
    cached if they were hashed. ``touch`` takes a reference on a cache hit.
    """

    NULL_BLOCK = 0

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (one is the reserved null block), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        # NOTE: an OrderedDict as an LRU queue: O(1) pop from the front, O(1) removal of a
        # cached block that gets hit while free.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.num_evictions = 0
        self.events: list[KVEvent] | None = None  # None: not recorded
        # While events are recorded: each cached block's BlockStored (a tier re-announces it).
        self.stored: dict[BlockHash, BlockStored] = {}
        # Told each evicted hash (what is kept beside a cached block goes with it).
        self.on_evict: Callable[[BlockHash], None] | None = None
        # Told each evicted (block, hash, its BlockStored while events are recorded, else
        # None) before the block is handed out, its content still intact (the KV tiers copy
        # it out).
        self.on_evict_block: Callable[[int, BlockHash, BlockStored | None], None] | None = None

    def record_events(self) -> None:
        """Start recording :class:`BlockStored` / :class:`BlockRemoved` events."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be allocated (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks without references: empty, or cached and evictable."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced, in [0, 1]."""
        return self.num_used_blocks / self.num_usable_blocks

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks with a reference count of one each, evicting least recent first."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self.block_hashes[b]
            if h is not None:
                del self.cached[h]
                self.block_hashes[b] = None
                self.num_evictions += 1
                meta = self.stored.pop(h, None)
                if self.events is not None:
                    self.events.append(BlockRemoved(h))
                if self.on_evict_block is not None:
                    self.on_evict_block(b, h, meta)
                if self.on_evict is not None:
                    self.on_evict(h)
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on blocks found in the cache (free ones leave the free queue)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference per block; blocks reaching zero go to the back of the queue."""
        for b in blocks:
            if b == self.NULL_BLOCK:
                raise ValueError("the null block is never allocated and cannot be freed")
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed more often than it was allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding ``block_hash``'s content, if it is still cached."""
        return self.cached.get(block_hash)

    def cache_block(self, block: int, block_hash: BlockHash, parent: BlockHash | None = None,
                    token_ids: Sequence[int] = (), salted: bool = False,
                    lora_id: int | None = None) -> None:
        """Record that ``block`` (referenced, full, computed) holds ``block_hash``'s content;
        ``parent``, ``token_ids``, ``salted`` and ``lora_id`` only describe it in the
        :class:`BlockStored` event.

        If another block already holds that content, this one stays unhashed (a duplicate that
        is simply reused like an empty block once freed).
        """
        if self.block_hashes[block] is not None or block_hash in self.cached:
            return
        self.cached[block_hash] = block
        self.block_hashes[block] = block_hash
        if self.events is not None:
            event = BlockStored(block_hash, parent, tuple(token_ids), salted, lora_id)
            self.events.append(event)
            self.stored[block_hash] = event

    def free_queue(self) -> list[int]:
        """The free blocks, next to be evicted first."""
        return list(self._free)

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + used == usable and the cache index is consistent."""
        assert self.NULL_BLOCK not in self._free, "the null block is on the free queue"
        assert self.ref_counts[self.NULL_BLOCK] == 0, "the null block has references"
        assert self.block_hashes[self.NULL_BLOCK] is None, "the null block is cached"
        for b in range(1, self.num_blocks):
            rc = self.ref_counts[b]
            assert rc >= 0, f"block {b} has a negative reference count"
            assert (rc == 0) == (b in self._free), (
                f"block {b}: ref count {rc} but {'on' if b in self._free else 'off'} the free queue"
            )
            h = self.block_hashes[b]
            if h is not None:
                assert self.cached.get(h) == b, f"block {b}'s hash is not indexed to it"
        for h, b in self.cached.items():
            assert self.block_hashes[b] == h, f"cache index points {h.hex()[:8]} at block {b}"
        assert self.stored.keys() <= self.cached.keys(), "an evicted block's event is kept"
