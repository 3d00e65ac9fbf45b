"""The KV tiers below the pool: prefix cache blocks evicted from the pool live on, by hash, in a
host tier and a disk tier, and a later prefix hit loads them back. Pure Python.

The pool tells :meth:`KVTiers.evicted` each cached block it evicts, before anything overwrites
it (the engine is synchronous: a block allocated in ``schedule()`` is written only by the step
after it), and the block's bytes are copied out at once (``read_blocks``, the runner's) into
the host tier, or the disk tier without one. A host tier full of blocks passes its least
recently used down to the disk tier (if any) before it takes a new one.

A restore (:meth:`KVTiers.restore`) allocates pool blocks for the tier hits that continue a
request's pool hits, indexes them under their hashes (they are then ordinary cached blocks)
and keeps their payloads pending; the engine writes them (:meth:`KVTiers.flush_restores`,
``write_blocks``) after the scheduler's transfers and before the step. A pending block that is
evicted again before its write gives its payload back to the tier instead of its stale bytes.

The block hash already covers the cache salt and the LoRA adapter; the disk tier's namespace
(:func:`~kvflow.kv_manager.tier_store.tier_namespace`) covers the model, the engine build, the
KV dtype and the block size, so a different engine never reads another's blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvflow.kv_manager.block_pool import BlockHash, BlockPool, BlockStored

if TYPE_CHECKING:
    from kvflow.kv_manager.tier_store import BlockStore

MAX_PREFETCHED = 4096  # blocks loaded ahead and not yet restored, before unclaimed ones go
ReadBlocks = Callable[[list[int]], list[bytes]]
WriteBlocks = Callable[[list[int], list[bytes]], None]


@dataclass
class TierCounters:
    """What the engine did with one tier: blocks restored from it (``hits``), the bytes
    restored and stored, and the seconds spent loading and storing."""

    hits: int = 0
    loaded_bytes: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    load_s: float = 0.0
    store_s: float = 0.0


@dataclass
class KVTiers:
    """The secondary tiers of one KV pool, highest first (host, then disk), and the runner's
    block copies (``read_blocks``, ``write_blocks``)."""

    stores: Sequence[BlockStore]
    read_blocks: ReadBlocks
    clock: Callable[[], float] = time.perf_counter
    counters: dict[str, TierCounters] = field(default_factory=dict)
    # Restored blocks whose payloads the runner has not written yet: block -> payload.
    pending: dict[int, bytes] = field(default_factory=dict)
    write_s: float = 0.0  # seconds writing restored blocks into the pool (all tiers)
    # Loads off the engine thread (prefetch); None: restore() loads on the caller's thread.
    loader: ThreadPoolExecutor | None = None
    num_prefetched: int = 0  # loads started on the loader thread
    _loads: dict[BlockHash, Future[bytes | None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.stores:
            raise ValueError("KVTiers needs at least one tier (host or disk)")
        for s in self.stores:
            self.counters.setdefault(s.medium, TierCounters())

    # --- down: the pool evicts ----------------------------------------------------------------
    def evicted(self, block: int, block_hash: BlockHash,
                meta: BlockStored | None = None) -> None:
        """The pool evicted cached ``block`` (its content still intact): keep it in the top
        tier (unless a tier already holds it), with ``meta`` (its event in the pool, while
        events are recorded) for the tier's own KV event."""
        if any(s.contains(block_hash) for s in self.stores):
            self.pending.pop(block, None)
            return
        payload = self.pending.pop(block, None)
        t0 = self.clock()
        if payload is None:
            payload = self.read_blocks([block])[0]
        self._put(0, block_hash, payload, t0, meta)

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
                oldest = store.hashes()[0]
                old, old_meta = store.get(oldest), store.meta(oldest)
                store.discard(oldest)
                if old is not None and not self.stores[level + 1].contains(oldest):
                    self._put(level + 1, oldest, old, self.clock(), old_meta)
        if store.put(block_hash, payload, meta):
            c = self.counters[store.medium]
            c.stored_blocks += 1
            c.stored_bytes += len(payload)
            c.store_s += self.clock() - t0

    # --- up: a prefix hit continues into the tiers --------------------------------------------
    def num_hits(self, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes``, from the first, some tier holds."""
        n = 0
        for h in hashes:
            if not any(s.contains(h) for s in self.stores):
                break
            n += 1
        return n

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

    def _take(self, block_hash: BlockHash) -> bytes | None:
        """The payload prefetched for ``block_hash``, or loaded now."""
        load = self._loads.pop(block_hash, None)
        return load.result() if load is not None else self._load(block_hash)

    def restore(self, pool: BlockPool, hits: Sequence[int], hashes: Sequence[BlockHash],
                max_blocks: int, describe: Callable[[int], tuple] | None = None) -> int:
        """Load tier blocks for ``hashes`` (the request's block hashes right after its pool
        ``hits``), at most ``max_blocks``, into fresh pool blocks indexed under those hashes;
        returns how many. It stops at a block no tier holds, or a corrupt one (then
        recomputed). ``describe(i)``: the ``cache_block`` event fields of ``hashes[i]``
        (parent, token ids, salted, lora id)."""
        n = min(self.num_hits(hashes), max_blocks)
        if n <= 0:
            return 0
        # NOTE: the pool hits leave the free queue while this allocates, or it could evict
        # the very prefix it extends (and so they no longer count as free).
        live = [b for b in hits if b != BlockPool.NULL_BLOCK]
        pool.touch(live)
        try:
            n = min(n, pool.num_free_blocks)
            blocks = pool.allocate(n)
        finally:
            pool.free(live)
        if not blocks:
            return 0
        done = 0
        for i, block in enumerate(blocks):
            payload = self._take(hashes[i])
            if payload is None:
                break
            parent, token_ids, salted, lora_id = describe(i) if describe else (None, (), False,
                                                                                None)
            pool.cache_block(block, hashes[i], parent, token_ids, salted, lora_id)
            self.pending[block] = payload
            done += 1
        # Restored blocks go to the back of the free queue, cached, for the caller to take;
        # the ones not filled go back empty.
        pool.free(blocks)
        return done

    def _load(self, block_hash: BlockHash) -> bytes | None:
        for s in self.stores:
            if not s.contains(block_hash):
                continue
            t0 = self.clock()
            payload = s.get(block_hash)
            if payload is None:
                continue  # corrupt (dropped and counted by the store): a lower tier may have it
            c = self.counters[s.medium]
            c.hits += 1
            c.loaded_bytes += len(payload)
            c.load_s += self.clock() - t0
            return payload
        return None

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
    def persist(self, pool: BlockPool) -> int:
        """Keep what only the pool and the host tier hold in the bottom tier (the disk's, at
        shutdown: the next process finds it); returns how many blocks it wrote."""
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
        if self.loader is not None:
            self.loader.shutdown(wait=True, cancel_futures=True)
        self._loads.clear()
        for s in self.stores:
            s.close()

    def state(self) -> list[dict[str, Any]]:
        """Each tier's figures, top first (for the console and the metrics)."""
        out: list[dict[str, Any]] = []
        for s in self.stores:
            c = self.counters[s.medium]
            out.append({"medium": s.medium, "capacity_bytes": s.capacity_bytes,
                        "bytes": s.stats.bytes, "blocks": s.stats.blocks, "hits": c.hits,
                        "loaded_bytes": c.loaded_bytes, "stored_blocks": c.stored_blocks,
                        "stored_bytes": c.stored_bytes, "load_s": c.load_s,
                        "store_s": c.store_s, "corrupt": s.stats.corrupt,
                        "evictions": s.stats.evictions})
        return out
