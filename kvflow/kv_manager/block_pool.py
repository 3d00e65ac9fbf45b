"""The block pool: fixed-size KV blocks, a free list and reference counts. Pure Python.

Block ids are integers ``0 .. num_blocks-1``. Block 0 is the null block: block tables are padded
with it, it is never handed out, and nothing meaningful is ever written to or read from it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """The pool cannot hand out the blocks asked for."""


class BlockPool:
    """Free list and reference counts of ``num_blocks`` KV blocks (block 0 reserved).

    ``allocate`` takes blocks from the front of the free list; ``free`` drops one reference per
    block and returns blocks whose count reaches zero to the back, so recently freed blocks are
    reused last.
    """

    NULL_BLOCK = 0

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (one is the reserved null block), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be allocated (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_usable_blocks

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks with a reference count of one each."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        """Share blocks that are already in use (e.g. a cached prefix)."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} is free; only used blocks can be shared")
            self.ref_counts[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference per block; blocks reaching zero go back to the free list."""
        for b in blocks:
            if b == self.NULL_BLOCK:
                raise ValueError("the null block is never allocated and cannot be freed")
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed more often than it was allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + used == usable and the free list is consistent."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert self.NULL_BLOCK not in free, "the null block is on the free list"
        assert self.ref_counts[self.NULL_BLOCK] == 0, "the null block has references"
        for b in range(1, self.num_blocks):
            in_use = self.ref_counts[b] > 0
            assert self.ref_counts[b] >= 0, f"block {b} has a negative reference count"
            assert in_use != (b in free), f"block {b}: ref count {self.ref_counts[b]} but " \
                f"{'on' if b in free else 'off'} the free list"
