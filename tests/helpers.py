"""Small factories the tests share."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvflow.kv_manager import KVCacheManager
from kvflow.runtime.base import ModelRunner
from kvflow.runtime.step_builder import SeqChunk, build_step


def greedy_generate(runner: ModelRunner, prompt: Sequence[int], max_new: int,
                    chunk: int | None = None) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens of one sequence run alone (prefill in chunks of ``chunk`` tokens)."""
    kv = KVCacheManager(runner.num_blocks, runner.engine.limits.block_size)
    seq, logits_seen = list(prompt), []
    done = 0
    try:
        while len(seq) - len(prompt) < max_new:
            n = len(seq) - done if chunk is None else min(chunk, len(seq) - done)
            assert kv.allocate_slots("s", done + n)
            sample = done + n == len(seq)
            logits = runner.execute(build_step(kv, [SeqChunk("s", seq, done, n, sample)]))
            done += n
            if sample:
                logits_seen.append(logits[0])
                seq.append(int(np.argmax(logits[0])))
    finally:
        kv.free("s")
    return seq[len(prompt):], logits_seen


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_or_near_tie(ours: Sequence[int], ref: Sequence[int],
                            ref_logits: Sequence[np.ndarray], tol: float = 1e-4) -> None:
    """Token lists equal, or they first differ where the reference's top two are within tol."""
    i = first_divergence(ours, ref)
    if i is None:
        return
    top2 = np.sort(np.asarray(ref_logits[i], dtype=np.float64))[-2:]
    gap = float(top2[1] - top2[0])
    assert gap <= tol, (
        f"diverged at token {i}: ours {ours[i]} vs reference {ref[i]}, reference top-2 gap "
        f"{gap:.3g} > {tol} (not a near-tie)"
    )
