"""Per-sequence block tables over a :class:`BlockPool`, the prefix cache, and a host swap pool.

The scheduler asks ``allocate_slots(request_id, num_tokens)`` before a step: make room for the
sequence to hold ``num_tokens`` tokens in total. The runner then writes token ``p`` of the
sequence at slot ``block_table[p // block_size] * block_size + p % block_size``.

Prefix caching: ``get_computed_blocks`` finds the longest run of cached full blocks matching a
new request's tokens; ``allocate_slots(..., computed_blocks=...)`` shares them; after each step
``cache_blocks`` indexes the blocks that became full. Swap: ``swap_out`` moves a sequence's
table to host blocks and ``swap_in`` back; the runner copies the data as the returned
``(from, to)`` pairs say.

Fork (parallel sampling): ``fork(parent, child, num_tokens)`` starts the child's table with the
parent's blocks holding its first ``num_tokens`` tokens, shared by reference count. A shared
block is never written: ``allocate_slots`` copies a shared block the sequence is about to write
into a fresh one first (copy on write), and queues the ``(src, dst)`` copy in
``pending_copies`` for the runner to make before the step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kvflow.kv_manager.block_pool import BlockHash, BlockPool, hash_block
from kvflow.kv_manager.prompt_logprobs_cache import PromptLogprobsCache


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV layout of a model: what one block costs.

    One block holds ``block_size`` tokens of K and V for every layer:
    ``2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes`` bytes.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def bytes_per_block(self) -> int:
        return (2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
                * self.dtype_bytes)

    def num_blocks_for_bytes(self, kv_bytes: int) -> int:
        """Blocks (the null block included) that fit in a budget of ``kv_bytes``."""
        n = kv_bytes // self.bytes_per_block
        if n < 2:
            raise ValueError(
                f"kv_cache_bytes {kv_bytes} holds {n} blocks of {self.bytes_per_block} bytes; "
                "at least 2 are needed"
            )
        return int(n)


class KVCacheManager:
    """Block tables of live sequences, allocated from one :class:`BlockPool`.

    Args:
        num_blocks: device pool size, the null block included.
        block_size: tokens per block, a power of two.
        enable_caching: index full blocks by content for reuse across requests.
        num_host_blocks: size of the host swap pool (0: no swapping).
        bytes_per_block: what one block costs to move (the scheduler's swap cost model).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 num_host_blocks: int = 0, bytes_per_block: int = 0) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.block_size = block_size
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

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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
        cached whole gives back all but its last block.
        """
        if not self.enable_caching:
            return [], 0
        hashes = self.block_hashes(request_id, token_ids, salt)
        limit = (len(token_ids) - 1) // self.block_size
        hits = []
        for h in hashes[:limit]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def cache_blocks(self, request_id: Hashable, token_ids: Sequence[int],
                     num_computed_tokens: int, salt: bytes = b"") -> None:
        """Index the sequence's blocks that are now full and computed."""
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
                self.pool.cache_block(table[i], hashes[i])
        else:  # the events carry each block's parent and tokens
            bs = self.block_size
            for i in range(done, full):
                self.pool.cache_block(table[i], hashes[i], hashes[i - 1] if i else None,
                                      token_ids[i * bs:(i + 1) * bs], bool(salt))
        self._num_cached[request_id] = full

    # --- allocation ---------------------------------------------------------------------------
    def allocate_slots(self, request_id: Hashable, num_tokens: int, reserve: int = 0,
                       computed_blocks: Sequence[int] = (),
                       num_computed_tokens: int | None = None) -> bool:
        """Grow the sequence's table to hold ``num_tokens`` tokens; all or nothing.

        ``computed_blocks`` (cache hits, for a sequence without a table yet) start the table,
        shared. ``num_computed_tokens``: where the sequence's writes start; a block from there
        on that is shared (a fork's) is first copied to a block of its own (copy on write).
        Returns False (and changes nothing) when the pool would keep fewer than ``reserve``
        free blocks.
        """
        table = self.block_tables.get(request_id)
        have = len(table) if table is not None else 0
        need = -(-num_tokens // self.block_size) - have - len(computed_blocks)
        shared = self._shared_from(table, num_computed_tokens) if table else []
        if need <= 0 and not computed_blocks and not shared:
            return True  # the common decode step: the block has room and is the sequence's own
        # Cache hits sitting on the free queue stop being free once shared.
        revived = sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)
        if max(need, 0) + len(shared) + revived + reserve > self.pool.num_free_blocks:
            return False
        if table is None:
            table = self.block_tables[request_id] = []
        if computed_blocks:
            assert not table, "computed blocks can only start a table"
            self.pool.touch(computed_blocks)
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

    def _shared_from(self, table: list[int], num_computed_tokens: int | None) -> list[int]:
        """Indexes of the table's blocks at or past the write position that must not be
        written: shared ones, and ones the prefix cache indexes (a fork member can hold a
        block its leader filled and cached with the leader's own output)."""
        if num_computed_tokens is None:
            return []
        first = num_computed_tokens // self.block_size
        refs, hashes = self.pool.ref_counts, self.pool.block_hashes
        return [i for i in range(first, len(table))
                if refs[table[i]] > 1 or hashes[table[i]] is not None]

    def fork(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> None:
        """Start ``child_id``'s table with ``parent_id``'s blocks holding its first
        ``num_tokens`` tokens, shared (one more reference each); the child has no table yet."""
        assert child_id not in self.block_tables, f"{child_id!r} already has blocks"
        n = self.blocks_needed(num_tokens)
        blocks = self.block_tables[parent_id][:n]
        assert len(blocks) == n, f"{parent_id!r} holds fewer than {num_tokens} tokens"
        self.pool.touch(blocks)
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
        """Release a sequence's device blocks (no-op for an unknown id); returns how many.

        ``forget=False`` keeps its block hashes (a preempted sequence that will come back).
        """
        table = self.block_tables.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if forget:
            self._hashes.pop(request_id, None)
            if request_id in self.host_tables and self.host_pool is not None:
                self.host_pool.free(self.host_tables.pop(request_id))
        if not table:
            return 0
        # Free the tail first: it goes to the front of the eviction queue, the shared prefix last.
        self.pool.free(reversed(table))
        if self.pending_copies:  # a copy into a block now dropped would race its next owner's
            refs = self.pool.ref_counts
            self.pending_copies = [(s, d) for s, d in self.pending_copies if refs[d] > 0]
        return len(table)

    # --- swap ---------------------------------------------------------------------------------
    def can_swap_out(self, request_id: Hashable, num_tokens: int) -> bool:
        return self.can_swap_out_many([(request_id, num_tokens)])

    def can_swap_out_many(self, items: Sequence[tuple[Hashable, int]]) -> bool:
        """Whether the host pool has room for these sequences' blocks (shared ones once)."""
        return (self.host_pool is not None
                and len(self.distinct_blocks(items)) <= self.host_pool.num_free_blocks)

    def distinct_blocks(self, items: Sequence[tuple[Hashable, int]]) -> dict[int, None]:
        """The device blocks holding these sequences' first tokens, each once, in order."""
        blocks: dict[int, None] = {}
        for request_id, num_tokens in items:
            blocks.update(dict.fromkeys(
                self.block_tables[request_id][:self.blocks_needed(num_tokens)]))
        return blocks

    def swap_out(self, request_id: Hashable, num_tokens: int) -> list[tuple[int, int]]:
        """Move the blocks holding the first ``num_tokens`` tokens to host blocks.

        Frees the device table; returns ``(device_block, host_block)`` copies to make before the
        freed device blocks are written again.
        """
        return self.swap_out_many([(request_id, num_tokens)])

    def swap_out_many(self, items: Sequence[tuple[Hashable, int]]) -> list[tuple[int, int]]:
        """:meth:`swap_out` of several sequences together (a forked group): a block they
        share is copied once, to one host block they share."""
        assert self.host_pool is not None
        distinct = list(self.distinct_blocks(items))
        to_host = dict(zip(distinct, self.host_pool.allocate(len(distinct)), strict=True))
        taken: set[int] = set()
        for request_id, num_tokens in items:
            host = [to_host[b] for b in
                    self.block_tables[request_id][:self.blocks_needed(num_tokens)]]
            self.host_pool.touch(b for b in host if b in taken)
            taken.update(host)
            self.host_tables[request_id] = host
            self.free(request_id, forget=False)
        return list(to_host.items())

    def swap_in(self, request_id: Hashable, num_tokens: int,
                reserve: int = 0) -> list[tuple[int, int]] | None:
        """Bring a swapped sequence back with room for ``num_tokens``; None if it cannot fit.

        Returns ``(host_block, device_block)`` copies to make before the step runs.
        """
        return self.swap_in_many([(request_id, num_tokens)], reserve)

    def swap_in_many(self, items: Sequence[tuple[Hashable, int]],
                     reserve: int = 0) -> list[tuple[int, int]] | None:
        """:meth:`swap_in` of several sequences together, all or none: a host block they share
        comes back as one device block they share."""
        assert self.host_pool is not None
        distinct: dict[int, None] = {}
        extra = 0
        for request_id, num_tokens in items:
            host = self.host_tables[request_id]
            distinct.update(dict.fromkeys(host))
            extra += max(0, self.blocks_needed(num_tokens) - len(host))
        if len(distinct) + extra + reserve > self.pool.num_free_blocks:
            return None
        to_device = dict(zip(distinct, self.pool.allocate(len(distinct)), strict=True))
        taken: set[int] = set()
        for request_id, num_tokens in items:
            host = self.host_tables.pop(request_id)
            table = [to_device[b] for b in host]
            self.pool.touch(b for b in table if b in taken)
            taken.update(table)
            table.extend(self.pool.allocate(max(0, self.blocks_needed(num_tokens) - len(host))))
            self.block_tables[request_id] = table
            self.host_pool.free(host)
        return list(to_device.items())

    def is_swapped(self, request_id: Hashable) -> bool:
        return request_id in self.host_tables

    # --- lookups ------------------------------------------------------------------------------
    def get_block_table(self, request_id: Hashable) -> list[int]:
        return self.block_tables[request_id]

    def slot(self, request_id: Hashable, position: int) -> int:
        """The pool slot of token ``position`` of a sequence."""
        block = self.block_tables[request_id][position // self.block_size]
        return block * self.block_size + position % self.block_size

    def fragmentation(self, filled: Sequence[tuple[Hashable, int]]) -> float:
        """Fraction of the slots in used device blocks that hold no token (0 when none is
        used): the tail of each sequence's last block, and blocks allocated ahead of its
        tokens. ``filled``: (sequence, tokens whose KV is in its blocks) for the sequences
        holding blocks; a block shared by several sequences counts once, as filled as its
        fullest holder has it. A used block no sequence listed counts as full."""
        used = self.pool.num_used_blocks
        if used == 0:
            return 0.0
        bs, tables, refs = self.block_size, self.block_tables, self.pool.ref_counts
        unfilled = 0
        holders: list[tuple[list[int], int]] = []  # the rare ones: shared or ahead blocks
        for request_id, num_tokens in filled:
            table = tables.get(request_id)
            if not table:
                continue
            n = len(table)
            if num_tokens // bs >= n - 1 and refs[table[-1]] == 1:
                # NOTE: the common case, O(1): the last block alone is unfilled, and its own.
                unfilled += max(n * bs - num_tokens, 0)
            else:
                holders.append((table, num_tokens))
        partial: dict[int, int] = {}  # block -> filled slots, for the blocks past full ones
        for table, num_tokens in holders:
            for i in range(min(num_tokens // bs, len(table)), len(table)):
                k = min(max(num_tokens - i * bs, 0), bs)
                partial[table[i]] = max(partial.get(table[i], 0), k)
        # NOTE: only the blocks past each holder's full ones are visited (one or two each),
        # so a shared block (a fork's) may be full in another holder's table: look it up.
        shared = {b for b in partial if refs[b] > 1}
        if shared:
            for request_id, num_tokens in filled:
                table = tables.get(request_id) or []
                for i in range(min(num_tokens // bs, len(table))):
                    if table[i] in shared:
                        partial[table[i]] = bs
        unfilled += sum(bs - k for k in partial.values())
        return unfilled / (used * bs)

    def check_integrity(self) -> None:
        """Pools consistent; every reference count equals the block's table occurrences."""
        self.pool.check_integrity()
        if self.prompt_logprobs is not None:
            self.prompt_logprobs.check_integrity()
        counts = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for b in table:
                counts[b] += 1
        assert counts == self.pool.ref_counts, "reference counts do not match the block tables"
        if self.host_pool is not None:
            self.host_pool.check_integrity()
            host_counts = [0] * self.host_pool.num_blocks
            for table in self.host_tables.values():
                for b in table:
                    host_counts[b] += 1
            assert host_counts == self.host_pool.ref_counts, "host pool references mismatch"
            assert not self.host_pool.cached, "host blocks are never content-indexed"
        else:
            assert not self.host_tables
        assert not set(self.host_tables) & set(self.block_tables), \
            "a sequence is both swapped out and resident"
