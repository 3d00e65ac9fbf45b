"""Pick the next token of every row of a batch from the model's logits, with numpy.

Order of operations per row (vLLM's):

1. log-probabilities, when requested, from the *raw* logits (log_softmax of the model output);
2. penalties: repetition (HF, over prompt + output), then frequency and presence (OpenAI, over
   the output only);
3. ``min_tokens``: until that many tokens exist, EOS (unless ``ignore_eos``) and
   ``stop_token_ids`` are masked to -inf; a structured output's row instead has every token its
   grammar does not allow masked (:func:`~kvflow.orchestrator.sampling.structured.apply_bitmask`,
   one pass over the constrained rows);
4. greedy rows take the argmax (ties go to the lowest token id);
5. other rows: divide by the temperature, keep top_k, then top_p (of the top-k renormalised
   distribution), then min_p, and invert the CDF of the softmax at ONE uniform draw from the
   row's own generator.

Reproducibility: everything a row's token depends on is computed from that row alone (numpy's
row-wise reductions, selections and sorts do not look at neighbouring rows), and each row draws
exactly one number per step from its own generator. So a seeded request yields the same tokens
whatever else is in the batch and wherever its row is.

Cost (256 rows x 49152 vocab, one core): an all-greedy batch without penalties is one argmax pass;
otherwise only the rows that need it are copied, top_k uses ``argpartition`` rather than a sort,
top_p sorts only a top-1024 candidate set unless that set holds less than top_p of the mass, and
the CDF is inverted over 256-wide blocks so no full-row cumulative sum is needed.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvflow.orchestrator.sampling.params import MAX_SEED, SamplingParams
from kvflow.orchestrator.sampling.structured import apply_bitmask

# Width of the blocks the dense inverse CDF sums first; a row's cumulative sum is then only
# taken inside one block. Any width gives the same distribution.
_CDF_BLOCK = 256
# top_p without top_k first looks for the nucleus among this many most likely tokens; for
# typical (peaked) LLM distributions it is there, and a full-row sort is avoided.
_TOP_P_CANDIDATES = 1024

# Row categories, in the order the work matrix is laid out (each one is a contiguous slice).
_DENSE, _TOP_K, _TOP_P, _GREEDY_MODIFIED = range(4)
_SIGN_BIT = np.uint32(0x80000000)


def make_generator(seed: int | None) -> np.random.Generator:
    """The random stream of one request: seeded if ``seed`` is given, else from OS entropy.

    Create it once per request and keep it for the request's lifetime; the sampler draws
    exactly one number from it per step (for non-greedy requests).
    """
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int or None, got {seed!r} ({type(seed).__name__})")
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {seed}")
        seed = int(seed)
    return np.random.Generator(np.random.PCG64(seed))


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request for one step.

    Token-id sequences may be lists or integer numpy arrays (arrays avoid a conversion).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: np.random.Generator
    # A structured output's allowed next tokens: int32 [ceil(vocab / 32)], bit t of word
    # t // 32 set for an allowed token (llguidance's layout); None: unconstrained.
    bitmask: np.ndarray | None = None


@dataclass
class SamplerOutput:
    """One step's result, one entry per row.

    Attributes:
        token_ids: The sampled token of each row.
        logprobs: Log-probability (raw logits) of the sampled token, or None when the row's
            ``params.logprobs`` is None.
        top_logprobs: The ``params.logprobs`` most likely (token id, log-probability) pairs,
            most likely first (ties: lower id first), or None when not requested.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def _ids(seq: Sequence[int]) -> np.ndarray:
    return np.asarray(seq, dtype=np.int64).reshape(-1)


class Sampler:
    """Samples one next token per row of a batch of logits.

    Args:
        vocab_size: Number of real tokens; logits columns past it (padding) are never sampled.
        eos_token_ids: Ids masked while a row is below its ``min_tokens`` (unless
            ``ignore_eos``).
    """

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
            raise TypeError(f"vocab_size must be an int, got {vocab_size!r}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        eos = tuple(int(t) for t in eos_token_ids)
        for t in eos:
            if not 0 <= t < vocab_size:
                raise ValueError(f"eos_token_ids must be in [0, {vocab_size}), got {t}")
        self.vocab_size: int = int(vocab_size)
        self.eos_token_ids: tuple[int, ...] = eos

    # ------------------------------------------------------------------ public

    def sample(self, logits: np.ndarray, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Sample one token for each row.

        Args:
            logits: float array [len(rows), >= vocab_size]; it is not modified.
            rows: Per-row parameters and state, in the order of ``logits``' rows.

        Returns:
            The sampled tokens and, for rows that asked, their log-probabilities.
        """
        x = self._valid_logits(logits, len(rows))
        n = len(rows)
        tokens = np.empty(n, dtype=np.int64)

        plain: list[int] = []  # greedy, logits untouched: argmax straight on the input
        work_keys: list[tuple[int, int, int]] = []  # (category, top_k, row) of rows to copy
        bans: dict[int, np.ndarray] = {}
        for i, row in enumerate(rows):
            p = row.params
            constrained = row.bitmask is not None
            ban = self._row_ban(row)
            if ban is not None:
                bans[i] = ban
            if p.is_greedy:
                if p.has_penalties or ban is not None or constrained:
                    work_keys.append((_GREEDY_MODIFIED, 0, i))
                else:
                    plain.append(i)
            elif 0 < p.top_k < self.vocab_size:
                work_keys.append((_TOP_K, p.top_k, i))
            elif p.top_p < 1.0:
                work_keys.append((_TOP_P, 0, i))
            else:
                work_keys.append((_DENSE, 0, i))

        if plain:
            tokens[plain] = _argmax_rows(x, plain)
        if work_keys:
            self._sample_work_rows(x, rows, sorted(work_keys), bans, tokens)

        token_list = tokens.tolist()
        logprobs, top_logprobs = self._logprobs(x, rows, token_list)
        return SamplerOutput(token_ids=token_list, logprobs=logprobs, top_logprobs=top_logprobs)

    def is_plain_greedy(self, params: SamplingParams, num_output_tokens: int) -> bool:
        """Whether a row's token is the argmax of its raw logits and nothing else is read from
        them (no penalties, no ``min_tokens`` ban, no logprobs): the runner may then return
        the argmax alone (:meth:`ModelRunner.execute_argmax`)."""
        return (params.is_greedy and not params.has_penalties and params.logprobs is None
                and params.structured is None
                and self._min_tokens_ban(params, num_output_tokens) is None)

    def processed_logits(self, logits: np.ndarray, rows: Sequence[SamplingRow]) -> np.ndarray:
        """The logits after penalties, ``min_tokens`` and grammar masking, before temperature.

        A float32 copy [len(rows), vocab_size] of every row, for tests and debugging;
        :meth:`sample` applies the same steps, but only to the rows that need them.
        """
        x = self._valid_logits(logits, len(rows))
        work = np.array(x, dtype=np.float32)
        self._apply_penalties(work, list(rows))
        self._apply_bans(work, [self._row_ban(r) for r in rows])
        self._apply_bitmasks(work, rows)
        return work

    # --------------------------------------------------------------- internals

    def _valid_logits(self, logits: np.ndarray, num_rows: int) -> np.ndarray:
        if not isinstance(logits, np.ndarray):
            raise TypeError(f"logits must be a numpy array, got {type(logits).__name__}")
        if logits.ndim != 2 or logits.shape[0] != num_rows:
            raise ValueError(
                f"logits must have shape [num_rows={num_rows}, vocab], got {logits.shape}"
            )
        if logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits must have at least vocab_size={self.vocab_size} columns, "
                f"got {logits.shape[1]}"
            )
        if not np.issubdtype(logits.dtype, np.floating):
            raise TypeError(f"logits must be a float array, got dtype {logits.dtype}")
        return logits[:, :self.vocab_size]  # type: ignore[index]  # a view: padding drops out

    def _row_ban(self, row: SamplingRow) -> np.ndarray | None:
        """The ids a row may not sample this step: a grammar decides when a constrained row
        may end, so min_tokens bans EOS only in unconstrained ones."""
        if row.bitmask is not None:
            return None
        return self._min_tokens_ban(row.params, len(row.output_token_ids))

    @staticmethod
    def _apply_bitmasks(work: np.ndarray, rows: Sequence[SamplingRow]) -> None:
        """Mask what their grammars disallow in the constrained rows, in one pass."""
        masked = [j for j, r in enumerate(rows) if r.bitmask is not None]
        if masked:
            masks = [rows[j].bitmask for j in masked]
            apply_bitmask(work, np.stack(masks), rows=masked)  # type: ignore[arg-type]

    def _min_tokens_ban(self, p: SamplingParams, num_output_tokens: int) -> np.ndarray | None:
        if num_output_tokens >= p.min_tokens:
            return None
        ids = list(p.stop_token_ids)
        if not p.ignore_eos:
            ids.extend(self.eos_token_ids)
        # Ids past the vocabulary cannot be sampled anyway.
        ban = np.asarray([t for t in ids if t < self.vocab_size], dtype=np.int64)
        return ban if ban.size else None

    def _sample_work_rows(
        self,
        x: np.ndarray,
        rows: Sequence[SamplingRow],
        keys: list[tuple[int, int, int]],
        bans: dict[int, np.ndarray],
        tokens: np.ndarray,
    ) -> None:
        """Copy the rows that need changing into one matrix, laid out by category, and sample."""
        order = [i for _, _, i in keys]
        # The single copy of the logits this step makes: only the rows that are modified.
        work = np.asarray(x[order], dtype=np.float32)
        self._apply_penalties(work, [rows[i] for i in order])
        self._apply_bans(work, [bans.get(i) for i in order])
        self._apply_bitmasks(work, [rows[i] for i in order])

        # Contiguous [start, stop) slices per (category, top_k) group; slices are views.
        start = 0
        while start < len(keys):
            category, top_k = keys[start][:2]
            stop = start
            while stop < len(keys) and keys[stop][:2] == (category, top_k):
                stop += 1
            block = work[start:stop]
            dest = order[start:stop]
            if category == _GREEDY_MODIFIED:
                tokens[dest] = np.argmax(block, axis=1)
            else:
                group = [rows[i] for i in dest]
                params = [r.params for r in group]
                # Exactly one draw per row per step keeps a seeded stream independent of the
                # path taken and of the batch.
                u = np.array([r.generator.random() for r in group], dtype=np.float64)
                temps = np.array([q.temperature for q in params], dtype=np.float32)
                block /= temps[:, None]
                min_p = np.array([q.min_p for q in params], dtype=np.float64)
                if category == _DENSE:
                    tokens[dest] = _sample_dense(block, min_p, u)
                elif category == _TOP_K:
                    top_p = np.array([q.top_p for q in params], dtype=np.float64)
                    tokens[dest] = _sample_top_k(block, top_k, top_p, min_p, u)
                else:
                    top_p = np.array([q.top_p for q in params], dtype=np.float64)
                    tokens[dest] = _sample_top_p(block, top_p, min_p, u)
            start = stop

    def _apply_penalties(self, work: np.ndarray, rows: list[SamplingRow]) -> None:
        vocab = self.vocab_size
        rep_rows = [j for j, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        if rep_rows:
            seqs = [np.concatenate([_ids(rows[j].prompt_token_ids),
                                    _ids(rows[j].output_token_ids)]) for j in rep_rows]
            r_idx, t_idx = _flatten(rep_rows, seqs, vocab)
            penalty = np.array([rows[j].params.repetition_penalty for j in range(len(rows))],
                               dtype=np.float32)[r_idx]
            # Gather before writing: a token seen twice is written twice with the same value,
            # so each (row, token) is penalised exactly once without de-duplicating.
            vals = work[r_idx, t_idx]
            work[r_idx, t_idx] = np.where(vals > 0, vals / penalty, vals * penalty)

        pf_rows = [
            j for j, r in enumerate(rows)
            if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
        ]
        if pf_rows:
            seqs = [_ids(rows[j].output_token_ids) for j in pf_rows]
            r_idx, t_idx = _flatten(pf_rows, seqs, vocab)
            if r_idx.size:
                keys, counts = np.unique(r_idx * vocab + t_idx, return_counts=True)
                r_u, t_u = np.divmod(keys, vocab)
                freq = np.array([r.params.frequency_penalty for r in rows], dtype=np.float64)
                pres = np.array([r.params.presence_penalty for r in rows], dtype=np.float64)
                delta = freq[r_u] * counts + pres[r_u]
                work[r_u, t_u] -= delta.astype(np.float32)

    @staticmethod
    def _apply_bans(work: np.ndarray, bans: list[np.ndarray | None]) -> None:
        rows_with_bans = [j for j, b in enumerate(bans) if b is not None]
        if rows_with_bans:
            r_idx, t_idx = _flatten(rows_with_bans, [b for b in bans if b is not None],
                                    work.shape[1])
            work[r_idx, t_idx] = -np.inf

    def _logprobs(
        self, x: np.ndarray, rows: Sequence[SamplingRow], tokens: list[int]
    ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
        n = len(rows)
        logprobs: list[float | None] = [None] * n
        top: list[list[tuple[int, float]] | None] = [None] * n
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not wanted:
            return logprobs, top
        raw = np.asarray(x[wanted], dtype=np.float32)  # from the RAW logits, before penalties
        with np.errstate(invalid="ignore", over="ignore"):
            mx = raw.max(axis=1, keepdims=True)
            lse = mx[:, 0].astype(np.float64) + np.log(
                np.exp(raw - mx).sum(axis=1, dtype=np.float64)
            )
        sampled = raw[np.arange(len(wanted)), [tokens[i] for i in wanted]]
        for j, i in enumerate(wanted):
            logprobs[i] = float(sampled[j] - lse[j])
        # Rows asking for the same count share one vectorised selection.
        by_count: dict[int, list[int]] = {}
        for j, i in enumerate(wanted):
            by_count.setdefault(min(rows[i].params.logprobs or 0, self.vocab_size), []).append(j)
        for count, js in by_count.items():
            if count == 0:
                for j in js:
                    top[wanted[j]] = []
                continue
            ids, vals = _top_n_sorted(raw[js], count)
            vals = vals.astype(np.float64) - lse[js, None]
            for k, j in enumerate(js):
                top[wanted[j]] = list(zip(ids[k].tolist(), vals[k].tolist(), strict=True))
        return logprobs, top


# ---------------------------------------------------------------------- kernels


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


def _argmax_rows(x: np.ndarray, rows: list[int]) -> np.ndarray:
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


def _top_n_sorted(w: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
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


def _sample_dense(w: np.ndarray, min_p: np.ndarray, u: np.ndarray) -> np.ndarray:
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


def _sample_sorted(
    ids: np.ndarray,
    probs: np.ndarray,
    total: np.ndarray,
    top_p: np.ndarray,
    log_ratio: np.ndarray,
    min_p: np.ndarray,
    u: np.ndarray,
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
    """
    cum = np.cumsum(probs, axis=1)
    before = np.zeros_like(cum)  # mass strictly ahead of each candidate
    before[:, 1:] = cum[:, :-1]
    # top_p keeps a token while the mass strictly ahead of it is below top_p (the token that
    # crosses the line is kept), so at least the first token is always kept.
    keep = np.count_nonzero(before < (top_p * total)[:, None], axis=1)
    with np.errstate(divide="ignore"):
        log_min_p = np.log(min_p)
    keep = np.minimum(keep, np.count_nonzero(log_ratio >= log_min_p[:, None], axis=1))
    # Candidates are sorted, so the ones with non-zero probability come first.
    keep = np.maximum(np.minimum(keep, np.count_nonzero(probs > 0, axis=1)), 1)
    rows = np.arange(ids.shape[0])
    target = u * cum[rows, keep - 1]
    j = np.minimum(np.count_nonzero(cum <= target[:, None], axis=1), keep - 1)
    return ids[rows, j]


def _sample_top_k(
    w: np.ndarray, top_k: int, top_p: np.ndarray, min_p: np.ndarray, u: np.ndarray
) -> np.ndarray:
    """Rows sharing one top_k: top_p is then taken over the renormalised top-k distribution."""
    ids, vals = _top_n_sorted(w, top_k)
    vals = vals.astype(np.float64)
    with np.errstate(invalid="ignore"):
        log_ratio = vals - vals[:, :1]
        probs = np.exp(log_ratio)
    probs = np.nan_to_num(probs, nan=0.0)
    total = probs.sum(axis=1)
    tokens = _sample_sorted(ids, probs, total, top_p, log_ratio, min_p, u)
    return _degenerate_fallback(w, vals[:, 0], tokens)


def _sample_top_p(w: np.ndarray, top_p: np.ndarray, min_p: np.ndarray, u: np.ndarray) -> np.ndarray:
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
                                  ratio.astype(np.float64), min_p[rows], u[rows])

        n_cand = min(vocab, _TOP_P_CANDIDATES)
        ids, vals = _top_n_sorted(w, n_cand)
        # If the candidates hold at least top_p of the mass, the nucleus is inside them.
        cand_mass = np.exp(vals - mx).sum(axis=1, dtype=np.float64)
        enough = (cand_mass >= top_p * total) | (n_cand == vocab)
        if enough.all():
            tokens[:] = nucleus(ids, vals, slice(None))
        elif enough.any():
            tokens[enough] = nucleus(ids[enough], vals[enough], enough)
        for r in np.flatnonzero(~enough):
            # Flat distribution: the nucleus is larger than the candidate set; sort the row.
            full_ids, full_vals = _top_n_sorted(w[r: r + 1], vocab)
            tokens[r] = nucleus(full_ids, full_vals, slice(r, r + 1))[0]
    return _degenerate_fallback(w, mx[:, 0], tokens)


def _degenerate_fallback(w: np.ndarray, row_max: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Rows whose largest logit is not finite (all masked, NaN or +inf) take the argmax."""
    bad = ~np.isfinite(row_max)
    if bad.any():
        tokens = tokens.copy()
        tokens[bad] = np.argmax(w[bad], axis=1)
    return tokens
