"""Pack scheduled sequence chunks into a :class:`StepInput` (NumPy only, no torch)."""

from __future__ import annotations

import itertools
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
    chunk's last token; ``prompt_rows`` for those of these positions (inside the chunk, before
    its last token: prompt logprobs), returned before the sampled row. ``num_spec``: the
    chunk's last that many tokens are drafts (speculative decoding); the logits of the token
    before them and of each of them are wanted, to verify the drafts. ``lora_slot``: the
    runner's LoRA slot of the sequence's adapter (-1: the base model).
    """

    request_id: Hashable
    token_ids: Sequence[int]
    start: int
    num_new: int
    sample: bool
    prompt_rows: range = range(0)
    num_spec: int = 0
    lora_slot: int = -1

    def logits_rows(self, offset: int) -> list[int]:
        """The packed rows whose logits this chunk wants, its tokens starting at ``offset``."""
        rows = [offset + p - self.start for p in self.prompt_rows]
        if self.sample:
            last = offset + self.num_new - 1
            rows.extend(range(last - self.num_spec, last + 1))
        return rows


def lora_slots(chunks: Sequence[SeqChunk]) -> np.ndarray | None:
    """``StepInput.lora_slots``: each packed token's chunk's slot; None when every chunk is
    the base model's (the runner then does no LoRA work)."""
    if all(c.lora_slot < 0 for c in chunks):
        return None
    return np.repeat(np.fromiter((c.lora_slot for c in chunks), np.int32, len(chunks)),
                     np.fromiter((c.num_new for c in chunks), np.int64, len(chunks)))


def build_step(kv: KVCacheManager, chunks: Sequence[SeqChunk]) -> StepInput:
    """The engine inputs for ``chunks``; their blocks must already be allocated in ``kv``."""
    # NOTE: this runs every step for every scheduled sequence: plain lists, one conversion to
    # NumPy at the end, and a fast path for decodes (one token).
    bs = kv.block_size
    tables = kv.block_tables
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    logits_indices: list[int] = []
    rows: list[list[int]] = []
    offset = 0
    for c in chunks:
        table = tables[c.request_id]
        end = c.start + c.num_new
        if c.num_new == 1:
            p = c.start
            input_ids.append(c.token_ids[p])
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
        else:
            input_ids.extend(c.token_ids[c.start:end])
            pos = range(c.start, end)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
        rows.append(table[: -(-end // bs)])
        seq_lens.append(end)
        if c.prompt_rows or c.num_spec:
            logits_indices.extend(c.logits_rows(offset))
        elif c.sample:
            logits_indices.append(offset + c.num_new - 1)
        offset += c.num_new
        query_start_loc.append(offset)
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    block_tables = np.zeros((len(rows), int(lens.max())), dtype=np.int32)
    # One scatter of every row's blocks (row i fills its first lens[i] columns).
    block_tables[np.arange(block_tables.shape[1]) < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(rows), dtype=np.int32, count=int(lens.sum()))
    return StepInput(
        np.array(input_ids, dtype=np.int64), np.array(positions, dtype=np.int64),
        np.array(slots, dtype=np.int64), block_tables, np.array(seq_lens, dtype=np.int32),
        np.array(query_start_loc, dtype=np.int32), np.array(logits_indices, dtype=np.int64),
        lora_slots(chunks))


_EMPTY_I64 = np.empty(0, dtype=np.int64)


def build_step_shape(chunks: Sequence[SeqChunk]) -> StepInput:
    """A :class:`StepInput` with only the step's shape (``seq_lens``, ``query_start_loc``,
    ``logits_indices``), for a runner that reads no inputs (``needs_inputs = False``): the
    token ids, positions, slots and block tables are empty."""
    seq_lens, query_start_loc, logits_indices = [], [0], []
    offset = 0
    for c in chunks:
        seq_lens.append(c.start + c.num_new)
        if c.prompt_rows or c.num_spec:
            logits_indices.extend(c.logits_rows(offset))
        elif c.sample:
            logits_indices.append(offset + c.num_new - 1)
        offset += c.num_new
        query_start_loc.append(offset)
    return StepInput(_EMPTY_I64, _EMPTY_I64, _EMPTY_I64,
                     np.zeros((len(seq_lens), 0), dtype=np.int32),
                     np.array(seq_lens, dtype=np.int32),
                     np.array(query_start_loc, dtype=np.int32),
                     np.array(logits_indices, dtype=np.int64), lora_slots(chunks))
