"""Verifying draft tokens: the rejection sampler. NumPy only.

Greedy rows accept a draft while it equals the target's argmax, so the output is the
non-speculative output token for token. Sampling rows use speculative sampling (Leviathan et
al., 2023; Chen et al., 2023): draft ``d`` at position ``j`` is accepted with probability
``min(1, p_j(d) / q_j(d))``; at the first rejection the token is drawn from
``norm(max(0, p_j - q_j))`` and the step ends; if every draft is accepted a bonus token is
drawn from ``p_k``. ``p_j`` is exactly the distribution the sampler would draw from at that
position (penalties over the output so far, drafts included; ``min_tokens``; the grammar's
mask; temperature, top-k, top-p, min-p), so every emitted token has the target's distribution.
A proposer with no distribution (n-gram) has a one-hot ``q``: accept with ``p_j(d)``, else
draw from ``p_j`` without ``d``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvflow.orchestrator.sampling.kernels import TOP_P_CANDIDATES, nucleus_size, top_n_sorted
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.orchestrator.sampling.sampler import Sampler, SamplingRow


def accept_greedy(targets: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a greedy row emits: the target's argmax at each position (``targets``,
    one more than ``drafts``) until the first that differs from its draft, that one included;
    all drafts and the bonus token when none differs."""
    out: list[int] = []
    for draft, target in zip(drafts, targets, strict=False):
        out.append(int(target))
        if target != draft:
            return out
    out.append(int(targets[len(drafts)]))
    return out


def target_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution the sampler draws from for one row (float64, summing to 1).

    ``logits``: the row after penalties, bans and the grammar's mask (float32, the vocabulary
    only), before the temperature. The same rules as the sampler's kernels: top_k first
    (ties to the lower id), then top_p over the renormalised top-k, then min_p.
    """
    x = logits.astype(np.float32) / np.float32(params.temperature)
    vocab = x.shape[0]
    mx = x.max()
    if not np.isfinite(mx):  # all masked, NaN or +inf: the sampler takes the argmax
        out = np.zeros(vocab)
        out[int(np.argmax(x))] = 1.0
        return out
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if not top_k and params.top_p >= 1.0:
        log_ratio = (x - mx).astype(np.float64)
        p = np.exp(log_ratio)
        if params.min_p > 0:
            p[log_ratio < np.log(params.min_p)] = 0.0
        return p / p.sum()
    if top_k:
        ids, vals = top_n_sorted(x[None], top_k)
    else:
        ids, vals = top_n_sorted(x[None], min(vocab, TOP_P_CANDIDATES))
        row_mass = np.exp(x - mx).sum(dtype=np.float64)
        if np.exp(vals - mx).sum(dtype=np.float64) < params.top_p * row_mass:
            ids, vals = top_n_sorted(x[None], vocab)
    log_ratio = vals.astype(np.float64) - float(vals[0, 0])
    probs = np.nan_to_num(np.exp(log_ratio), nan=0.0)
    cum = np.cumsum(probs, axis=1)
    total = cum[:, -1] if top_k else np.array([np.exp(x - mx).sum(dtype=np.float64)])
    keep = int(nucleus_size(probs, cum, total, np.array([params.top_p]), log_ratio,
                            np.array([params.min_p]))[0])
    out = np.zeros(vocab)
    out[ids[0, :keep]] = probs[0, :keep]
    return out / out.sum()


def draw(p: np.ndarray, u: float) -> int:
    """The token at the inverse CDF of distribution ``p`` (unnormalised) at ``u`` in [0, 1)."""
    cum = np.cumsum(p)
    j = int(np.searchsorted(cum, u * cum[-1], side="right"))
    if j >= len(p) or p[j] <= 0:  # rounding at the top end: the last token with mass
        j = int(np.flatnonzero(p > 0)[-1])
    return j


def verify(sampler: Sampler, logits: np.ndarray, row: SamplingRow, drafts: Sequence[int],
           masks: np.ndarray | Sequence[np.ndarray | None] | None = None,
           draft_probs: np.ndarray | None = None) -> list[int]:
    """The tokens one sequence emits after scoring its ``k`` drafts.

    ``logits``: the raw logits of the ``k + 1`` positions (the sequence's last token, then
    each draft); ``row``: the sequence's sampling row before the drafts; ``masks``: per
    position, its grammar's bitmask (None: unconstrained); ``draft_probs``: ``[k, vocab]``,
    the draft model's distribution at each position (None: one-hot, an n-gram's). Returns the
    accepted drafts and then one token drawn from the target (1 to ``k + 1`` tokens).
    """
    k = len(drafts)
    output = list(row.output_token_ids)
    rows = [SamplingRow(row.params, row.prompt_token_ids, [*output, *drafts[:j]], row.generator,
                        None if masks is None else masks[j]) for j in range(k + 1)]
    work = sampler.processed_logits(logits, rows)
    params = row.params
    if params.is_greedy:
        return accept_greedy(np.argmax(work, axis=1).tolist(), drafts)
    gen = row.generator
    out: list[int] = []
    for j, d in enumerate(drafts):
        p = target_distribution(work[j], params)
        q = None if draft_probs is None else np.asarray(draft_probs[j], dtype=np.float64)
        q_d = 1.0 if q is None else float(q[d])
        # Accept with min(1, p/q): u * q < p, u uniform in [0, 1).
        if gen.random() * q_d < p[d]:
            out.append(int(d))
            continue
        if q is None:
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - q[:len(p)], 0.0)
        if not residual.sum() > 0:  # p is q where q has mass: only rounding rejected d
            residual = p
        out.append(draw(residual, gen.random()))
        return out
    out.append(draw(target_distribution(work[k], params), gen.random()))
    return out
