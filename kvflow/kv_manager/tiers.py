"""The KV tiers below the pool: prefix cache blocks evicted from the pool live on, by hash, in a
host tier and a disk tier, and a later prefix hit loads them back. Pure Python.

The pool tells :meth:`KVTiers.evicted` each cached block it evicts, before anything overwrites
it (a block allocated in ``schedule()`` is written only by the step after it), and the block's
bytes are copied out at once (``read_blocks``, on the engine thread); the writer thread stores
them in the top tier. A full host tier passes its least recently used blocks down to the disk
tier (if any). A write in flight stays visible to lookups and loads (never missed, never
stored twice); past ``max_writing_bytes`` in flight, ``evicted`` waits for the writer
(backpressure) rather than hold an unbounded copy of the evictions.

A restore (:meth:`KVTiers.restore`) allocates pool blocks for the tier hits that continue a
request's pool hits, indexes them under their hashes (they are then ordinary cached blocks)
and keeps their payloads pending; the engine writes them (:meth:`KVTiers.flush_restores`,
``write_blocks``) after the scheduler's transfers and before the step. A pending block that is
evicted again before its write gives its payload back to the tier instead of its stale bytes.
The loads themselves run ahead on the loader thread (:meth:`KVTiers.prefetch`); an engine with
nothing else to run waits for one (:meth:`KVTiers.wait_for_loads`) instead of spinning.

The block hash already covers the cache salt and the LoRA adapter; the disk tier's namespace
(:func:`~kvflow.kv_manager.tier_store.tier_namespace`) covers the model, the engine build, the
KV dtype and the block size, so a different engine never reads another's blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvflow.kv_manager.block_pool import BlockHash, BlockPool, BlockStored
from kvflow.kv_manager.window import windowed_hit

if TYPE_CHECKING:
    from kvflow.kv_manager.tier_store import BlockStore

MAX_PREFETCHED = 4096  # blocks loaded ahead and not yet restored, before unclaimed ones go
MAX_WRITING_BYTES = 64 << 20  # evicted bytes the writer may lag behind (hundreds of blocks)
LOAD_WAIT_S = 0.03  # an idle engine's wait for a load: short, so arrivals and aborts go in
ReadBlocks = Callable[[list[int]], list[bytes]]
WriteBlocks = Callable[[list[int], list[bytes]], None]
Loaded = tuple[bytes, str]  # a block's payload and the medium it came from
IN_TIER = -1  # extend_hit's mark of a block a tier holds (never a pool block)

logger = logging.getLogger(__name__)


@dataclass
class TierCounters:
    """What the engine did with one tier: blocks restored from it into the pool (``hits``,
    each once), the bytes read from it (``loaded_bytes``, prefetched loads that no restore took
    included) and stored in it, and the seconds spent reading (``load_s``, on the loader
    thread when prefetched) and storing (``store_s``, on the writer thread)."""

    hits: int = 0
    loaded_bytes: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    load_s: float = 0.0
    store_s: float = 0.0


@dataclass
class KVTiers:
    """The secondary tiers of one KV pool, highest first (host, then disk), and the runner's
    block copies (``read_blocks``, ``write_blocks``). ``loader`` and ``writer`` (one thread
    each) take tier reads and writes off the engine thread (None: the caller's thread does
    them); the rest is the engine thread's."""

    stores: Sequence[BlockStore]
    read_blocks: ReadBlocks
    clock: Callable[[], float] = time.perf_counter
    counters: dict[str, TierCounters] = field(default_factory=dict)
    # Restored blocks whose payloads the runner has not written yet: block -> payload.
    pending: dict[int, bytes] = field(default_factory=dict)
    write_s: float = 0.0  # engine-thread seconds writing restored blocks into the pool
    read_s: float = 0.0  # engine-thread seconds copying evicted blocks out of the pool
    loader: ThreadPoolExecutor | None = None  # prefetch's loads
    writer: ThreadPoolExecutor | None = None  # evicted()'s stores and demotions
    max_writing_bytes: int = MAX_WRITING_BYTES
    load_wait_s: float = LOAD_WAIT_S
    num_prefetched: int = 0  # loads started on the loader thread
    writer_wait_s: float = 0.0  # engine-thread seconds evicted() waited for the writer
    _loads: dict[BlockHash, Future[Loaded | None]] = field(default_factory=dict, repr=False)
    # Writes not done yet: hash -> (payload, the tier level it goes to). Guarded by _cond,
    # which also guards the counters (three threads add to them) and the figures below.
    _writing: dict[BlockHash, tuple[bytes, int]] = field(default_factory=dict, repr=False)
    _writing_bytes: int = field(default=0, repr=False)  # evicted payloads in flight
    _num_writes: int = field(default=0, repr=False)  # evicted() writes not done
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def __post_init__(self) -> None:
        if not self.stores:
            raise ValueError("KVTiers needs at least one tier (host or disk)")
        if self.max_writing_bytes <= 0:
            raise ValueError(f"max_writing_bytes must be > 0, got {self.max_writing_bytes}")
        for s in self.stores:
            self.counters.setdefault(s.medium, TierCounters())

    def holds(self, block_hash: BlockHash) -> bool:
        """Whether some tier holds ``block_hash``, or a write of it is in flight."""
        with self._cond:
            if block_hash in self._writing:
                return True
        return any(s.contains(block_hash) for s in self.stores)

    # --- down: the pool evicts ----------------------------------------------------------------
    def evicted(self, block: int, block_hash: BlockHash,
                meta: BlockStored | None = None) -> None:
        """The pool evicted cached ``block`` (its content still intact): copy it out now and
        keep it in the top tier (unless a tier already holds it), on the writer thread, with
        ``meta`` (its event in the pool, while events are recorded) for the tier's own KV
        event. With ``max_writing_bytes`` already in flight this waits for the writer first."""
        payload = self.pending.pop(block, None)
        if self.holds(block_hash):
            return
        t0 = self.clock()
        if payload is None:
            payload = self.read_blocks([block])[0]
            self.read_s += self.clock() - t0
        if self.writer is None:
            self._put(0, block_hash, payload, t0, meta)
            return
        size = len(payload)
        with self._cond:
            if self._writing_bytes + size > self.max_writing_bytes:
                # NOTE: backpressure: the engine stalls only when the writer falls this far
                # behind (a slow disk under a storm of evictions), never grows memory.
                t1 = self.clock()
                self._cond.wait_for(lambda: not self._writing_bytes or
                                    self._writing_bytes + size <= self.max_writing_bytes)
                self.writer_wait_s += self.clock() - t1
            # Submitted under the lock: the write's end (which takes it) follows this record.
            self.writer.submit(self._write, block_hash, payload, meta)
            self._writing[block_hash] = (payload, 0)
            self._writing_bytes += size
            self._num_writes += 1

    def _write(self, block_hash: BlockHash, payload: bytes,
               meta: BlockStored | None) -> None:
        """The writer thread's half of :meth:`evicted`."""
        try:
            self._put(0, block_hash, payload, self.clock(), meta)
        except Exception:  # noqa: BLE001  (the block is only lost: log, never kill the writer)
            logger.exception("kv tiers: block %s not stored", block_hash.hex())
        finally:
            with self._cond:
                self._writing.pop(block_hash, None)
                self._writing_bytes -= len(payload)
                self._num_writes -= 1
                self._cond.notify_all()

    def _put(self, level: int, block_hash: BlockHash, payload: bytes, t0: float,
             meta: BlockStored | None = None) -> None:
        """Store in tier ``level``, first passing its least recently used blocks down to the
        next tier while it is full."""
        store = self.stores[level]
        if level + 1 < len(self.stores):
            # NOTE: demote by hand rather than through the store's on_evict: that hook tells
            # only the hash, after the payload is gone.
            size = store.block_bytes(block_hash, len(payload))
            while store.hashes() and store.stats.bytes + size > store.capacity_bytes:
                self._demote(level, store.hashes()[0])
        if store.put(block_hash, payload, meta):
            with self._cond:
                c = self.counters[store.medium]
                c.stored_blocks += 1
                c.stored_bytes += len(payload)
                c.store_s += self.clock() - t0

    def _demote(self, level: int, block_hash: BlockHash) -> None:
        """Move ``block_hash`` from tier ``level`` to the next one down; it stays visible
        (in flight) between the two."""
        store, lower = self.stores[level], self.stores[level + 1]
        old, old_meta = store.get(block_hash), store.meta(block_hash)
        if old is None or lower.contains(block_hash):
            store.discard(block_hash)
            return
        # NOTE: no eviction of it is in flight: evicted() queues none of a hash a tier holds,
        # and only this thread writes the stores.
        with self._cond:
            self._writing[block_hash] = (old, level + 1)
        try:
            store.discard(block_hash)
            self._put(level + 1, block_hash, old, self.clock(), old_meta)
        finally:
            with self._cond:
                del self._writing[block_hash]

    # --- up: a prefix hit continues into the tiers --------------------------------------------
    def num_hits(self, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes``, from the first, some tier holds (or is writing)."""
        n = 0
        for h in hashes:
            if not self.holds(h):
                break
            n += 1
        return n

    def extend_hit(self, pool: BlockPool, hits: list[int], hashes: Sequence[BlockHash],
                   window: int | None, block_size: int) -> tuple[list[int], list[int]]:
        """The longest prefix hit the pool and the tiers together give over ``hashes`` (a
        sequence's candidate blocks, whose pool hit is ``hits``): the pool blocks it keeps and
        the indexes of those to load from the tiers (none: the pool's hit is as long). Under
        a ``window`` it ends with the blocks the next token's window reaches, as a pool hit
        does (:func:`~kvflow.kv_manager.window.windowed_hit`), wherever each one lives."""
        if window is None:
            n = len(hits)
            return hits, list(range(n, n + self.num_hits(hashes[n:])))

        def lookup(h: BlockHash) -> int | None:
            block = pool.lookup(h)
            return block if block is not None else IN_TIER if self.holds(h) else None

        both = windowed_hit(lookup, hashes, len(hashes), window, block_size)
        if len(both) <= len(hits):
            return hits, []
        return ([b for b in both if b > BlockPool.NULL_BLOCK],
                [i for i, b in enumerate(both) if b == IN_TIER])

    def prefetch(self, hashes: Sequence[BlockHash]) -> bool:
        """Start loading the run of ``hashes`` (a request's, after its pool hits) that the
        tiers hold, on the loader thread; whether some of it is still loading (the request
        then waits, while the engine runs the others). False without a loader."""
        if self.loader is None:
            return False
        if len(self._loads) > MAX_PREFETCHED:  # loads no request took (aborted, evicted)
            self._loads = {h: f for h, f in self._loads.items() if not f.done()}
        busy = False
        for h in hashes[:self.num_hits(hashes)]:
            load = self._loads.get(h)
            if load is None:
                load = self._loads[h] = self.loader.submit(self._load, h)
                self.num_prefetched += 1
            busy = busy or not load.done()
        return busy

    def wait_for_loads(self, timeout_s: float | None = None) -> bool:
        """Wait until one of the loads in flight finishes, at most ``timeout_s`` (default
        ``load_wait_s``): an engine whose only work waits for its prefix calls this rather
        than step again at once. Whether a load was in flight."""
        busy = [f for f in self._loads.values() if not f.done()]
        if not busy:
            return False
        wait(busy, self.load_wait_s if timeout_s is None else timeout_s, FIRST_COMPLETED)
        return True

    def _take(self, block_hash: BlockHash) -> Loaded | None:
        """The payload prefetched for ``block_hash``, or loaded now."""
        load = self._loads.pop(block_hash, None)
        return load.result() if load is not None else self._load(block_hash)

    def restore(self, pool: BlockPool, hits: Sequence[int], hashes: Sequence[BlockHash],
                max_blocks: int, describe: Callable[[int], tuple] | None = None,
                whole: bool = False) -> int:
        """Load tier blocks for ``hashes`` (those :meth:`extend_hit` found to lengthen the
        request's pool ``hits``), at most ``max_blocks`` (``whole``: all or none, as under a
        window: a part of the blocks the next token's window reaches is no hit), into fresh
        pool blocks indexed under those hashes; returns how many (each counted once, in its
        tier's ``hits``). It stops at a block no tier holds, or a corrupt one (then
        recomputed). ``describe(i)``: the ``cache_block`` event fields of ``hashes[i]``
        (parent, token ids, salted, lora id)."""
        n = min(self.num_hits(hashes), max_blocks)
        if n <= 0 or (whole and n < len(hashes)):
            return 0
        # NOTE: the pool hits leave the free queue while this allocates, or it could evict
        # the very prefix it extends (and so they no longer count as free).
        live = [b for b in hits if b != BlockPool.NULL_BLOCK]
        pool.touch(live)
        try:
            n = min(n, pool.num_free_blocks)
            blocks = pool.allocate(n) if n == len(hashes) or not whole else []
        finally:
            pool.free(live)
        if not blocks:
            return 0
        restored: Counter[str] = Counter()
        for i, block in enumerate(blocks):
            loaded = self._take(hashes[i])
            if loaded is None:
                break
            parent, token_ids, salted, lora_id = describe(i) if describe else (None, (), False,
                                                                                None)
            pool.cache_block(block, hashes[i], parent, token_ids, salted, lora_id)
            self.pending[block] = loaded[0]
            restored[loaded[1]] += 1
        with self._cond:
            for medium, count in restored.items():
                self.counters[medium].hits += count
        # Restored blocks go to the back of the free queue, cached, for the caller to take;
        # the ones not filled go back empty.
        pool.free(blocks)
        return sum(restored.values())

    def _load(self, block_hash: BlockHash) -> Loaded | None:
        """Read ``block_hash`` from the writes in flight or the highest tier that has it
        intact; None when none has it. Counts the bytes and seconds read, not a hit: a restore
        counts that."""
        t0 = self.clock()
        # NOTE: the writes in flight are looked at again after the stores: a block moving
        # down from the host tier is in flight between the two, and may be in neither store.
        loaded = self._in_flight(block_hash) or self._read(block_hash) or \
            self._in_flight(block_hash)
        if loaded is not None:
            with self._cond:
                c = self.counters[loaded[1]]
                c.loaded_bytes += len(loaded[0])
                c.load_s += self.clock() - t0
        return loaded

    def _read(self, block_hash: BlockHash) -> Loaded | None:
        for s in self.stores:
            if s.contains(block_hash):
                payload = s.get(block_hash)
                if payload is not None:
                    return payload, s.medium
                # corrupt (dropped and counted by the store): a lower tier may have it
        return None

    def _in_flight(self, block_hash: BlockHash) -> Loaded | None:
        with self._cond:
            writing = self._writing.get(block_hash)
        return None if writing is None else (writing[0], self.stores[writing[1]].medium)

    def flush_restores(self, write_blocks: WriteBlocks) -> int:
        """Write the pending restored payloads into their blocks (before the step reads
        them); returns how many."""
        if not self.pending:
            return 0
        blocks, payloads = list(self.pending), list(self.pending.values())
        self.pending = {}
        t0 = self.clock()
        write_blocks(blocks, payloads)
        self.write_s += self.clock() - t0
        return len(blocks)

    # --- shutdown -----------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait until every write :meth:`evicted` handed to the writer is done."""
        with self._cond:
            self._cond.wait_for(lambda: not self._num_writes)

    def persist(self, pool: BlockPool) -> int:
        """Keep what only the pool and the host tier hold in the bottom tier (the disk's, at
        shutdown: the next process finds it), after the writes in flight; returns how many
        blocks it wrote."""
        self.drain()
        bottom = self.stores[-1]
        written = 0
        cached = [(b, h) for h, b in pool.cached.items() if not bottom.contains(h)]
        for i in range(0, len(cached), 256):  # in chunks: a copy of the whole pool is not free
            chunk = cached[i:i + 256]
            for (block, h), payload in zip(chunk, self.read_blocks([b for b, _ in chunk]),
                                           strict=True):
                written += bottom.put(h, self.pending.get(block, payload), pool.stored.get(h))
        for upper in self.stores[:-1]:
            for h in upper.hashes():
                if not bottom.contains(h):
                    payload_or_none = upper.get(h)
                    if payload_or_none is not None:
                        written += bottom.put(h, payload_or_none, upper.meta(h))
        return written

    def close(self) -> None:
        """Finish the writes in flight, stop the loader and writer threads and close the
        stores (idempotent)."""
        if self.writer is not None:
            self.drain()
            self.writer.shutdown(wait=True)
        if self.loader is not None:
            self.loader.shutdown(wait=True, cancel_futures=True)
        self._loads.clear()
        for s in self.stores:
            s.close()

    def state(self) -> list[dict[str, Any]]:
        """Each tier's figures, top first (for the console and the metrics)."""
        out: list[dict[str, Any]] = []
        with self._cond:
            for s in self.stores:
                c = self.counters[s.medium]
                out.append({"medium": s.medium, "capacity_bytes": s.capacity_bytes,
                            "bytes": s.stats.bytes, "blocks": s.stats.blocks, "hits": c.hits,
                            "loaded_bytes": c.loaded_bytes, "stored_blocks": c.stored_blocks,
                            "stored_bytes": c.stored_bytes, "load_s": c.load_s,
                            "store_s": c.store_s, "corrupt": s.stats.corrupt,
                            "evictions": s.stats.evictions})
        return out
