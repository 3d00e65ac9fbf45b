"""Pack scheduled sequence chunks into a :class:`StepInput` (NumPy only, no torch)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from kvflow.kv_manager import KVCacheManager
from kvflow.runtime.base import StepInput


@dataclass(frozen=True)
class SeqChunk:
    """``token_ids[start:start+num_new]`` of sequence ``request_id`` is computed this step.

    ``token_ids`` is the sequence's whole known token list (prompt + output so far); the KV of
    positions ``0 .. start-1`` is already in the pool. ``sample`` asks for the logits of the
    chunk's last token.
    """

    request_id: Hashable
    token_ids: Sequence[int]
    start: int
    num_new: int
    sample: bool


def build_step(kv: KVCacheManager, chunks: Sequence[SeqChunk]) -> StepInput:
    """The engine inputs for ``chunks``; their blocks must already be allocated in ``kv``."""
    bs = kv.block_size
    num_tokens = sum(c.num_new for c in chunks)
    input_ids = np.empty(num_tokens, dtype=np.int64)
    positions = np.empty(num_tokens, dtype=np.int64)
    slot_mapping = np.empty(num_tokens, dtype=np.int64)
    seq_lens = np.empty(len(chunks), dtype=np.int32)
    query_start_loc = np.zeros(len(chunks) + 1, dtype=np.int32)
    tables = [kv.get_block_table(c.request_id) for c in chunks]
    width = max(-(-(c.start + c.num_new) // bs) for c in chunks)
    block_tables = np.zeros((len(chunks), width), dtype=np.int32)
    logits_indices = []
    offset = 0
    for i, c in enumerate(chunks):
        end = c.start + c.num_new
        nb = -(-end // bs)
        table = np.asarray(tables[i][:nb], dtype=np.int64)
        block_tables[i, :nb] = table
        pos = np.arange(c.start, end, dtype=np.int64)
        input_ids[offset:offset + c.num_new] = c.token_ids[c.start:end]
        positions[offset:offset + c.num_new] = pos
        slot_mapping[offset:offset + c.num_new] = table[pos // bs] * bs + pos % bs
        seq_lens[i] = end
        offset += c.num_new
        query_start_loc[i + 1] = offset
        if c.sample:
            logits_indices.append(offset - 1)
    return StepInput(input_ids, positions, slot_mapping, block_tables, seq_lens,
                     query_start_loc, np.asarray(logits_indices, dtype=np.int64))
