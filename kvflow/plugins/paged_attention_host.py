"""PagedAttention on the host in NumPy: the implementation the ONNX Runtime runner executes.

Same semantics as :mod:`kvflow.plugins.paged_attention_ref` (the PyTorch reference), same
arguments as the ONNX node ``kvflow::PagedAttention``: the pool is reached through
``kv_cache_ptrs`` and :mod:`kvflow.plugins.kv_registry`, never passed as a tensor. A float16
pool is written rounding to nearest even and its gathered blocks read in fp32. With a sliding
window, block-table columns before a sequence's window are never read.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvflow.plugins import kv_registry
from kvflow.plugins.attention_options import check_attention_options, first_block


def _softmax_inplace(x: np.ndarray) -> np.ndarray:
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


_EXECUTOR: ThreadPoolExecutor | None = None
_MIN_SEQS_PER_THREAD = 8


def _pool_width() -> int:
    return min(4, os.cpu_count() or 1)


def _executor() -> ThreadPoolExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(_pool_width(), thread_name_prefix="kvflow-attn")
    return _EXECUTOR


def _split(rows: np.ndarray, width: int) -> list[np.ndarray]:
    n = max(1, min(width, rows.size // _MIN_SEQS_PER_THREAD))
    return np.array_split(rows, n)


def write_kv(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
              slot_mapping: np.ndarray) -> None:
    """Scatter new K/V ``[T, KVH*D]`` into caches ``[num_blocks, block_size, KVH, D]`` at
    their slots (negative: skipped), converted to the cache's type (NumPy's cast: round to
    nearest even)."""
    kvh, d = k_cache.shape[2:]
    slots = slot_mapping.astype(np.int64, copy=False)
    k3 = k.reshape(-1, kvh, d)
    v3 = v.reshape(-1, kvh, d)
    valid = slots >= 0
    if not valid.all():
        slots, k3, v3 = slots[valid], k3[valid], v3[valid]
    k_cache.reshape(-1, kvh, d)[slots] = k3
    v_cache.reshape(-1, kvh, d)[slots] = v3


def _cap(scores: np.ndarray, logit_softcap: float) -> np.ndarray:
    """Soft-capping in place: ``cap * tanh(s / cap)`` (0: none)."""
    if logit_softcap:
        scores /= np.float32(logit_softcap)
        np.tanh(scores, out=scores)
        scores *= np.float32(logit_softcap)
    return scores


def _decode_attention(decode: np.ndarray, q, k_cache, v_cache, block_tables, qsl, lens, out,
                      kvh: int, group: int, d: int, scale: float, window: int,
                      softcap: float) -> None:
    """Attention of sequences with one new token each, batched (rows ``decode``). Each reads
    the block-table columns from its window's first block on (see ``first_block``)."""
    block_size = k_cache.shape[1]
    dl = lens[decode]
    first = (np.maximum(dl - window, 0) // block_size if window
             else np.zeros_like(dl))
    nbs = -(-dl // block_size)
    nb = int((nbs - first).max())
    cols = first[:, None] + np.arange(nb)[None, :]
    # Columns past a sequence's last block read its first window block again (masked).
    cols = np.where(cols < nbs[:, None], cols, first[:, None])
    tables = np.take_along_axis(block_tables[decode], cols, axis=1)
    keys = k_cache[tables].reshape(decode.size, nb * block_size, kvh, d).astype(
        np.float32, copy=False)
    values = v_cache[tables].reshape(decode.size, nb * block_size, kvh, d).astype(
        np.float32, copy=False)
    rows = qsl[decode]
    qd = q[rows].reshape(decode.size, kvh, group, d).astype(np.float32, copy=False)
    scores = _cap(np.matmul(qd, keys.transpose(0, 2, 3, 1)) * np.float32(scale),
                  softcap)  # [S, KVH, G, K]
    k_pos = (first[:, None] * block_size + np.arange(nb * block_size)[None, :])
    mask = k_pos >= dl[:, None]  # also every key of a repeated column (past the last)
    if window:
        mask |= k_pos <= dl[:, None] - 1 - window
    scores[np.broadcast_to(mask[:, None, None, :], scores.shape)] = -np.inf
    probs = _softmax_inplace(scores)
    od = np.matmul(probs, values.transpose(0, 2, 1, 3))  # [S, KVH, G, D]
    out[rows] = od.reshape(decode.size, kvh * group * d)


def paged_attention_host(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    kv_cache_ptrs: np.ndarray,
    slot_mapping: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray,
    *,
    layer_idx: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> np.ndarray:
    """One layer: ``q`` ``[T, H*D]``, ``k``/``v`` ``[T, KVH*D]`` -> ``[T, H*D]``.
    ``sliding_window`` and ``logit_softcap``: the node's optional attributes (0 = off)."""
    check_attention_options(sliding_window, logit_softcap)
    k_cache = kv_registry.lookup(int(kv_cache_ptrs[layer_idx, 0]))
    v_cache = kv_registry.lookup(int(kv_cache_ptrs[layer_idx, 1]))
    block_size = k_cache.shape[1]
    kvh, d, group = num_kv_heads, head_dim, num_heads // num_kv_heads
    num_tokens = q.shape[0]
    write_kv(k, v, k_cache, v_cache, slot_mapping)

    out = np.empty((num_tokens, num_heads * d), dtype=q.dtype)
    qsl = query_start_loc.astype(np.int64)
    q_lens = qsl[1:] - qsl[:-1]
    lens = seq_lens.astype(np.int64)

    decode = np.nonzero(q_lens == 1)[0]
    if decode.size:
        args = (q, k_cache, v_cache, block_tables, qsl, lens, out, kvh, group, d, scale,
                sliding_window, logit_softcap)
        parts = _split(decode, _pool_width())
        if len(parts) == 1:
            _decode_attention(parts[0], *args)
        else:  # NumPy releases the GIL in its copies and matmuls: split the batch over cores.
            list(_executor().map(lambda rows: _decode_attention(rows, *args), parts))

    for s in np.nonzero(q_lens > 1)[0]:
        n, length = int(q_lens[s]), int(lens[s])
        nb = -(-length // block_size)
        first = first_block(length, n, sliding_window, block_size)
        k0 = first * block_size
        table = block_tables[s, first:nb]
        keys = k_cache[table].reshape(-1, kvh, d)[: length - k0].astype(np.float32, copy=False)
        values = v_cache[table].reshape(-1, kvh, d)[: length - k0].astype(
            np.float32, copy=False)
        start = int(qsl[s])
        qs = q[start : start + n].reshape(n, kvh, group, d)
        # [KVH, G*n, D] x [KVH, D, L]: one matmul per KV head
        qh = qs.transpose(1, 2, 0, 3).reshape(kvh, group * n, d)
        scores = _cap(np.matmul(qh, keys.transpose(1, 2, 0)) * np.float32(scale), logit_softcap)
        scores = scores.reshape(kvh, group, n, length - k0)
        k_pos, q_pos = np.arange(k0, length)[None, :], np.arange(length - n, length)[:, None]
        mask = k_pos > q_pos
        if sliding_window:
            mask |= k_pos <= q_pos - sliding_window
        scores[:, :, mask] = -np.inf
        probs = _softmax_inplace(scores).reshape(kvh, group * n, length - k0)
        oh = np.matmul(probs, values.transpose(1, 0, 2))  # [KVH, G*n, D]
        out[start : start + n] = (
            oh.reshape(kvh, group, n, d).transpose(2, 0, 1, 3).reshape(n, num_heads * d)
        )
    return out
