"""Prompt logprobs of cached blocks, so that a prompt that asks for them reuses its cached
prefix like any other. Pure Python.

A cached block holds KV, not logits, so a request asking for prompt logprobs used to compute
its prompt whole, cache or not. This cache keeps, beside the prefix cache, the entries that
each cached block's logits gave: entry ``p`` is prompt token ``p``'s logprob and the top ``k``
from the logits of position ``p - 1``, so block ``i`` (positions ``i*bs .. (i+1)*bs - 1``)
gives entries ``i*bs + 1 .. (i+1)*bs``. They depend on the block's whole prefix (its chained
hash) and, for the last, on the prompt token after the block; hence the key
``(block hash, k, next token)``. A request whose cached prefix has entries for every block
then starts after it, as any cache hit does, and takes the stored entries for those positions.

Bounded: at most ``max_items`` token entries in all (an entry of ``k`` is up to ``k + 1``
items), least recently used out first; and an entry goes with its block when the pool evicts
the block (:meth:`PromptLogprobsCache.drop`, the pool's eviction hook). Entries are shared with
the outputs that carry them, and never modified.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvflow.kv_manager.block_pool import BlockHash

Entry = dict[int, float]
Key = tuple[BlockHash, int, int]  # (block hash, k, the prompt token after the block)
# About 20-40 MB of Python dicts at most.
DEFAULT_MAX_ITEMS = 200_000


class PromptLogprobsCache:
    """The prompt-logprob entries of cached full blocks of ``block_size`` tokens, keyed by
    ``(block hash, k, next token)``, bounded by ``max_items`` token entries (least recently
    used out first)."""

    def __init__(self, block_size: int, max_items: int = DEFAULT_MAX_ITEMS) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        self.block_size = block_size
        self.max_items = max_items
        self.num_items = 0
        self._entries: OrderedDict[Key, tuple[Entry, ...]] = OrderedDict()
        self._keys_of: dict[BlockHash, set[Key]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    # --- a prompt's blocks ----------------------------------------------------------------------
    def num_usable(self, hashes: Sequence[BlockHash], prompt: Sequence[int], k: int,
                   num_blocks: int) -> int:
        """How many of the prompt's first ``num_blocks`` blocks (cache hits, whose ``hashes``
        are given) have entries for ``k``: the prefix a request asking for prompt logprobs
        may take."""
        bs = self.block_size
        for i in range(num_blocks):
            if (hashes[i], k, prompt[(i + 1) * bs]) not in self._entries:
                return i
        return num_blocks

    def entries_of(self, hashes: Sequence[BlockHash], prompt: Sequence[int], k: int,
                   num_blocks: int) -> list[Entry]:
        """The entries of prompt positions ``1 .. num_blocks * block_size`` (every block's
        must be kept: :meth:`num_usable`)."""
        bs = self.block_size
        out: list[Entry] = []
        for i in range(num_blocks):
            entries = self.get(hashes[i], k, prompt[(i + 1) * bs])
            assert entries is not None, f"block {i}'s prompt logprobs are not kept"
            out.extend(entries)
        return out

    def store(self, hashes: Sequence[BlockHash], prompt: Sequence[int], k: int,
              entries: Sequence[Entry | None], blocks: range) -> None:
        """Keep the entries of the prompt's ``blocks`` (``entries``: per prompt position, the
        first None) whose every entry is computed and that lie before the prompt's end."""
        bs = self.block_size
        for i in blocks:
            end = (i + 1) * bs
            if i >= len(hashes) or end >= len(entries):
                break
            block = entries[i * bs + 1:end + 1]
            assert all(e is not None for e in block), i
            self.put(hashes[i], k, prompt[end], block)  # type: ignore[arg-type]

    # --- entries by key --------------------------------------------------------------------------
    def get(self, block_hash: BlockHash, k: int, next_token: int) -> tuple[Entry, ...] | None:
        """The block's entries for ``k`` and the token after it (None: not kept)."""
        key = (block_hash, k, next_token)
        entries = self._entries.get(key)
        if entries is not None:
            self._entries.move_to_end(key)
        return entries

    def put(self, block_hash: BlockHash, k: int, next_token: int,
            entries: Sequence[Entry]) -> None:
        """Keep a block's entries (one per position it covers), evicting the least recently
        used beyond ``max_items``; a block's entries larger than the bound are not kept."""
        key = (block_hash, k, next_token)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        size = _items(entries)
        if size > self.max_items:
            return
        while self.num_items + size > self.max_items:
            self._remove(next(iter(self._entries)))
        self._entries[key] = tuple(entries)
        self._keys_of.setdefault(block_hash, set()).add(key)
        self.num_items += size

    def drop(self, block_hash: BlockHash) -> None:
        """The pool evicted the block of ``block_hash``: its entries go with it."""
        for key in self._keys_of.pop(block_hash, ()):
            self.num_items -= _items(self._entries.pop(key))

    def _remove(self, key: Key) -> None:
        self.num_items -= _items(self._entries.pop(key))
        keys = self._keys_of[key[0]]
        keys.discard(key)
        if not keys:
            del self._keys_of[key[0]]

    def check_integrity(self) -> None:
        """The index by hash and the item count agree with the entries."""
        assert self.num_items == sum(_items(e) for e in self._entries.values())
        assert self.num_items <= self.max_items
        assert {k for keys in self._keys_of.values() for k in keys} == set(self._entries)


def _items(entries: Sequence[Entry]) -> int:
    return sum(len(e) for e in entries)
