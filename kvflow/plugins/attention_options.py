"""The optional attributes of ``kvflow::PagedAttention`` (``sliding_window``, ``logit_softcap``):
their check and the window's arithmetic, shared by every host implementation. No torch: the
NumPy and numba kernels import it."""

from __future__ import annotations

import math


def check_attention_options(sliding_window: int, logit_softcap: float) -> None:
    """Raise ValueError naming the attribute and its limit when either is out of range."""
    if isinstance(sliding_window, bool) or int(sliding_window) != sliding_window \
            or sliding_window < 0:
        raise ValueError(f"sliding_window must be an integer >= 0 (0 = no window), got "
                         f"{sliding_window!r}")
    if not math.isfinite(logit_softcap) or logit_softcap < 0:
        raise ValueError(f"logit_softcap must be a finite number >= 0 (0 = none), got "
                         f"{logit_softcap!r}")


def first_visible_key(position: int, sliding_window: int) -> int:
    """The first key position a query at ``position`` sees (0 without a window)."""
    return max(0, position - sliding_window + 1) if sliding_window > 0 else 0


def first_block(seq_len: int, new_tokens: int, sliding_window: int, block_size: int) -> int:
    """The first block-table column a sequence's step reads: the block of the first key its
    earliest new token sees. Columns before it may hold released blocks (block 0)."""
    return first_visible_key(seq_len - new_tokens, sliding_window) // block_size
