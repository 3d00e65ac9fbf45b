"""The sampler's coupled draw: an exponential race (the Gumbel-max trick) with noise keyed by
the row's one uniform. NumPy only.

A row that draws the number ``u`` picks, among the tokens its filters keep, the one that
maximises ``logit / temperature + g(u, token)``, where ``g`` is Gumbel noise that depends on
``u`` and the token id alone (splitmix64 of the two). That is an exact draw from the kept
tokens' softmax, as the inverse CDF is; unlike the inverse CDF, two close distributions
drawn with the same ``u`` pick the same token with probability near ``1 - TV`` (at least
``(1 - TV) / (1 + TV)``), because a token's noise does not depend on the other tokens'
masses or order. Speculative decoding's draft model draws its drafts this way with the
uniforms the target will use (:mod:`~kvflow.orchestrator.speculative.draft_model`), so its
drafts are accepted about as often as under rejection sampling, while every emitted token
stays the target's own draw.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
# The id whose hash decides, on the dense path, between the candidate set and the rest of
# the row: past any vocabulary.
SPLIT_ID = 1 << 40


def race_keys(u: np.ndarray) -> np.ndarray:
    """Each row's noise key: the 64 bits of its uniform (float64)."""
    return np.ascontiguousarray(u, dtype=np.float64).view(np.uint64)


def keyed_uniforms(key: np.uint64, ids: np.ndarray) -> np.ndarray:
    """Uniforms in (0, 1), float64, one per token id: a function of ``(key, id)`` alone."""
    z = np.asarray(ids).astype(np.uint64) * _GOLDEN + key  # uint64 arrays wrap around
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def race(ids: np.ndarray, scores: np.ndarray, key: np.uint64) -> int:
    """The token of ``ids`` maximising ``scores + Gumbel(key, id)`` (scores: log-probabilities
    up to a constant; -inf never wins unless all are)."""
    noise = -np.log(-np.log(keyed_uniforms(key, ids)))
    return int(ids[int(np.argmax(np.asarray(scores, dtype=np.float64) + noise))])


def race_sorted(ids: np.ndarray, log_ratio: np.ndarray, keep: np.ndarray,
                keys: np.ndarray) -> np.ndarray:
    """Per row, the race among its first ``keep[r]`` candidates (``ids``, sorted most likely
    first, ``log_ratio`` their log-probabilities up to a constant)."""
    return np.array([race(ids[r, :keep[r]], log_ratio[r, :keep[r]], keys[r])
                     for r in range(ids.shape[0])], dtype=np.int64)
