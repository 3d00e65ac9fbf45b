"""The multi-LoRA product in PyTorch: the reference the PyTorch runner applies to its linears
(segmented GEMMs, one per adapter in the step, as Punica's SGMV groups tokens by adapter).

A step's tokens are grouped once by slot (:func:`slot_segments`); each hooked linear then adds,
for each slot's rows, ``(x A[s, :r]^T) Bt[s, :r]`` to its output, ``r`` the slot's rank for that
module (0: nothing). The pool layout is :mod:`kvflow.runtime.lora_pool`'s for a one-module group:
``A [slots, max_rank, in]``, ``Bt [slots, max_rank, out]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

Segments = list[tuple[int, torch.Tensor]]


def slot_segments(slots: np.ndarray, device: torch.device | str = "cpu") -> Segments:
    """``(slot, rows)`` for each slot >= 0 that tokens of the step use, ``rows`` int64 indices
    into the packed batch (on ``device``)."""
    out: Segments = []
    for s in np.unique(slots):
        if s >= 0:
            rows = np.flatnonzero(slots == s)
            out.append((int(s), torch.from_numpy(rows).to(device)))
    return out


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
               segments: Segments, ranks: Sequence[int]) -> torch.Tensor:
    """``y`` plus each segment's LoRA product (in ``a``'s dtype, added in ``y``'s); ``ranks``
    each slot's rank for this module. ``y`` is not modified."""
    out = y.clone()
    for s, rows in segments:
        r = int(ranks[s])
        if r == 0:
            continue
        xs = x.index_select(0, rows).to(a.dtype)
        delta = (xs @ a[s, :r].T) @ bt[s, :r]
        out.index_add_(0, rows, delta.to(y.dtype))
    return out
