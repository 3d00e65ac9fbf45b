"""The sampler's numpy row kernels: penalties, bans, log-probabilities, top-k / top-p /
min-p selection and inverse-CDF draws.

Every kernel works row by row (numpy's row-wise reductions, selections and sorts), so that a
row's result depends on that row alone: the sampler's reproducibility rests on it. Costs are
in :mod:`kvflow.orchestrator.sampling.sampler`'s docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.orchestrator.sampling.race import SPLIT_ID, keyed_uniforms, race, race_sorted

# Width of the blocks the dense inverse CDF sums first; a row's cumulative sum is then only
# taken inside one block. Any width gives the same distribution.
_CDF_BLOCK = 256
# top_p without top_k first looks for the nucleus among this many most likely tokens; for
# typical (peaked) LLM distributions it is there, and a full-row sort is avoided.
TOP_P_CANDIDATES = 1024
_SIGN_BIT = np.uint32(0x80000000)


def _ids(seq: Sequence[int]) -> np.ndarray:
    return np.asarray(seq, dtype=np.int64).reshape(-1)


def apply_penalties(work: np.ndarray, params: Sequence[SamplingParams],
                    prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
    """Penalise ``work``'s rows in place: repetition (HF, over prompt + output), then
    frequency and presence (OpenAI, over the output only). Row ``j`` is ``params[j]``'s, with
    its prompt and output token ids (ids outside the vocabulary are ignored)."""
    vocab = work.shape[1]
    rep_rows = [j for j, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        seqs = [np.concatenate([_ids(prompts[j]), _ids(outputs[j])]) for j in rep_rows]
        r_idx, t_idx = _flatten(rep_rows, seqs, vocab)
        penalty = np.array([p.repetition_penalty for p in params], dtype=np.float32)[r_idx]
        # Gather before writing: a token seen twice is written twice with the same value,
        # so each (row, token) is penalised exactly once without de-duplicating.
        vals = work[r_idx, t_idx]
        work[r_idx, t_idx] = np.where(vals > 0, vals / penalty, vals * penalty)

    pf_rows = [j for j, p in enumerate(params)
               if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if pf_rows:
        seqs = [_ids(outputs[j]) for j in pf_rows]
        r_idx, t_idx = _flatten(pf_rows, seqs, vocab)
        if r_idx.size:
            keys, counts = np.unique(r_idx * vocab + t_idx, return_counts=True)
            r_u, t_u = np.divmod(keys, vocab)
            freq = np.array([p.frequency_penalty for p in params], dtype=np.float64)
            pres = np.array([p.presence_penalty for p in params], dtype=np.float64)
            delta = freq[r_u] * counts + pres[r_u]
            work[r_u, t_u] -= delta.astype(np.float32)


def apply_bans(work: np.ndarray, bans: Sequence[np.ndarray | None]) -> None:
    """Mask to -inf, in each row ``j`` of ``work``, the ids ``bans[j]`` (None: none)."""
    rows_with_bans = [j for j, b in enumerate(bans) if b is not None]
    if rows_with_bans:
        r_idx, t_idx = _flatten(rows_with_bans, [b for b in bans if b is not None],
                                work.shape[1])
        work[r_idx, t_idx] = -np.inf


def logprobs_of(raw: np.ndarray, tokens: Sequence[int], counts: Sequence[int]
                ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Per row of the RAW logits ``raw`` (float32, the vocabulary only): the log-probability
    of its sampled token ``tokens[j]``, and its ``counts[j]`` most likely (token id,
    log-probability) pairs, most likely first (ties: lower id first)."""
    with np.errstate(invalid="ignore", over="ignore"):
        mx = raw.max(axis=1, keepdims=True)
        lse = mx[:, 0].astype(np.float64) + np.log(
            np.exp(raw - mx).sum(axis=1, dtype=np.float64)
        )
    sampled = raw[np.arange(raw.shape[0]), list(tokens)]
    logprobs = [float(v) for v in sampled - lse]
    top: list[list[tuple[int, float]]] = [[] for _ in tokens]
    # Rows asking for the same count share one vectorised selection.
    by_count: dict[int, list[int]] = {}
    for j, count in enumerate(counts):
        by_count.setdefault(min(count, raw.shape[1]), []).append(j)
    for count, js in by_count.items():
        if count == 0:
            continue
        ids, vals = top_n_sorted(raw[js], count)
        vals = vals.astype(np.float64) - lse[js, None]
        for k, j in enumerate(js):
            top[j] = list(zip(ids[k].tolist(), vals[k].tolist(), strict=True))
    return logprobs, top


def _flatten(
    row_ids: list[int], seqs: list[np.ndarray], vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """(row, token) index pairs for fancy indexing, dropping ids outside [0, vocab)."""
    lengths = [s.size for s in seqs]
    r_idx = np.repeat(np.asarray(row_ids, dtype=np.int64), lengths)
    t_idx = np.concatenate(seqs) if seqs else np.empty(0, dtype=np.int64)
    valid = (t_idx >= 0) & (t_idx < vocab)
    if not valid.all():
        r_idx, t_idx = r_idx[valid], t_idx[valid]
    return r_idx, t_idx


def argmax_rows(x: np.ndarray, rows: list[int]) -> np.ndarray:
    """np.argmax of the given rows of x, without copying them."""
    if len(rows) == x.shape[0] and x.flags.c_contiguous:
        return np.argmax(x, axis=1)
    # A strided 2-D argmax (padded vocab) is several times slower than per-row ones over
    # contiguous 1-D views, and gathering the rows would copy them.
    return np.array([np.argmax(x[i]) for i in rows], dtype=np.int64)


def _gather(w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``np.take_along_axis(w, ids, axis=1)``, about 3x faster through a flat index."""
    if not w.flags.c_contiguous:
        return np.take_along_axis(w, ids, axis=1)
    flat = ids + (np.arange(w.shape[0], dtype=np.int64) * w.shape[1])[:, None]
    return w.reshape(-1).take(flat)


def top_n_sorted(w: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The n largest entries of each float32 row as (ids, values), most likely first.

    Exactly n per row; ties (at the n-th value and in the order) go to the lower id, so the
    result is a function of the row alone and ``n=1`` is ``np.argmax``.
    """
    m, vocab = w.shape
    if n >= vocab:
        ids = np.broadcast_to(np.arange(vocab, dtype=np.int64), (m, vocab))
        vals = w
    else:
        ids = np.argpartition(w, vocab - n, axis=1)[:, vocab - n:]
        vals = _gather(w, ids)
        thr = vals.min(axis=1)
        # argpartition breaks ties at the n-th value arbitrarily; redo the (rare) rows where
        # the threshold value also occurs outside the chosen set.
        with np.errstate(invalid="ignore"):
            n_ge = np.count_nonzero(w >= thr[:, None], axis=1)
        for r in np.flatnonzero(n_ge > n):
            above = np.flatnonzero(w[r] > thr[r])
            tied = np.flatnonzero(w[r] == thr[r])[: n - above.size]
            ids[r] = np.concatenate([above, tied])
            vals[r] = w[r, ids[r]]
    return _sort_descending(ids, vals)


def _sort_descending(ids: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort each row by (value descending, id ascending); returns (ids, float32 values).

    Both go into one uint64 key: the high half is the float32 bit pattern mapped so that
    unsigned order is float order (then inverted, for descending), the low half the id. Keys
    are unique, so a plain (fast, unstable) sort is canonical; np.lexsort is ~5x slower.
    """
    bits = np.ascontiguousarray(vals, dtype=np.float32).view(np.uint32)
    ascending = np.where(bits & _SIGN_BIT, ~bits, bits | _SIGN_BIT)
    keys = ((~ascending).astype(np.uint64) << np.uint64(32)) | ids.astype(np.uint64)
    keys.sort(axis=1)
    sorted_ids = (keys & np.uint64(0xFFFFFFFF)).astype(np.int64)
    ascending = ~((keys >> np.uint64(32)).astype(np.uint32))
    bits = np.where(ascending & _SIGN_BIT, ascending & ~_SIGN_BIT, ~ascending)
    return sorted_ids, bits.view(np.float32)


def sample_dense(w: np.ndarray, min_p: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF sampling over the whole row (temperature already applied), with min_p."""
    m, vocab = w.shape
    with np.errstate(invalid="ignore", over="ignore"):
        mx = w.max(axis=1, keepdims=True)
        n_blocks = -(-vocab // _CDF_BLOCK)
        # Zero padding up to whole blocks adds no probability mass.
        e = np.zeros((m, n_blocks * _CDF_BLOCK), dtype=np.float32)
        ev = e[:, :vocab]
        np.subtract(w, mx, out=ev)
        if (min_p > 0).any():
            # p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p)
            with np.errstate(divide="ignore"):
                log_min_p = np.log(min_p).astype(np.float32)
            np.copyto(ev, np.float32(-np.inf), where=ev < log_min_p[:, None])
        np.exp(ev, out=ev)
        blocks = e.reshape(m, n_blocks, _CDF_BLOCK)
        block_cum = np.cumsum(blocks.sum(axis=2), axis=1, dtype=np.float64)
        target = u * block_cum[:, -1]
        b = np.minimum(np.count_nonzero(block_cum <= target[:, None], axis=1), n_blocks - 1)
        rows = np.arange(m)
        before = np.where(b > 0, block_cum[rows, np.maximum(b - 1, 0)], 0.0)
        seg = blocks[rows, b]
        seg_cum = np.cumsum(seg, axis=1, dtype=np.float64) + before[:, None]
        j = np.count_nonzero(seg_cum <= target[:, None], axis=1)
        # Rounding between the block sums and the in-block sums can leave j one past the end;
        # fall back to the block's last token with non-zero probability.
        over = j >= _CDF_BLOCK
        if over.any():
            last_nonzero = _CDF_BLOCK - 1 - np.argmax(seg[over][:, ::-1] > 0, axis=1)
            j[over] = last_nonzero
        tokens = b * _CDF_BLOCK + j
    return _degenerate_fallback(w, mx[:, 0], tokens)


def sample_dense_race(w: np.ndarray, min_p: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """:func:`sample_dense`'s distribution drawn by the race
    (:mod:`~kvflow.orchestrator.sampling.race`): a keyed draw first chooses between the
    row's ``TOP_P_CANDIDATES`` most likely tokens and the rest, by their masses; the race
    then runs among the chosen side alone (the rest, rarely: a flat distribution)."""
    m, vocab = w.shape
    tokens = np.empty(m, dtype=np.int64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        mx = w.max(axis=1, keepdims=True)
        log_min_p = np.log(min_p)
        n_cand = min(vocab, TOP_P_CANDIDATES)
        ids, vals = top_n_sorted(w, n_cand)
        for r in range(m):
            ratio = (vals[r] - mx[r]).astype(np.float64)
            ratio[ratio < log_min_p[r]] = -np.inf
            if n_cand < vocab:
                full = (w[r] - mx[r]).astype(np.float64)
                full[full < log_min_p[r]] = -np.inf
                split = keyed_uniforms(keys[r], np.array([SPLIT_ID]))[0]
                if split * np.exp(full).sum() >= np.exp(ratio).sum():
                    full[ids[r]] = -np.inf  # the rest of the row: the candidates out
                    tokens[r] = race(np.arange(vocab), full, keys[r])
                    continue
            tokens[r] = race(ids[r], ratio, keys[r])
    return _degenerate_fallback(w, mx[:, 0], tokens)


def _sample_sorted(
    ids: np.ndarray,
    probs: np.ndarray,
    total: np.ndarray,
    top_p: np.ndarray,
    log_ratio: np.ndarray,
    min_p: np.ndarray,
    u: np.ndarray,
    keys: np.ndarray | None = None,
) -> np.ndarray:
    """Sample among candidates sorted most likely first.

    Args:
        ids: [m, c] token ids, most likely first.
        probs: [m, c] unnormalised probabilities (float64) of ``ids``.
        total: [m] mass top_p is measured against.
        top_p: [m] nucleus mass.
        log_ratio: [m, c] log(p / p_max) of ``ids``, for min_p.
        min_p: [m].
        u: [m] uniform draws in [0, 1).
        keys: [m] the rows' race keys (None: the inverse CDF at ``u``; else the race among
            the kept candidates, :mod:`~kvflow.orchestrator.sampling.race`).
    """
    cum = np.cumsum(probs, axis=1)
    keep = nucleus_size(probs, cum, total, top_p, log_ratio, min_p)
    if keys is not None:
        return race_sorted(ids, log_ratio, keep, keys)
    rows = np.arange(ids.shape[0])
    target = u * cum[rows, keep - 1]
    j = np.minimum(np.count_nonzero(cum <= target[:, None], axis=1), keep - 1)
    return ids[rows, j]


def nucleus_size(probs: np.ndarray, cum: np.ndarray, total: np.ndarray, top_p: np.ndarray,
                 log_ratio: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """How many of each row's candidates, sorted most likely first, top_p and min_p keep
    (at least one): :func:`_sample_sorted`'s arguments, ``cum`` the cumulative ``probs``."""
    before = np.zeros_like(cum)  # mass strictly ahead of each candidate
    before[:, 1:] = cum[:, :-1]
    # top_p keeps a token while the mass strictly ahead of it is below top_p (the token that
    # crosses the line is kept), so at least the first token is always kept.
    keep = np.count_nonzero(before < (top_p * total)[:, None], axis=1)
    with np.errstate(divide="ignore"):
        log_min_p = np.log(min_p)
    keep = np.minimum(keep, np.count_nonzero(log_ratio >= log_min_p[:, None], axis=1))
    # Candidates are sorted, so the ones with non-zero probability come first.
    return np.maximum(np.minimum(keep, np.count_nonzero(probs > 0, axis=1)), 1)


def sample_top_k(
    w: np.ndarray, top_k: int, top_p: np.ndarray, min_p: np.ndarray, u: np.ndarray,
    keys: np.ndarray | None = None,
) -> np.ndarray:
    """Rows sharing one top_k: top_p is then taken over the renormalised top-k distribution."""
    ids, vals = top_n_sorted(w, top_k)
    vals = vals.astype(np.float64)
    with np.errstate(invalid="ignore"):
        log_ratio = vals - vals[:, :1]
        probs = np.exp(log_ratio)
    probs = np.nan_to_num(probs, nan=0.0)
    total = probs.sum(axis=1)
    tokens = _sample_sorted(ids, probs, total, top_p, log_ratio, min_p, u, keys)
    return _degenerate_fallback(w, vals[:, 0], tokens)


def sample_top_p(w: np.ndarray, top_p: np.ndarray, min_p: np.ndarray, u: np.ndarray,
                 keys: np.ndarray | None = None) -> np.ndarray:
    """top_p without top_k: sort a candidate set, or the whole row if the nucleus is larger."""
    m, vocab = w.shape
    tokens = np.empty(m, dtype=np.int64)
    with np.errstate(invalid="ignore", over="ignore"):
        mx = w.max(axis=1, keepdims=True)
        e = w - mx
        np.exp(e, out=e)
        total = e.sum(axis=1, dtype=np.float64)
        del e

        def nucleus(ids: np.ndarray, vals: np.ndarray, rows: np.ndarray | slice) -> np.ndarray:
            # The same float32 ops as for `total`, so candidate masses and total agree.
            ratio = vals - mx[rows]
            probs = np.exp(ratio).astype(np.float64)
            return _sample_sorted(ids, probs, total[rows], top_p[rows],
                                  ratio.astype(np.float64), min_p[rows], u[rows],
                                  None if keys is None else keys[rows])

        n_cand = min(vocab, TOP_P_CANDIDATES)
        ids, vals = top_n_sorted(w, n_cand)
        # If the candidates hold at least top_p of the mass, the nucleus is inside them.
        cand_mass = np.exp(vals - mx).sum(axis=1, dtype=np.float64)
        enough = (cand_mass >= top_p * total) | (n_cand == vocab)
        if enough.all():
            tokens[:] = nucleus(ids, vals, slice(None))
        elif enough.any():
            tokens[enough] = nucleus(ids[enough], vals[enough], enough)
        for r in np.flatnonzero(~enough):
            # Flat distribution: the nucleus is larger than the candidate set; sort the row.
            full_ids, full_vals = top_n_sorted(w[r: r + 1], vocab)
            tokens[r] = nucleus(full_ids, full_vals, slice(r, r + 1))[0]
    return _degenerate_fallback(w, mx[:, 0], tokens)


def _degenerate_fallback(w: np.ndarray, row_max: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Rows whose largest logit is not finite (all masked, NaN or +inf) take the argmax."""
    bad = ~np.isfinite(row_max)
    if bad.any():
        tokens = tokens.copy()
        tokens[bad] = np.argmax(w[bad], axis=1)
    return tokens
