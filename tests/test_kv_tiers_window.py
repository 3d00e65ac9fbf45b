"""Tier restores under a sliding window: a windowed prefix hit needs only the blocks its next
token's window reaches, so a restore loads those the pool lacks (all or none), and what the
sequence then reads is the KV its own prefix wrote.

The runner is the window tests' provenance runner (each KV slot holds a hash of the prefix that
wrote it, and it checks every slot a query reads), with its KV copied out and back as bytes: a
block restored from the host tier with another prefix's KV, or a hole in the window, fails
there; and the tokens match a roomy pool that never releases nor evicts."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvflow import SamplingParams
from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.options import EngineOptions
from kvflow.sim.runner import SIM_EOS
from tests.helpers import drive_arrivals
from tests.test_kv_window_engine import BLOCK, WindowProvenanceRunner

ROW = 2  # int64 values per slot: (prefix hash, token)


class TieredProvenanceRunner(WindowProvenanceRunner):
    """The provenance runner whose blocks the KV tiers can copy out and back."""

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        return [self.dev[b * BLOCK:(b + 1) * BLOCK].tobytes() for b in block_ids]

    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        for b, payload in zip(block_ids, payloads, strict=True):
            self.dev[b * BLOCK:(b + 1) * BLOCK] = np.frombuffer(
                payload, dtype=np.int64).reshape(BLOCK, ROW)


def run(requests, window, num_blocks, release=True, **options):  # type: ignore[no-untyped-def]
    """Final token ids per request (or "rejected"), and the tier hits by medium."""
    runner = TieredProvenanceRunner(window, num_blocks, 8, release)
    config = EngineOptions(**{"max_num_seqs": 6, "max_num_batched_tokens": 12,
                              "max_model_len": 160, "debug_checks": True,
                              "enable_prefix_caching": True, "kv_watermark": 0.0, **options})
    engine = LLMEngine(runner, None, config, (SIM_EOS,), clock=runner.clock)
    try:
        results = {rid: o if o == "rejected" else ([c.token_ids for c in o.outputs],
                                                   o.cached_tokens)
                   for rid, o in drive_arrivals(engine, requests).items()}
        engine.kv.check_integrity()
        tiers = engine.kv.tiers
        hits = {m: c.hits for m, c in tiers.counters.items()} if tiers is not None else {}
    finally:
        engine.close()
    return results, hits


def tokens(results):  # type: ignore[no-untyped-def]
    return {rid: r if r == "rejected" else r[0] for rid, r in results.items()}


def test_a_windowed_prefix_evicted_to_the_host_tier_is_restored_and_reads_its_own_kv():
    # a's 40-token prompt is cached, then x's fill the 13 usable blocks and evict it to the
    # host tier; b, with a's prompt, restores the blocks its window reaches (window 6: 2).
    prompt = [1 + (k * 7) % 5 for k in range(40)]
    reqs = [("a", prompt, SamplingParams(max_tokens=6, ignore_eos=True, seed=1), 0),
            ("x", [2 + k % 3 for k in range(44)],
             SamplingParams(max_tokens=4, ignore_eos=True, seed=2), 12),
            ("b", prompt, SamplingParams(max_tokens=6, ignore_eos=True, seed=1), 40)]
    tight, hits = run(reqs, window=6, num_blocks=14, kv_offload_bytes=1 << 20)
    roomy, _ = run(reqs, window=6, num_blocks=400, release=False)
    untiered, _ = run(reqs, window=6, num_blocks=14)
    assert hits == {"cpu": 2}
    assert tight["b"][1] == 36 and untiered["b"][1] == 0  # 9 blocks hit, 2 of them restored
    assert tokens(tight) == tokens(roomy) and tight["a"][0] == tight["b"][0]


# Requests of two prompt families (some lengths share long prefixes), arriving over time.
WORKLOADS = st.lists(st.tuples(st.integers(8, 40), st.integers(1, 2), st.integers(1, 12),
                               st.integers(0, 60), st.integers(0, 1)), min_size=2, max_size=7)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=WORKLOADS, window=st.sampled_from([3, 5, 8, 13]),
       num_blocks=st.integers(10, 24), tier_blocks=st.integers(1, 12), seed=st.integers(0, 99))
def test_windowed_restores_never_change_what_a_sequence_reads(workload, window, num_blocks,
                                                               tier_blocks, seed):
    def requests():  # type: ignore[no-untyped-def]
        return [(f"r{i}", [1 + (k * (1 + j)) % 5 for k in range(plen)],
                 SamplingParams(n=n, max_tokens=max_tokens, seed=seed + i), at)
                for i, (plen, n, max_tokens, at, j) in enumerate(workload)]
    tight, hits = run(requests(), window, num_blocks,
                      kv_offload_bytes=tier_blocks * BLOCK * ROW * 8)
    event(f"blocks restored: {'yes' if hits['cpu'] else 'no'}")
    roomy, _ = run(requests(), window, 600, release=False)
    for rid, got in tokens(tight).items():
        if got != "rejected":
            assert got == tokens(roomy)[rid], rid
