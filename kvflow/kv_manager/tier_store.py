"""Secondary KV tiers' storage: blocks' KV bytes by block hash, LRU-bounded by bytes. Pure Python.

When the prefix cache evicts a block from the pool, its KV can go down to a secondary tier
instead of being dropped, and a later prefix hit on that tier loads it back. A
:class:`BlockStore` is what one tier holds: opaque payloads (every layer's K and V of a block,
as the runner reads them) keyed by the block's chained hash, which stands for the block's whole
prefix, so a hash always names the same content and a payload is never rewritten in place.

- :class:`HostBlockStore` (medium ``"cpu"``): payloads in host memory, ``kv_offload_bytes``.
- :class:`~kvflow.kv_manager.tier_disk.DiskBlockStore` (medium ``"disk"``): one checked file
  per block, ``kv_disk_bytes``; it outlives the process.

Each store is least-recently-used by bytes: a ``put`` evicts the oldest blocks until the new
one fits, and a ``get`` hit makes a block the newest. :func:`tier_namespace` names everything
that makes KV bytes differ beyond the block hash (model, engine build, KV dtype, layout), so a
disk tier written by another build is never even looked at.

KV events: once a store ``record_events(sink)``, it hands ``sink`` a
:class:`~kvflow.kv_manager.block_pool.BlockStored` of its ``medium`` for each block it stores
with its metadata (the pool's event of the block: parent hash, token ids, salt, LoRA id; the
pool keeps it while events are recorded) and a ``BlockRemoved`` for each block it drops, for a
router to know which worker's tiers hold a prefix (kvflow's Dynamo worker). The sink is called
with the store's lock held, so its events are in the order of the store's operations whatever
threads call them: it must be quick and thread-safe and never call the store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from kvflow.kv_manager.block_pool import BlockRemoved, BlockStored, KVEvent

# kvflow's media of the secondary tiers ("gpu" is the pool itself), in metrics and KV events;
# on Dynamo's wire they are vLLM's names (kvflow.dynamo.events.WIRE_MEDIUM).
TIER_MEDIA = ("cpu", "disk")
# A block hash is hash_block's SHA-256 digest; the bound keeps a hash's file name short.
MAX_HASH_BYTES = 64
EventSink = Callable[[list[KVEvent]], None]

logger = logging.getLogger(__name__)


@dataclass
class TierStats:
    """One tier's counters since it was opened: ``hits``/``misses`` of ``get``, ``stores``
    (payloads written), ``evictions`` (least recently used blocks dropped to make room),
    ``corrupt`` (blocks whose check failed on ``get``, dropped), what it holds now (``bytes``,
    ``blocks``) and the seconds spent in loads and stores."""

    hits: int = 0
    misses: int = 0
    stores: int = 0
    evictions: int = 0
    corrupt: int = 0
    bytes: int = 0
    blocks: int = 0
    load_s: float = 0.0
    store_s: float = 0.0


def check_capacity(capacity_bytes: int, field: str) -> None:
    """Refuse a tier budget that is not a positive integer, naming the option it came from."""
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        raise ValueError(f"{field} must be an integer number of bytes, "
                         f"got {capacity_bytes!r}")
    if capacity_bytes <= 0:
        raise ValueError(f"{field} must be > 0 to open the tier (0 turns it off), "
                         f"got {capacity_bytes}")


def check_block_hash(block_hash: bytes) -> None:
    """Refuse a key that is not a block hash (bytes, 1 to ``MAX_HASH_BYTES`` long)."""
    if not isinstance(block_hash, bytes):
        raise TypeError(f"block_hash must be bytes, got {type(block_hash).__name__}")
    if not 1 <= len(block_hash) <= MAX_HASH_BYTES:
        raise ValueError(f"block_hash must be 1 to {MAX_HASH_BYTES} bytes, "
                         f"got {len(block_hash)}")


def byte_view(payload: bytes | bytearray | memoryview) -> memoryview:
    """``payload`` as a flat view of unsigned bytes (a typed or strided buffer counts by its
    bytes, not its items), without a copy where the buffer allows."""
    view = memoryview(payload)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class BlockStore(ABC):
    """One secondary tier: blocks' KV bytes by block hash, LRU-bounded by bytes.

    The index (hash -> bytes the block takes from ``capacity_bytes``, oldest first) lives in
    memory; subclasses keep the payloads. ``on_evict`` is told each hash the store drops, for
    any reason: evicted for room, found corrupt or missing on ``get``, or ``discard``-ed.

    Thread-safe: one lock serializes each store's operations, its I/O included, so the tiers
    may ``put`` from a background thread while another thread calls ``get``. ``on_evict`` runs
    on the thread whose call dropped the hash, after the lock is released (so it may call the
    store, or take a lock of its own held by a caller of the store, without deadlock); by then
    another thread may have stored the hash again, which ``contains`` tells.
    """

    medium: str

    def __init__(self, capacity_bytes: int, field: str) -> None:
        check_capacity(capacity_bytes, field)
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self.on_evict: Callable[[bytes], None] | None = None
        self.events: EventSink | None = None  # where KV events go (record_events)
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    # What a tier does with payloads; called with the lock held.
    @abstractmethod
    def block_bytes(self, block_hash: bytes, payload_bytes: int) -> int:
        """The bytes a block with a payload of ``payload_bytes`` takes from the budget."""

    @abstractmethod
    def _write(self, block_hash: bytes, payload: memoryview, meta: BlockStored | None) -> None:
        """Keep ``payload`` and, when given, the block's event metadata beside it."""

    def _meta_bytes(self, meta: BlockStored | None) -> int:
        """The bytes ``meta`` adds to a block's share of the budget (beyond block_bytes)."""
        return 0

    @abstractmethod
    def _meta(self, block_hash: bytes) -> BlockStored | None:
        """The metadata kept with a held block (None: stored without)."""

    @abstractmethod
    def _announce(self, dropped: list[bytes]) -> list[BlockStored]:
        """A BlockStored of this medium for each held block that has metadata, least
        recently used first (what ``record_events`` tells a new sink); a block found
        corrupt on the way is dropped (and added to ``dropped``)."""

    @abstractmethod
    def _read(self, block_hash: bytes) -> bytes | None:
        """The payload, or None when it is gone or fails its check (counted there)."""

    @abstractmethod
    def _delete(self, block_hash: bytes) -> None: ...

    @abstractmethod
    def _touch(self, block_hash: bytes) -> None:
        """Record a use of a block outside the in-memory index (the disk tier's mtime)."""

    @abstractmethod
    def _close(self) -> None: ...

    def contains(self, block_hash: bytes) -> bool:
        """Whether the tier holds ``block_hash`` (a later ``get`` may still find it corrupt)."""
        with self._lock:
            self._check_open()
            return block_hash in self._index

    def record_events(self, sink: EventSink) -> None:
        """Send KV events to ``sink`` from now on, first a BlockStored for each block held
        with metadata (a disk tier's from an earlier process: their headers are read)."""
        dropped: list[bytes] = []
        with self._lock:
            self._check_open()
            self.events = sink
            held: list[KVEvent] = list(self._announce(dropped))
            if held:
                sink(held)
        self._notify(dropped)

    def meta(self, block_hash: bytes) -> BlockStored | None:
        """The event metadata stored with ``block_hash`` (None: not held, or held without)."""
        with self._lock:
            self._check_open()
            return self._meta(block_hash) if block_hash in self._index else None

    def put(self, block_hash: bytes, payload: bytes | memoryview,
            meta: BlockStored | None = None) -> bool:
        """Store ``payload`` under ``block_hash``, evicting the least recently used blocks to
        make room. ``meta``: the block's event in the pool (kept beside it for the tier's own
        BlockStored). False when it was not stored: larger than the whole budget alone, or
        the medium refused the write (a full disk: logged). A hash already held is only made
        the newest: the same hash is the same content."""
        check_block_hash(block_hash)
        if meta is not None and meta.block_hash != block_hash:
            raise ValueError(f"meta describes block {meta.block_hash.hex()[:16]}, "
                             f"not block_hash {block_hash.hex()[:16]}")
        view = byte_view(payload)
        dropped: list[bytes] = []
        try:
            with self._lock:
                fresh, stored = block_hash not in self._index, False
                try:
                    stored = self._put(block_hash, view, meta, dropped)
                finally:
                    new = (replace(meta, medium=self.medium)
                           if stored and fresh and meta is not None else None)
                    self._emit(dropped, new)
                return stored
        finally:
            self._notify(dropped)

    def _put(self, block_hash: bytes, view: memoryview, meta: BlockStored | None,
             dropped: list[bytes]) -> bool:
        self._check_open()
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            self._touch(block_hash)
            return True
        size = self.block_bytes(block_hash, view.nbytes) + self._meta_bytes(meta)
        if size > self.capacity_bytes:
            return False
        # NOTE: eviction comes before the write, so the tier never holds more than its budget.
        while self.stats.bytes + size > self.capacity_bytes:
            dropped.append(self._drop_oldest())
        start = time.perf_counter()
        try:
            self._write(block_hash, view, meta)
        except OSError as e:
            log_refused_write(self.medium, block_hash, e)
            return False
        finally:
            self.stats.store_s += time.perf_counter() - start
        self._index[block_hash] = size
        self.stats.bytes += size
        self.stats.blocks += 1
        self.stats.stores += 1
        return True

    def get(self, block_hash: bytes) -> bytes | None:
        """The payload stored under ``block_hash`` (it becomes the newest), or None: absent, or
        gone or corrupt (then dropped, and a corrupt one counted in ``stats.corrupt``)."""
        dropped: list[bytes] = []
        try:
            with self._lock:
                self._check_open()
                if block_hash not in self._index:
                    self.stats.misses += 1
                    return None
                start = time.perf_counter()
                payload = self._read(block_hash)
                self.stats.load_s += time.perf_counter() - start
                if payload is None:
                    self.stats.misses += 1
                    self._forget(block_hash)
                    dropped.append(block_hash)
                    self._emit(dropped)
                    return None
                self.stats.hits += 1
                self._index.move_to_end(block_hash)
                return payload
        finally:
            self._notify(dropped)

    def discard(self, block_hash: bytes) -> None:
        """Drop ``block_hash`` if held (``on_evict`` is told, as for any drop)."""
        with self._lock:
            self._check_open()
            if block_hash not in self._index:
                return
            self._forget(block_hash)
            self._emit([block_hash])
        self._notify([block_hash])

    def hashes(self) -> list[bytes]:
        """The hashes held, least recently used first."""
        with self._lock:
            self._check_open()
            return list(self._index)

    def close(self) -> None:
        """Release the tier (idempotent); every later call but ``close`` raises. The disk
        tier's files stay for the next process."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the {self.medium} tier store is closed")

    def _forget(self, block_hash: bytes) -> None:
        self.stats.bytes -= self._index.pop(block_hash)
        self.stats.blocks -= 1
        self._delete(block_hash)

    def _drop_oldest(self) -> bytes:
        block_hash = next(iter(self._index))
        self._forget(block_hash)
        self.stats.evictions += 1
        return block_hash

    def _emit(self, dropped: list[bytes], stored: BlockStored | None = None) -> None:
        """Tell the sink (if any) of ``dropped`` blocks, then of a ``stored`` one. NOTE: called
        with the lock held, so that events follow the order of the operations."""
        if self.events is None:
            return
        events: list[KVEvent] = [BlockRemoved(h, self.medium) for h in dropped]
        if stored is not None:
            events.append(stored)
        if events:
            self.events(events)

    def _notify(self, dropped: list[bytes]) -> None:
        if self.on_evict is not None:
            for block_hash in dropped:
                self.on_evict(block_hash)


def log_refused_write(medium: str, block_hash: bytes, error: OSError) -> None:
    logger.warning(
        "kv %s tier: block %s not stored: %s", medium, block_hash.hex(), error)


class HostBlockStore(BlockStore):
    """The host tier (medium ``"cpu"``): payloads in host memory, at most ``capacity_bytes``
    (``kv_offload_bytes``) of them. Meant for GPU engines, whose pool is device memory."""

    medium = "cpu"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes, "kv_offload_bytes")
        self._payloads: dict[bytes, bytes] = {}
        self._metas: dict[bytes, BlockStored] = {}

    def block_bytes(self, block_hash: bytes, payload_bytes: int) -> int:
        return payload_bytes

    def _write(self, block_hash: bytes, payload: memoryview, meta: BlockStored | None) -> None:
        # A copy: the caller's buffer (a staging area) is reused for the next block.
        self._payloads[block_hash] = payload.tobytes()
        if meta is not None:
            self._metas[block_hash] = meta

    def _read(self, block_hash: bytes) -> bytes | None:
        return self._payloads[block_hash]

    def _meta(self, block_hash: bytes) -> BlockStored | None:
        return self._metas.get(block_hash)

    def _announce(self, dropped: list[bytes]) -> list[BlockStored]:
        return [replace(self._metas[h], medium=self.medium) for h in self._index
                if h in self._metas]

    def _delete(self, block_hash: bytes) -> None:
        del self._payloads[block_hash]
        self._metas.pop(block_hash, None)

    def _touch(self, block_hash: bytes) -> None:
        pass  # the index's order is the whole LRU state

    def _close(self) -> None:
        self._payloads.clear()
        self._metas.clear()
        self._index.clear()
        self.stats.bytes = self.stats.blocks = 0


def tier_namespace(parts: Mapping[str, str]) -> bytes:
    """A 32-byte name for everything that makes a block's KV bytes differ beyond its hash
    (model digest, engine build id, KV dtype, block size, layout): SHA-256 over the
    ``(key, value)`` pairs, sorted, so their order does not matter. The disk tier keeps each
    namespace in its own folder and checks it in every file, so a tier written by another
    build is ignored, never misread."""
    if not parts:
        raise ValueError("tier_namespace needs at least one part (model digest, build, ...)")
    for key, value in parts.items():
        if not isinstance(key, str) or not key or not isinstance(value, str):
            raise ValueError(f"tier_namespace parts must map non-empty str keys to str values, "
                             f"got {key!r}: {value!r}")
    # JSON keeps the encoding unambiguous whatever the keys and values contain.
    text = json.dumps(sorted(parts.items()), ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(b"kvflow-kv-tier-v1\x00" + text.encode()).digest()
