"""Sliding-window arithmetic: which blocks of a windowed sequence no query can see again.

With a window of ``W`` tokens (every layer's, as Mistral's), a query at position ``p`` attends
keys at positions ``p - W < j <= p``. Once a sequence has ``c`` computed tokens, every query
from now on is at ``p >= c``, so a block whose positions are all ``< c - W + 1`` is dead: the
:class:`~kvflow.kv_manager.kv_cache_manager.KVCacheManager` releases it (its table entry becomes
the null block, block 0) and the attention kernels never read such an entry. Dead blocks are
always a prefix of the table, so the null entries of a table are a prefix too.

A prefix-cache hit of ``L`` blocks is valid when the blocks the first new token's window
reaches (the last :func:`hit_run_blocks` of them) are cached: the hash of a block chains its
whole prefix, so the earlier ones need not be. :func:`windowed_hit` finds the longest such
hit, as vLLM's ``SlidingWindowManager.find_longest_cache_hit`` does. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvflow.kv_manager.block_pool import BlockHash, BlockPool

NULL_BLOCK = BlockPool.NULL_BLOCK


def check_sliding_window(sliding_window: int | None) -> int | None:
    """``sliding_window`` validated: None (full attention) or a positive token count."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) \
            or sliding_window < 1:
        raise ValueError(f"sliding_window must be None or a positive integer (tokens), "
                         f"got {sliding_window!r}")
    return sliding_window


def first_live_block(num_computed_tokens: int, window: int, block_size: int) -> int:
    """Index of a sequence's first block that a query at ``num_computed_tokens`` or later can
    see; every block before it holds only positions ``< num_computed_tokens - window + 1``."""
    return max(0, num_computed_tokens - window + 1) // block_size


def hit_run_blocks(window: int, block_size: int) -> int:
    """Cached blocks a windowed prefix hit must end with: those the window of the first token
    after the hit reaches back into, ``ceil((window - 1) / block_size)`` (at least one, so that
    a hit always holds a real block)."""
    return max(1, -(-(window - 1) // block_size))


def max_blocks_held(window: int, block_size: int, step_tokens: int) -> int:
    """The most blocks a windowed sequence holds once its dead ones are released, in a step
    that adds up to ``step_tokens`` tokens: the window's reach behind the first new token and
    the step's tokens, ``ceil((window - 1 + step_tokens) / block_size)``, plus one for a
    window that starts mid-block."""
    return -(-(window - 1 + step_tokens) // block_size) + 1


def windowed_hit(lookup: Callable[[BlockHash], int | None], hashes: Sequence[BlockHash],
                 limit: int, window: int, block_size: int) -> list[int]:
    """The longest valid prefix-cache hit of at most ``limit`` blocks, under a window.

    Scans from the last candidate block back for a run of :func:`hit_run_blocks` cached
    blocks; the hit ends with that run and its earlier blocks are null (dead for the request
    anyway, so they need not be cached). Without such a run, a run of cached blocks from
    block 0 is a hit too (the whole prefix is there). ``lookup`` maps a hash to its cached
    block, or None.
    """
    run = hit_run_blocks(window, block_size)
    found: dict[int, int] = {}
    streak = 0
    for i in range(min(limit, len(hashes)) - 1, -1, -1):
        block = lookup(hashes[i])
        if block is None:
            streak = 0
            continue
        found[i] = block
        streak += 1
        if streak >= run:
            return [NULL_BLOCK] * i + [found[j] for j in range(i, i + run)]
    # The loop ended at block 0: ``streak`` cached blocks lead the sequence.
    return [found[j] for j in range(streak)]


def trim_hit(hits: Sequence[int], num_blocks: int, window: int | None,
             block_size: int) -> list[int]:
    """``hits`` cut to at most ``num_blocks`` blocks, still a valid hit: under a window, a cut
    that would leave a null block inside the window of the first token after it gives no hit
    (its null entries lead it, and a shorter cut reaches them too)."""
    cut = list(hits[:num_blocks])
    if window is None or not cut:
        return cut
    first = first_live_block(len(cut) * block_size, window, block_size)
    return cut if all(cut[first:]) else []
