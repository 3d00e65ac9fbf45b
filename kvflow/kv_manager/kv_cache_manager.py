"""Per-sequence block tables over a :class:`BlockPool`. Pure Python.

The scheduler asks ``allocate_slots(request_id, num_tokens)`` before a step: make room for the
sequence to hold ``num_tokens`` tokens in total. The runner then writes token ``p`` of the
sequence at slot ``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from kvflow.kv_manager.block_pool import BlockPool


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
    """Block tables of live sequences, allocated from one :class:`BlockPool`."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[Hashable, list[int]] = {}

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

    def can_allocate(self, request_id: Hashable, num_tokens: int, reserve: int = 0) -> bool:
        """Would the allocation succeed while leaving ``reserve`` blocks free?"""
        return self.num_new_blocks(request_id, num_tokens) + reserve <= self.pool.num_free_blocks

    def allocate_slots(self, request_id: Hashable, num_tokens: int, reserve: int = 0) -> bool:
        """Grow the sequence's table to hold ``num_tokens`` tokens; all or nothing.

        Returns False (and allocates nothing) when the pool would keep fewer than ``reserve``
        free blocks.
        """
        table = self.block_tables.get(request_id)
        have = len(table) if table is not None else 0
        need = -(-num_tokens // self.block_size) - have
        if need <= 0:  # the common decode step: the last block still has room
            return True
        if need + reserve > self.pool.num_free_blocks:
            return False
        if table is None:
            table = self.block_tables[request_id] = []
        table.extend(self.pool.allocate(need))
        return True

    def free(self, request_id: Hashable) -> int:
        """Release a sequence's blocks (no-op for an unknown id); returns how many it held."""
        table = self.block_tables.pop(request_id, None)
        if not table:
            return 0
        # Free in reverse so that the tail (least likely to be shared) is reused first.
        self.pool.free(reversed(table))
        return len(table)

    def get_block_table(self, request_id: Hashable) -> list[int]:
        return self.block_tables[request_id]

    def slot(self, request_id: Hashable, position: int) -> int:
        """The pool slot of token ``position`` of a sequence."""
        block = self.block_tables[request_id][position // self.block_size]
        return block * self.block_size + position % self.block_size

    def check_integrity(self) -> None:
        """Pool consistent, and every reference count equals the block's table occurrences."""
        self.pool.check_integrity()
        counts = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for b in table:
                counts[b] += 1
        assert counts == self.pool.ref_counts, "reference counts do not match the block tables"
