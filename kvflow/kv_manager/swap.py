"""Preemption by swap: a sequence's device blocks to the host swap pool and back. Pure Python.

:class:`SwapMixin` is the swap half of
:class:`~kvflow.kv_manager.kv_cache_manager.KVCacheManager`. Only a sequence's live blocks
move: a null table entry (a block released past a sliding window, or never needed) becomes the
host pool's null entry and comes back as the device's, and a block dead at the swapped token
count is released rather than copied.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from kvflow.kv_manager.block_pool import BlockPool

NULL_BLOCK = BlockPool.NULL_BLOCK


class SwapMixin:
    """``swap_out`` / ``swap_in`` (and their group forms) over ``host_pool``: the manager's
    device pool, block tables and host tables."""

    pool: BlockPool
    host_pool: BlockPool | None
    block_tables: dict[Hashable, list[int]]
    host_tables: dict[Hashable, list[int]]

    if TYPE_CHECKING:
        def blocks_needed(self, num_tokens: int) -> int: ...
        def first_live_block(self, num_computed_tokens: int) -> int: ...
        def free(self, request_id: Hashable, forget: bool = True) -> int: ...

    def can_swap_out(self, request_id: Hashable, num_tokens: int) -> bool:
        return self.can_swap_out_many([(request_id, num_tokens)])

    def can_swap_out_many(self, items: Sequence[tuple[Hashable, int]]) -> bool:
        """Whether the host pool has room for these sequences' blocks (shared ones once)."""
        return (self.host_pool is not None
                and len(self.distinct_blocks(items)) <= self.host_pool.num_free_blocks)

    def distinct_blocks(self, items: Sequence[tuple[Hashable, int]]) -> dict[int, None]:
        """The device blocks holding these sequences' first tokens, each once, in order: those
        a query after them can still see (no null entry, no block dead past a window)."""
        blocks: dict[int, None] = {}
        for request_id, num_tokens in items:
            table = self.block_tables[request_id]
            live = table[self.first_live_block(num_tokens):self.blocks_needed(num_tokens)]
            blocks.update(dict.fromkeys(b for b in live if b != NULL_BLOCK))
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
            first = self.first_live_block(num_tokens)
            table = self.block_tables[request_id][:self.blocks_needed(num_tokens)]
            # A dead block (a sibling may still see it) stays behind: a null entry here.
            host = [to_host[b] if i >= first and b != NULL_BLOCK else NULL_BLOCK
                    for i, b in enumerate(table)]
            self.host_pool.touch(b for b in host if b in taken)
            taken.update(b for b in host if b != NULL_BLOCK)
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
            distinct.update(dict.fromkeys(b for b in host if b != NULL_BLOCK))
            extra += max(0, self.blocks_needed(num_tokens) - len(host))
        if len(distinct) + extra + reserve > self.pool.num_free_blocks:
            return None
        to_device = dict(zip(distinct, self.pool.allocate(len(distinct)), strict=True))
        to_device[NULL_BLOCK] = NULL_BLOCK
        taken: set[int] = set()
        for request_id, num_tokens in items:
            host = self.host_tables.pop(request_id)
            table = [to_device[b] for b in host]
            self.pool.touch(b for b in table if b in taken)
            taken.update(b for b in table if b != NULL_BLOCK)
            table.extend(self.pool.allocate(max(0, self.blocks_needed(num_tokens) - len(host))))
            self.block_tables[request_id] = table
            self.host_pool.free(b for b in host if b != NULL_BLOCK)
        del to_device[NULL_BLOCK]
        return list(to_device.items())

    def is_swapped(self, request_id: Hashable) -> bool:
        return request_id in self.host_tables
