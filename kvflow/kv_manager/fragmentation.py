"""How much of the used KV pool holds no token: :func:`fragmentation`. Pure Python."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.kv_manager.kv_cache_manager import KVCacheManager


def fragmentation(kv: KVCacheManager, filled: Sequence[tuple[Hashable, int]]) -> float:
    """Fraction of the slots in used device blocks that hold no token (0 when none is
    used): the tail of each sequence's last block, and blocks allocated ahead of its
    tokens. ``filled``: (sequence, tokens whose KV is in its blocks) for the sequences
    holding blocks; a block shared by several sequences counts once, as filled as its
    fullest holder has it. A used block no sequence listed counts as full."""
    used = kv.pool.num_used_blocks
    if used == 0:
        return 0.0
    bs, tables, refs = kv.block_size, kv.block_tables, kv.pool.ref_counts
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
            if table[i] == 0:  # the null block (released past a window) is no used block
                continue
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
