"""Per-sequence block tables over a :class:`BlockPool`, the prefix cache, and a host swap pool.

The scheduler asks ``allocate_slots(request_id, num_tokens)`` before a step: make room for the
sequence to hold ``num_tokens`` tokens in total. The runner then writes token ``p`` of the
sequence at slot ``block_table[p // block_size] * block_size + p % block_size``.

Prefix caching: ``get_computed_blocks`` finds the longest run of cached full blocks matching a
new request's tokens; ``allocate_slots(..., computed_blocks=...)`` shares them; after each step
``cache_blocks`` indexes the blocks that became full. Swap: ``swap_out`` moves a sequence's
table to host blocks and ``swap_in`` back; the runner copies the data as the returned
``(from, to)`` pairs say (:mod:`kvflow.kv_manager.swap`).

Sliding window (``sliding_window=W``, every layer's): ``allocate_slots(...,
num_computed_tokens=c)`` first releases the sequence's blocks that hold only positions
``< c - W + 1``, which no query from ``c`` on can see (:mod:`kvflow.kv_manager.window`); their
table entries become the null block, so a table's null entries are always a prefix of it.
``release_outside_window`` does the same on its own. A released block is freed like any other
(a cached one stays findable by its hash); a prefix hit may start with null entries.

Fork (parallel sampling): ``fork(parent, child, num_tokens)`` starts the child's table with the
parent's blocks holding its first ``num_tokens`` tokens, shared by reference count. A shared
block is never written: ``allocate_slots`` first copies one the sequence is about to write into
a fresh block (copy on write), queueing the copy in ``pending_copies`` for the runner.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence

from kvflow.kv_manager import window as win
from kvflow.kv_manager.block_pool import BlockHash, BlockPool, hash_block
from kvflow.kv_manager.fragmentation import fragmentation
from kvflow.kv_manager.prompt_logprobs_cache import PromptLogprobsCache
from kvflow.kv_manager.spec import KVCacheSpec
from kvflow.kv_manager.swap import SwapMixin
from kvflow.kv_manager.tiers import KVTiers

__all__ = ["KVCacheManager", "KVCacheSpec"]

NULL_BLOCK = BlockPool.NULL_BLOCK


class KVCacheManager(SwapMixin):
    """Block tables of live sequences, allocated from one :class:`BlockPool`.

    Args:
        num_blocks: device pool size, the null block included.
        block_size: tokens per block, a power of two.
        enable_caching: index full blocks by content for reuse across requests.
        num_host_blocks: size of the host swap pool (0: no swapping).
        bytes_per_block: what one block costs to move (the scheduler's swap cost model).
        sliding_window: every layer's attention window in tokens (None: full attention);
            blocks wholly before the window of a sequence's next token are released.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 num_host_blocks: int = 0, bytes_per_block: int = 0,
                 sliding_window: int | None = None) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.block_size = block_size
        self.sliding_window = win.check_sliding_window(sliding_window)
        self.enable_caching = enable_caching
        self.bytes_per_block = bytes_per_block
        self.pool = BlockPool(num_blocks)
        # Prompt-logprob entries of cached blocks: a prompt asking for them reuses its prefix.
        cache = PromptLogprobsCache(block_size) if enable_caching else None
        self.prompt_logprobs, self.pool.on_evict = cache, None if cache is None else cache.drop
        self.block_tables: dict[Hashable, list[int]] = {}
        # Content hashes of each live sequence's full blocks, extended as it grows.
        self._hashes: dict[Hashable, list[BlockHash]] = {}
        # How many of a sequence's blocks are already indexed in the cache.
        self._num_cached: dict[Hashable, int] = {}
        self.host_pool = BlockPool(num_host_blocks + 1) if num_host_blocks > 0 else None
        self.host_tables: dict[Hashable, list[int]] = {}
        # Copy-on-write copies (src, dst) decided since the scheduler last took them.
        self.pending_copies: list[tuple[int, int]] = []
        self.tiers: KVTiers | None = None  # host / disk tiers below the pool (attach_tiers)

    def attach_tiers(self, tiers: KVTiers) -> None:
        """Keep the cached blocks the pool evicts in ``tiers``, for :meth:`restore_prefix`."""
        self.tiers, self.pool.on_evict_block = tiers, tiers.evicted

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_live_block(self, num_computed_tokens: int) -> int:
        """Index of the first block a query at ``num_computed_tokens`` or later can see (0
        without a window): the blocks before it are released, or may be."""
        if self.sliding_window is None:
            return 0
        return win.first_live_block(num_computed_tokens, self.sliding_window, self.block_size)

    def max_sequence_tokens(self, max_step_tokens: int) -> int:
        """The longest sequence the pool can ever hold resident when a step adds at most
        ``max_step_tokens`` tokens to it: the whole pool's tokens, or without bound
        (``sys.maxsize``) under a window whose working set fits the pool."""
        usable = self.pool.num_usable_blocks
        if self.sliding_window is not None and win.max_blocks_held(
                self.sliding_window, self.block_size, max_step_tokens) <= usable:
            return sys.maxsize
        return usable * self.block_size

    def max_blocks_per_sequence(self, max_step_tokens: int) -> int | None:
        """Under a window, the most blocks one sequence holds in a step of at most
        ``max_step_tokens`` tokens (:func:`~kvflow.kv_manager.window.max_blocks_held`);
        None without a window (its whole length)."""
        if self.sliding_window is None:
            return None
        return win.max_blocks_held(self.sliding_window, self.block_size, max_step_tokens)

    def num_new_blocks(self, request_id: Hashable, num_tokens: int) -> int:
        """Blocks that ``allocate_slots(request_id, num_tokens)`` would take from the pool."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, self.blocks_needed(num_tokens) - have)

    # --- prefix cache -------------------------------------------------------------------------
    def block_hashes(self, request_id: Hashable, token_ids: Sequence[int],
                     salt: bytes = b"") -> list[BlockHash]:
        """Hashes of the sequence's full blocks (computed once per block, then kept)."""
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), len(token_ids) // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, token_ids[i * bs:(i + 1) * bs], salt))
        return hashes

    def get_computed_blocks(self, request_id: Hashable, token_ids: Sequence[int],
                            salt: bytes = b"") -> tuple[list[int], int]:
        """The longest cached prefix of ``token_ids``: its blocks and its token count.

        At least one token is always left to compute, so that the step yields logits: a prompt
        cached whole gives back all but its last block. Under a window, the hit need only end
        with the cached blocks its next token's window reaches; its earlier entries are null
        (:func:`~kvflow.kv_manager.window.windowed_hit`).
        """
        if not self.enable_caching:
            return [], 0
        hashes = self.block_hashes(request_id, token_ids, salt)
        limit = (len(token_ids) - 1) // self.block_size
        if self.sliding_window is not None:
            hits = win.windowed_hit(self.pool.lookup, hashes, limit, self.sliding_window,
                                    self.block_size)
            return hits, len(hits) * self.block_size
        hits = []
        for h in hashes[:limit]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def prefetch_prefix(self, request_id: Hashable, token_ids: Sequence[int],
                        salt: bytes = b"") -> bool:
        """Start loading the tier blocks that lengthen its prefix hit; whether some still load."""
        tiers, (_, todo) = self.tiers, self._tier_hit(request_id, token_ids, salt)
        return tiers is not None and tiers.prefetch([self._hashes[request_id][i] for i in todo])

    def restore_prefix(self, request_id: Hashable, token_ids: Sequence[int], salt: bytes,
                       max_blocks: int, salted: bool = False, lora_id: int | None = None) -> int:
        """Load the tier blocks that lengthen the sequence's cached prefix into the pool, as
        cached blocks (:meth:`~kvflow.kv_manager.tiers.KVTiers.restore`); returns how many."""
        tiers, (keep, todo) = self.tiers, self._tier_hit(request_id, token_ids, salt)
        if tiers is None or not todo:
            return 0
        hashes, bs = self._hashes[request_id], self.block_size

        def describe(i: int) -> tuple:
            j = todo[i]
            return (hashes[j - 1] if j else None, token_ids[j * bs:(j + 1) * bs], salted,
                    lora_id)

        return tiers.restore(self.pool, keep, [hashes[j] for j in todo], max_blocks, describe,
                             whole=self.sliding_window is not None)

    def _tier_hit(self, request_id: Hashable, token_ids: Sequence[int],
                  salt: bytes) -> tuple[list[int], list[int]]:
        """:meth:`KVTiers.extend_hit` of the sequence's pool hit; none without tiers."""
        if self.tiers is None or not self.enable_caching:
            return [], []
        hits, _ = self.get_computed_blocks(request_id, token_ids, salt)
        hashes = self._hashes[request_id][:(len(token_ids) - 1) // self.block_size]
        return self.tiers.extend_hit(self.pool, hits, hashes, self.sliding_window, self.block_size)

    def trim_hit(self, hits: Sequence[int], num_blocks: int) -> list[int]:
        """A hit of :meth:`get_computed_blocks` cut to at most ``num_blocks`` blocks that is
        still valid (under a window, possibly none: :func:`~kvflow.kv_manager.window.trim_hit`)."""
        return win.trim_hit(hits, num_blocks, self.sliding_window, self.block_size)

    def cache_blocks(self, request_id: Hashable, token_ids: Sequence[int],
                     num_computed_tokens: int, salt: bytes = b"",
                     lora_id: int | None = None, salted: bool | None = None) -> None:
        """Index the sequence's blocks that are now full and computed. ``salt``: the hashes'
        extra keys (:func:`~kvflow.kv_manager.block_pool.block_extra`); ``lora_id`` and
        ``salted`` (whether a cache salt is among them; default: any extra key) describe the
        blocks in the KV events."""
        if not self.enable_caching:
            return
        full = min(num_computed_tokens, len(token_ids)) // self.block_size
        done = self._num_cached.get(request_id, 0)
        if full <= done:
            return
        hashes = self.block_hashes(request_id, token_ids[:full * self.block_size], salt)
        table = self.block_tables[request_id]
        if self.pool.events is None:
            for i in range(done, full):
                if table[i] != NULL_BLOCK:  # released past the window: nothing to index
                    self.pool.cache_block(table[i], hashes[i])
        else:  # the events carry each block's parent and tokens
            bs = self.block_size
            salted = bool(salt) if salted is None else salted
            for i in range(done, full):
                if table[i] != NULL_BLOCK:
                    self.pool.cache_block(table[i], hashes[i], hashes[i - 1] if i else None,
                                          token_ids[i * bs:(i + 1) * bs], salted, lora_id)
        self._num_cached[request_id] = full

    # --- allocation ---------------------------------------------------------------------------
    def allocate_slots(self, request_id: Hashable, num_tokens: int, reserve: int = 0,
                       computed_blocks: Sequence[int] = (),
                       num_computed_tokens: int | None = None) -> bool:
        """Grow the sequence's table to hold ``num_tokens`` tokens; all or nothing.

        ``computed_blocks`` (cache hits, for a sequence without a table yet) start the table,
        shared. ``num_computed_tokens``: where the sequence's writes start; a block from there
        on that is shared (a fork's) is first copied to a block of its own (copy on write).
        Returns False (and changes nothing else) when the pool would keep fewer than
        ``reserve`` free blocks.

        Under a window, the blocks no query from ``num_computed_tokens`` on can see are
        released first, even when it then returns False (they are dead either way), and the
        dead entries of ``computed_blocks`` start the table as null entries, untouched.
        """
        if self.sliding_window is not None:
            if num_computed_tokens is not None:
                self.release_outside_window(request_id, num_computed_tokens)
            if computed_blocks:
                first = self.first_live_block(len(computed_blocks) * self.block_size)
                computed_blocks = [NULL_BLOCK] * first + list(computed_blocks[first:])
        table = self.block_tables.get(request_id)
        have = len(table) if table is not None else 0
        need = -(-num_tokens // self.block_size) - have - len(computed_blocks)
        shared = self._shared_from(table, num_computed_tokens) if table else []
        if need <= 0 and not computed_blocks and not shared:
            return True  # the common decode step: the block has room and is the sequence's own
        # Cache hits sitting on the free queue stop being free once shared.
        revived = sum(1 for b in computed_blocks
                      if b != NULL_BLOCK and self.pool.ref_counts[b] == 0)
        if max(need, 0) + len(shared) + revived + reserve > self.pool.num_free_blocks:
            return False
        if table is None:
            table = self.block_tables[request_id] = []
        if computed_blocks:
            assert not table, "computed blocks can only start a table"
            self.pool.touch(b for b in computed_blocks if b != NULL_BLOCK)
            table.extend(computed_blocks)
            self._num_cached[request_id] = len(computed_blocks)
        if shared:
            for i, dst in zip(shared, self.pool.allocate(len(shared)), strict=True):
                self.pending_copies.append((table[i], dst))
                self.pool.free([table[i]])  # still referenced by the other sharers
                table[i] = dst
            self._num_cached[request_id] = min(self._num_cached.get(request_id, 0), shared[0])
        if need > 0:
            table.extend(self.pool.allocate(need))
        return True

    def release_outside_window(self, request_id: Hashable, num_computed_tokens: int) -> int:
        """Release the sequence's blocks that hold only positions before the window of its
        next token (``< num_computed_tokens - sliding_window + 1``): their entries become the
        null block and each gives up the sequence's reference (a cached block stays findable
        by its hash). Returns how many it released; 0 without a window or a table."""
        table = self.block_tables.get(request_id)
        if self.sliding_window is None or not table:
            return 0
        released = []
        # NOTE: from the last dead block back, stopping at a null one: the ones before it went
        # in an earlier call. Freed tail first, as free() does: the oldest is evicted last.
        for i in range(min(self.first_live_block(num_computed_tokens), len(table)) - 1, -1, -1):
            if table[i] == NULL_BLOCK:
                break
            released.append(table[i])
            table[i] = NULL_BLOCK
        self.pool.free(released)
        return len(released)

    def _shared_from(self, table: list[int], num_computed_tokens: int | None) -> list[int]:
        """Indexes of the table's blocks at or past the write position that must not be
        written: shared ones, and ones the prefix cache indexes (a fork member can hold a
        block its leader filled and cached with the leader's own output)."""
        if num_computed_tokens is None:
            return []
        first = num_computed_tokens // self.block_size
        refs, hashes = self.pool.ref_counts, self.pool.block_hashes
        return [i for i in range(first, len(table)) if table[i] != NULL_BLOCK
                and (refs[table[i]] > 1 or hashes[table[i]] is not None)]

    def fork(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> None:
        """Start ``child_id``'s table with ``parent_id``'s blocks holding its first
        ``num_tokens`` tokens, shared (one more reference each); the child has no table yet.
        The parent's null entries (released past its window) are the child's too: the child's
        window from ``num_tokens`` on must not reach them."""
        assert child_id not in self.block_tables, f"{child_id!r} already has blocks"
        n = self.blocks_needed(num_tokens)
        blocks = self.block_tables[parent_id][:n]
        assert len(blocks) == n, f"{parent_id!r} holds fewer than {num_tokens} tokens"
        assert all(blocks[self.first_live_block(num_tokens):]), (
            f"{parent_id!r} released blocks that {child_id!r} at {num_tokens} tokens still sees")
        self.pool.touch(b for b in blocks if b != NULL_BLOCK)
        self.block_tables[child_id] = list(blocks)
        full = num_tokens // self.block_size
        if parent_id in self._hashes:
            self._hashes[child_id] = self._hashes[parent_id][:full]
        self._num_cached[child_id] = min(self._num_cached.get(parent_id, 0), full)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies queued since the last call (the runner makes them)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, request_id: Hashable, forget: bool = True) -> int:
        """Release a sequence's device blocks (no-op for an unknown id); returns how many
        (its null entries are not blocks it holds).

        ``forget=False`` keeps its block hashes (a preempted sequence that will come back).
        """
        table = self.block_tables.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if forget:
            self._hashes.pop(request_id, None)
            if request_id in self.host_tables and self.host_pool is not None:
                self.host_pool.free(b for b in self.host_tables.pop(request_id)
                                    if b != NULL_BLOCK)
        if not table:
            return 0
        # Free the tail first: it goes to the front of the eviction queue, the shared prefix last.
        held = [b for b in reversed(table) if b != NULL_BLOCK]
        self.pool.free(held)
        if self.pending_copies:  # a copy into a block now dropped would race its next owner's
            refs = self.pool.ref_counts
            self.pending_copies = [(s, d) for s, d in self.pending_copies if refs[d] > 0]
        return len(held)

    # --- lookups ------------------------------------------------------------------------------
    def get_block_table(self, request_id: Hashable) -> list[int]:
        return self.block_tables[request_id]

    def slot(self, request_id: Hashable, position: int) -> int:
        """The pool slot of token ``position`` of a sequence."""
        block = self.block_tables[request_id][position // self.block_size]
        return block * self.block_size + position % self.block_size

    def fragmentation(self, filled: Sequence[tuple[Hashable, int]]) -> float:
        """Fraction of the slots in used device blocks that hold no token
        (:func:`~kvflow.kv_manager.fragmentation.fragmentation`)."""
        return fragmentation(self, filled)

    def check_integrity(self) -> None:
        """Pools consistent; every reference count equals the block's table occurrences; a
        table's null entries (released past the window) lead it, and only under a window."""
        self.pool.check_integrity()
        if self.prompt_logprobs is not None:
            self.prompt_logprobs.check_integrity()
        counts = self._table_counts(self.block_tables, self.pool.num_blocks)
        assert counts == self.pool.ref_counts, "reference counts do not match the block tables"
        if self.host_pool is not None:
            self.host_pool.check_integrity()
            host_counts = self._table_counts(self.host_tables, self.host_pool.num_blocks)
            assert host_counts == self.host_pool.ref_counts, "host pool references mismatch"
            assert not self.host_pool.cached, "host blocks are never content-indexed"
        else:
            assert not self.host_tables
        assert not set(self.host_tables) & set(self.block_tables), \
            "a sequence is both swapped out and resident"

    def _table_counts(self, tables: dict[Hashable, list[int]], num_blocks: int) -> list[int]:
        """Each block's occurrences in ``tables`` (the null block's: 0), checking that null
        entries lead each table and appear only under a window."""
        counts = [0] * num_blocks
        for request_id, table in tables.items():
            num_null = 0
            while num_null < len(table) and table[num_null] == NULL_BLOCK:
                num_null += 1
            assert NULL_BLOCK not in table[num_null:], \
                f"{request_id!r}: a null entry after a real block: {table}"
            assert num_null == 0 or self.sliding_window is not None, \
                f"{request_id!r}: null entries without a sliding window: {table}"
            for b in table[num_null:]:
                counts[b] += 1
        return counts
