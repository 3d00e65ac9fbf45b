"""Sliding-window release through the engine: a runner that attends only within the window,
whose KV slots hold a hash of the prefix that wrote them and whose logits are drawn from what
it reads, gives the same tokens on a tight pool that releases blocks (and preempts, swaps,
forks, hits the prefix cache) as on a roomy pool that never releases one."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import SamplingParams
from kvflow.build.engine_config import BuildLimits, EngineConfig
from kvflow.model.config import ModelConfig
from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.options import EngineOptions
from kvflow.sim.cost_model import FixedCostModel
from kvflow.sim.runner import SIM_EOS, SIM_VOCAB, SimClock, SimRunner
from tests.helpers import drive_arrivals

_MOD = (1 << 61) - 1
BLOCK = 4


def windowed_engine_config(window: int, max_model_len: int = 160) -> EngineConfig:
    """A Mistral-style model (every layer windowed) the runner below never really runs."""
    model = ModelConfig(architecture="mistral", vocab_size=SIM_VOCAB, hidden_size=8,
                        intermediate_size=8, num_hidden_layers=2, num_attention_heads=1,
                        num_key_value_heads=1, head_dim=8, eos_token_ids=(SIM_EOS,),
                        sliding_window=window)
    return EngineConfig(model, "torch", "float32", BuildLimits(max_model_len, 16, 8, BLOCK),
                        {"name": "simulated"}, {})


class WindowProvenanceRunner(SimRunner):
    """Each KV slot holds (hash of the prefix up to it, its token). A query at ``p`` reads the
    slots of ``p - W < j < p``: the runner checks they are written, in real blocks, and chain
    (each slot's hash follows from the one before and its token), and draws the logits from
    the hash it reaches, which depends on the first slot read, hence on the whole prefix.
    ``release=False`` reports no window to the engine (its KV manager then releases nothing),
    while attention still reads only the window: the reference."""

    needs_inputs = True

    def __init__(self, window: int, num_blocks: int, num_host_blocks: int,
                 release: bool = True) -> None:
        super().__init__(windowed_engine_config(window), num_blocks, FixedCostModel(1.0),
                         SimClock())
        self.window, self.release = window, release
        self.num_host_blocks = num_host_blocks
        self.dev = np.zeros((num_blocks * BLOCK, 2), dtype=np.int64)
        self.host = np.zeros(((num_host_blocks + 1) * BLOCK, 2), dtype=np.int64)
        self.max_blocks_held = 0  # the most real blocks one sequence's table held in a step

    @property
    def sliding_window(self) -> int | None:
        return self.window if self.release else None

    def _copy(self, src: np.ndarray, dst: np.ndarray, pairs) -> None:  # type: ignore[no-untyped-def]
        saved = [src[s * BLOCK:(s + 1) * BLOCK].copy() for s, _ in pairs]
        for (_, d), block in zip(pairs, saved, strict=True):
            dst[d * BLOCK:(d + 1) * BLOCK] = block

    def copy_blocks(self, pairs):  # type: ignore[no-untyped-def]
        self._copy(self.dev, self.dev, pairs)

    def swap_out(self, pairs):  # type: ignore[no-untyped-def]
        self._copy(self.dev, self.host, pairs)

    def swap_in(self, pairs):  # type: ignore[no-untyped-def]
        self._copy(self.host, self.dev, pairs)

    def execute(self, step):  # type: ignore[no-untyped-def]
        super().execute(step)
        rows = []
        for i in range(step.num_seqs):
            q0, q1 = int(step.query_start_loc[i]), int(step.query_start_loc[i + 1])
            nb = -(-int(step.seq_lens[i]) // BLOCK)
            table = step.block_tables[i][:nb]
            self.max_blocks_held = max(self.max_blocks_held, int(np.count_nonzero(table)))
            start = int(step.positions[q0])
            first = max(0, start - self.window + 1)  # the first query's window
            prev = 0
            for p in range(first, start):
                block = int(table[p // BLOCK])
                assert block != 0, f"sequence {i} reads position {p} from the null block"
                h, token = self.dev[block * BLOCK + p % BLOCK]
                assert h != 0, f"sequence {i} reads position {p}: never written"
                if p > first:
                    assert h == (prev * 1_000_003 + int(token) + 1) % _MOD, (
                        f"sequence {i} reads position {p}: KV of another prefix")
                prev = int(h)
            for k in range(q0, q1):
                p, token = int(step.positions[k]), int(step.input_ids[k])
                prev = (prev * 1_000_003 + token + 1) % _MOD
                self.dev[int(table[p // BLOCK]) * BLOCK + p % BLOCK] = (prev, token)
            rows.append(prev)
        last = {int(q) - 1: h for q, h in zip(step.query_start_loc[1:], rows, strict=True)}
        logits = [np.random.default_rng(last[int(k)]).normal(size=SIM_VOCAB)
                  for k in step.logits_indices]
        return np.array(logits, dtype=np.float32).reshape(-1, SIM_VOCAB)

    def execute_argmax(self, step):  # type: ignore[no-untyped-def]
        return self.execute(step).argmax(axis=1)  # SimRunner's would skip the KV


def run(requests, window, num_blocks, num_host_blocks=8, release=True, **options):  # type: ignore[no-untyped-def]
    """Final token ids per (request, sequence), or "rejected", and the runner."""
    runner = WindowProvenanceRunner(window, num_blocks, num_host_blocks, release)
    config = EngineOptions(**{"max_num_seqs": 6, "max_num_batched_tokens": 12,
                              "max_model_len": 160, "debug_checks": True, **options})
    engine = LLMEngine(runner, None, config, (SIM_EOS,), clock=runner.clock)
    assert engine.kv.sliding_window == (window if release else None)
    results = {rid: o if o == "rejected" else [c.token_ids for c in o.outputs]
               for rid, o in drive_arrivals(engine, requests).items()}
    assert engine.kv.pool.num_used_blocks == 0
    return results, runner


def test_a_sequence_longer_than_the_pool_runs_in_its_window_and_matches_the_reference():
    # 9 usable blocks hold 36 tokens; the sequence is 30 + 50 = 80 tokens long. Without the
    # window it would be refused; with it, it holds at most ceil((W - 1 + 12) / 4) + 1 blocks.
    prompt = [1 + (k * 3) % 5 for k in range(30)]
    params = SamplingParams(max_tokens=50, ignore_eos=True, seed=3)
    tight, runner = run([("a", prompt, params, 0)], window=8, num_blocks=10)
    roomy, reference = run([("a", prompt, params, 0)], window=8, num_blocks=400, release=False)
    assert tight["a"] != "rejected" and len(tight["a"][0]) == 50
    assert tight == roomy
    assert runner.max_blocks_held <= 6 < reference.max_blocks_held


def test_a_prefix_hit_under_the_window_reads_the_same_kv():
    # b arrives after a finished with the same 40-token prompt: its hit ends with the blocks
    # its window reaches (a's early blocks were released and may be evicted).
    prompt = [1 + (k * 7) % 5 for k in range(40)]
    reqs = [("a", prompt, SamplingParams(max_tokens=6, ignore_eos=True, seed=1), 0),
            ("x", [2] * 20, SamplingParams(max_tokens=4, ignore_eos=True, seed=2), 12),
            ("b", prompt, SamplingParams(max_tokens=6, ignore_eos=True, seed=1), 20)]
    tight, _ = run(reqs, window=6, num_blocks=14, kv_watermark=0.0)
    roomy, _ = run(reqs, window=6, num_blocks=400, release=False)
    assert tight == roomy and tight["a"] == tight["b"]


WORKLOADS = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 3), st.integers(1, 40),
                               st.integers(0, 8), st.integers(0, 3)), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=WORKLOADS, window=st.sampled_from([3, 5, 8, 13]),
       mode=st.sampled_from(["recompute", "swap", "auto"]), caching=st.booleans(),
       num_blocks=st.integers(8, 24), step_tokens=st.sampled_from([4, 12]),
       seed=st.integers(0, 99))
def test_release_preemption_swaps_and_forks_never_change_what_a_sequence_reads(
        workload, window, mode, caching, num_blocks, step_tokens, seed):
    def requests():  # type: ignore[no-untyped-def]
        return [(f"r{i}", [1 + (k * (1 + j)) % 5 for k in range(plen)],
                 SamplingParams(n=n, max_tokens=max_tokens, seed=seed + i), at)
                for i, (plen, n, max_tokens, at, j) in enumerate(workload)]
    options = {"preemption_mode": mode, "enable_prefix_caching": caching, "kv_watermark": 0.0,
               "max_num_batched_tokens": step_tokens}
    tight, _ = run(requests(), window, num_blocks, **options)
    roomy, _ = run(requests(), window, 600, release=False, **options)
    for rid, got in tight.items():
        if got != "rejected":
            assert got == roomy[rid], rid


def test_a_group_is_refused_only_when_its_windows_cannot_fit_the_pool_together():
    # n = 3 sequences of 20 + 40 tokens: 45 blocks at full length, but in a window of 8 each
    # holds at most ceil((7 + 12) / 4) + 1 = 6 blocks, so 18 blocks hold the group.
    prompt = [1 + (k * 2) % 5 for k in range(20)]
    group = [("g", prompt, SamplingParams(n=3, max_tokens=40, ignore_eos=True, seed=5), 0)]
    tight, _ = run(group, window=8, num_blocks=19)
    roomy, _ = run(group, window=8, num_blocks=400, release=False)
    assert tight == roomy and len(tight["g"]) == 3
    refused, _ = run(group, window=8, num_blocks=18)  # 17 usable blocks
    assert refused == {"g": "rejected"}


def test_a_recomputed_group_leader_hits_no_further_than_its_members_fork():
    # g is preempted by recompute well into its outputs; its leader's own outputs are cached,
    # but a hit past its prompt would release the blocks its members see when they fork off
    # it at the prompt's end: the hit stops at the prompt.
    reqs = [("x", [1 + k % 4 for k in range(6)],
             SamplingParams(max_tokens=60, ignore_eos=True, seed=1), 0),
            ("g", [2 + k % 3 for k in range(5)],
             SamplingParams(n=2, max_tokens=40, ignore_eos=True, seed=2), 1)]
    options = {"preemption_mode": "recompute", "kv_watermark": 0.0, "max_num_batched_tokens": 4}
    tight, _ = run(reqs, 8, 9, **options)
    roomy, _ = run(reqs, 8, 400, release=False, **options)
    assert tight == roomy and len(tight["g"]) == 2


def test_static_batching_reserves_whole_sequences_so_the_pool_must_hold_them():
    # Static batching allocates prompt + max_tokens up front and releases nothing: a sequence
    # longer than the pool is refused at once rather than left waiting forever.
    prompt = [1 + (k * 3) % 5 for k in range(30)]
    long = [("a", prompt, SamplingParams(max_tokens=50, ignore_eos=True, seed=3), 0)]
    refused, _ = run(long, window=8, num_blocks=10, policy="static")
    assert refused == {"a": "rejected"}
    short = [("b", prompt[:12], SamplingParams(max_tokens=20, ignore_eos=True, seed=3), 0)]
    static, _ = run(short, window=8, num_blocks=10, policy="static")
    roomy, _ = run(short, window=8, num_blocks=400, release=False)
    assert static == roomy
