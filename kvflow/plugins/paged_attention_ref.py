"""PagedAttention in plain PyTorch: the reference every other implementation is checked against.

Semantics of one call (one layer of one engine step; see docs/design.md, "Engine I/O contract"):

1. Write each new token's K and V into the pool at its slot: ``slot = block_id * block_size +
   offset``; a negative slot means "padding, do not write".
2. For each sequence ``s``, its new tokens are ``query_start_loc[s]:query_start_loc[s+1]`` of the
   packed batch and its total length after this step is ``seq_lens[s]``; new token ``i`` of a
   sequence with ``n`` new tokens sits at position ``seq_lens[s] - n + i`` and attends causally
   to positions ``0 ..`` its own, read through ``block_tables[s]`` (with ``sliding_window``
   W > 0, to the last W of them; ``logit_softcap`` caps the scores: see
   :mod:`kvflow.plugins.torch_op`).

Decode-only sequences (one new token) are computed together in one batched pass; sequences with
several new tokens (prefill chunks) are computed one by one, since each is a large piece of work.
"""

from __future__ import annotations

import torch

from kvflow.plugins.attention_options import check_attention_options, first_block


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V rows ``[T, KVH, D]`` into caches ``[num_blocks, block_size, KVH, D]``."""
    kvh, d = k_cache.shape[-2:]
    flat_k = k_cache.view(-1, kvh, d)
    flat_v = v_cache.view(-1, kvh, d)
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, k, v = slots[valid], k[valid], v[valid]
    flat_k.index_copy_(0, slots, k.to(k_cache.dtype))
    flat_v.index_copy_(0, slots, v.to(v_cache.dtype))


def _cap(scores: torch.Tensor, logit_softcap: float) -> torch.Tensor:
    """Soft-capping in place: ``cap * tanh(s / cap)`` (0: none)."""
    if logit_softcap:
        scores.div_(logit_softcap).tanh_().mul_(logit_softcap)
    return scores


def paged_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> torch.Tensor:
    """Write K/V, then attend: ``q`` ``[T, H, D]``, ``k``/``v`` ``[T, KVH, D]`` -> ``[T, H, D]``.

    Scores and softmax run in fp32 whatever the input dtype. ``sliding_window`` and
    ``logit_softcap`` as the op's attributes (:mod:`kvflow.plugins.torch_op`); block-table
    columns before a sequence's :func:`~kvflow.plugins.attention_options.first_block` are
    never read.
    """
    check_attention_options(sliding_window, logit_softcap)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kvh
    out = torch.empty_like(q)
    seq_lens_l = seq_lens.tolist()
    qsl = query_start_loc.tolist()
    q_lens = [qsl[i + 1] - qsl[i] for i in range(len(seq_lens_l))]

    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        idx = torch.tensor(decode)
        lens = seq_lens.long()[idx]
        # Each sequence's columns from its window's first block on (all of them without one).
        first = torch.tensor([first_block(seq_lens_l[i], 1, sliding_window, block_size)
                              for i in decode])
        nbs = (lens + block_size - 1) // block_size
        nb = int((nbs - first).max())
        cols = first[:, None] + torch.arange(nb)[None, :]
        # Columns past a sequence's last block read its first window block again (masked).
        tables = block_tables.long()[idx].gather(1, torch.where(cols < nbs[:, None], cols,
                                                                first[:, None]))
        keys = k_cache[tables].view(len(decode), nb * block_size, kvh, head_dim)
        values = v_cache[tables].view(len(decode), nb * block_size, kvh, head_dim)
        rows = torch.tensor([qsl[i] for i in decode])
        qd = q[rows].view(len(decode), kvh, group, head_dim).float()
        scores = torch.matmul(qd, keys.float().permute(0, 2, 3, 1)) * scale  # [S, KVH, G, K]
        _cap(scores, logit_softcap)
        k_pos = (cols[:, :, None] * block_size + torch.arange(block_size)).view(len(decode), -1)
        q_pos = (lens - 1)[:, None]
        mask = k_pos > q_pos  # also every key of a repeated column (positions past the last)
        if sliding_window:
            mask |= k_pos <= q_pos - sliding_window
        scores.masked_fill_(mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        od = torch.matmul(probs, values.float().permute(0, 2, 1, 3))  # [S, KVH, G, D]
        out[rows] = od.reshape(len(decode), num_heads, head_dim).to(q.dtype)

    for s, n in enumerate(q_lens):
        if n <= 1:
            continue
        length = seq_lens_l[s]
        fb = first_block(length, n, sliding_window, block_size)
        nb = -(-length // block_size)
        table = block_tables[s, fb:nb].long()
        k0 = fb * block_size
        keys = k_cache[table].reshape(-1, kvh, head_dim)[: length - k0].float()
        values = v_cache[table].reshape(-1, kvh, head_dim)[: length - k0].float()
        qs = q[qsl[s] : qsl[s + 1]].view(n, kvh, group, head_dim).float()
        scores = _cap(torch.einsum("qhgd,khd->hgqk", qs, keys) * scale, logit_softcap)
        q_pos = torch.arange(length - n, length)[:, None]
        k_pos = torch.arange(k0, length)[None, :]
        mask = k_pos > q_pos  # [n, length - k0]
        if sliding_window:
            mask |= k_pos <= q_pos - sliding_window
        scores.masked_fill_(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        os_ = torch.einsum("hgqk,khd->qhgd", probs, values)
        out[qsl[s] : qsl[s + 1]] = os_.reshape(n, num_heads, head_dim).to(q.dtype)
    return out


def random_step(seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int,
                block_size: int, dtype: torch.dtype, generator: torch.Generator,
                device: str | torch.device = "cpu") -> dict:
    """The arguments of one PagedAttention call on random data, for checking and timing
    implementations: sequences given as (cached tokens, new tokens), random K/V in the pool,
    block tables scattered over it (block 0 null, a few blocks nobody owns)."""
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    perm = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
    slots, lens, qsl = [], [], [0]
    for s, ((c, n), nb) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        ids = [perm.pop() for _ in range(nb)]
        tables[s, :nb] = torch.tensor(ids)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
        lens.append(c + n)
        qsl.append(qsl[-1] + n)
    t = qsl[-1]

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype).to(device)

    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    return dict(q=rnd(t, heads, head_dim), k=rnd(t, kv_heads, head_dim),
                v=rnd(t, kv_heads, head_dim), k_cache=rnd(*cache_shape),
                v_cache=rnd(*cache_shape),
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                block_tables=tables.to(device),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
                scale=head_dim ** -0.5)
