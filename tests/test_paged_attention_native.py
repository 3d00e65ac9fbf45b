"""The compiled host PagedAttention kernel (numba) against the PyTorch reference."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvflow.plugins.paged_attention_native import (  # noqa: E402
    PARALLEL_MIN_KEY_READS,
    paged_attention_native,
)
from kvflow.plugins.paged_attention_ref import paged_attention_ref, random_step  # noqa: E402
from tests.helpers import run_host_attention  # noqa: E402

MIXED = [(0, 37), (5, 1), (100, 1), (64, 20), (0, 1), (31, 33), (16, 1)]


def run_both(seqs, heads, kv_heads, head_dim, block_size, seed=0, pad_token=None):
    step = random_step(seqs, heads, kv_heads, head_dim, block_size, torch.float32,
                       torch.Generator().manual_seed(seed))
    if pad_token is not None:
        step["slot_mapping"][pad_token] = -1
    out, k_cache, v_cache = run_host_attention(paged_attention_native, step, heads, kv_heads,
                                               head_dim)
    t = step["q"].shape[0]
    ref = paged_attention_ref(**step).reshape(t, -1).numpy()
    return out, ref, (k_cache, v_cache), (step["k_cache"].numpy(), step["v_cache"].numpy())


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [
    (4, 4, 32, 16),   # MHA
    (9, 3, 64, 16),   # SmolLM2's GQA group of 3
    (8, 2, 32, 4),    # small blocks
])
def test_prefill_chunks_and_decodes_in_one_call_match_the_reference(heads, kv_heads,
                                                                    head_dim, block_size):
    out, ref, ours_cache, ref_cache = run_both(MIXED, heads, kv_heads, head_dim, block_size)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(ours_cache, ref_cache, strict=True):  # K/V written where the reference did
        np.testing.assert_array_equal(a, b)


def test_padding_slot_is_not_written():
    out, ref, ours_cache, ref_cache = run_both([(10, 3), (0, 1), (40, 1)], 8, 2, 64, 16,
                                               seed=3, pad_token=1)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(ours_cache, ref_cache, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_batch_large_enough_for_the_parallel_kernel_matches_too():
    seqs = [(300, 1)] * 16 + [(200, 40)]
    reads = sum((c + n) * n for c, n in seqs) * 2
    assert reads >= PARALLEL_MIN_KEY_READS
    out, ref, _, _ = run_both(seqs, 8, 2, 32, 16, seed=5)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_unregistered_pool_address_is_a_clear_error():
    q = np.zeros((1, 16), np.float32)
    kv = np.zeros((1, 8), np.float32)
    with pytest.raises(KeyError, match="no registered KV pool"):
        paged_attention_native(q, kv, kv, np.array([[12345, 678]], np.int64),
                               np.array([0], np.int64), np.zeros((1, 1), np.int32),
                               np.array([1], np.int32), np.array([0, 1], np.int32),
                               layer_idx=0, num_heads=2, num_kv_heads=1, head_dim=8,
                               scale=1.0)
