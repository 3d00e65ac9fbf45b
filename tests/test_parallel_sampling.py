"""Parallel sampling (``n > 1``): one prefill, n sequences forked off its KV blocks by reference
count, copy on write of the partial block, and a group preempted, swapped and aborted as one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import SamplingParams
from kvflow.kv_manager import KVCacheManager
from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.request import RequestStatus
from kvflow.sim.cost_model import FixedCostModel
from kvflow.sim.runner import SIM_EOS, SIM_VOCAB, SimClock, SimRunner, sim_engine_config
from tests.helpers import drive_arrivals

# --- the KV manager: fork and copy on write ---------------------------------------------------


def test_fork_shares_blocks_and_the_partial_block_is_copied_on_first_write():
    kv = KVCacheManager(16, 4)
    assert kv.allocate_slots("p", 10)  # blocks for tokens 0..9: two full, one partial
    parent = list(kv.block_tables["p"])
    kv.fork("p", "c", 10)
    assert kv.block_tables["c"] == parent
    assert [kv.pool.ref_counts[b] for b in parent] == [2, 2, 2]
    kv.check_integrity()
    # The child writes token 10 into the shared partial block: it gets a copy of its own.
    assert kv.allocate_slots("c", 11, num_computed_tokens=10)
    child = kv.block_tables["c"]
    assert child[:2] == parent[:2] and child[2] != parent[2]
    assert kv.take_copies() == [(parent[2], child[2])] and kv.take_copies() == []
    # The parent is now the partial block's only holder: it writes in place.
    assert kv.allocate_slots("p", 11, num_computed_tokens=10)
    assert kv.block_tables["p"] == parent and kv.take_copies() == []
    kv.check_integrity()
    kv.free("p")
    kv.free("c")
    assert kv.pool.num_used_blocks == 0


def test_fork_at_a_block_boundary_copies_nothing():
    kv = KVCacheManager(16, 4)
    assert kv.allocate_slots("p", 8)
    kv.fork("p", "c", 8)
    assert kv.allocate_slots("c", 9, num_computed_tokens=8)
    assert kv.take_copies() == [] and len(kv.block_tables["c"]) == 3
    kv.check_integrity()


def test_a_group_swaps_its_shared_blocks_once_and_shares_them_again():
    kv = KVCacheManager(16, 4, num_host_blocks=8)
    assert kv.allocate_slots("a", 9)
    kv.fork("a", "b", 9)
    assert kv.allocate_slots("b", 10, num_computed_tokens=9)  # b's own copy of block 2
    kv.take_copies()
    out = kv.swap_out_many([("a", 10), ("b", 10)])
    assert len(out) == 4  # two shared blocks, and one partial block each
    assert kv.host_pool is not None and kv.host_pool.num_used_blocks == 4
    kv.check_integrity()
    back = kv.swap_in_many([("a", 11), ("b", 10)])
    assert back is not None and len(back) == 4
    a, b = kv.block_tables["a"], kv.block_tables["b"]
    assert a[:2] == b[:2] and a[2] != b[2]
    assert kv.host_pool.num_used_blocks == 0
    kv.check_integrity()


# --- the engine's lifecycle of a group, on the simulated runner -------------------------------


class RandomLogitsRunner(SimRunner):
    """The simulator's runner with seeded random logits (so sequences diverge and some end at
    EOS) and a swap space whose copies are no-ops (the simulated pool holds no data)."""

    def __init__(self, num_blocks: int, num_host_blocks: int, seed: int) -> None:
        engine = sim_engine_config(4, 128, 32, 8)
        super().__init__(engine, num_blocks, FixedCostModel(1.0), SimClock())
        self.num_host_blocks = num_host_blocks
        self.rng = np.random.default_rng(seed)

    def execute(self, step):  # type: ignore[no-untyped-def]
        super().execute(step)
        return self.rng.normal(size=(len(step.logits_indices), SIM_VOCAB)).astype(np.float32)

    def swap_out(self, pairs):  # type: ignore[no-untyped-def]
        pass

    def swap_in(self, pairs):  # type: ignore[no-untyped-def]
        pass


def make_sim_engine(num_blocks=24, num_host_blocks=0, seed=0, **options) -> LLMEngine:
    runner = RandomLogitsRunner(num_blocks, num_host_blocks, seed)
    config = EngineOptions(**{"max_num_seqs": 8, "max_num_batched_tokens": 32,
                              "max_model_len": 128, "debug_checks": True, **options})
    return LLMEngine(runner, None, config, (SIM_EOS,), clock=runner.clock)


def test_a_group_finishes_when_its_last_sequence_does():
    engine = make_sim_engine(enable_prefix_caching=False)
    engine.add_request(list(range(1, 11)), SamplingParams(n=3, max_tokens=5, seed=1),
                       request_id="g")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert all(o.request_id == "g" for o in outputs)
    assert [o.finished for o in outputs].count(True) == 1 and outputs[-1].finished
    last = outputs[-1]
    assert [c.index for c in last.outputs] == [0, 1, 2]
    for c in last.outputs:
        assert c.finish_reason in ("stop", "length") and 1 <= len(c.token_ids) <= 5
    # The first step computed the prompt once and gave all three their first token.
    assert engine.step_stats[0].num_prefill_tokens == 10
    assert all(len(c.delta_token_ids) == 1 for c in outputs[0].outputs)
    assert engine.kv.pool.num_used_blocks == 0


def test_n_above_max_num_seqs_is_refused_by_name():
    engine = make_sim_engine(max_num_seqs=4)
    _, rejected = engine.add_request([1, 2, 3], SamplingParams(n=5), request_id="g")
    assert rejected is not None and rejected.finished and "n is 5; max_num_seqs is 4" in (
        rejected.error or "")
    assert [c.finish_reason for c in rejected.outputs] == ["rejected"] * 5


def test_aborting_a_group_frees_every_sequence():
    engine = make_sim_engine(enable_prefix_caching=False)
    engine.add_request(list(range(1, 11)), SamplingParams(n=4, max_tokens=12, ignore_eos=True),
                       request_id="g")
    engine.step()
    engine.step()
    assert len(engine.scheduler.running) == 4
    out = engine.abort_request("g")
    assert out is not None and out.finished and out.aborted
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 4
    assert engine.kv.pool.num_used_blocks == 0 and not engine.scheduler.groups


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_group_leaves_and_comes_back_together(mode):
    # 14 usable blocks of 4; two groups of 3 with 8-token prompts grow past them.
    engine = make_sim_engine(num_blocks=15, num_host_blocks=64, preemption_mode=mode,
                             enable_prefix_caching=False, kv_watermark=0.0)
    for rid in "ab":
        engine.add_request(list(range(1, 9)), SamplingParams(n=3, max_tokens=12,
                                                             ignore_eos=True), request_id=rid)
    finished = {}
    preempted_together = False
    while engine.has_unfinished_requests():
        preemptions = engine.counters.preemptions
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
        if engine.counters.preemptions > preemptions:  # this step preempted (ran or not)
            sched = engine.scheduler
            for group in sched.groups.values():
                states = {m.status for m in group.unfinished}
                # Never some sequences of a group running while others are preempted.
                assert not ({RequestStatus.RUNNING, RequestStatus.PREEMPTED} <= states)
            preempted_together = True
    assert preempted_together, "the small pool forced no preemption"
    for rid in "ab":
        assert [len(c.token_ids) for c in finished[rid].outputs] == [12, 12, 12]
    assert engine.kv.pool.num_used_blocks == 0
    if engine.kv.host_pool is not None:
        assert engine.kv.host_pool.num_used_blocks == 0


ACTIONS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 4), st.integers(1, 16)),
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("abort"), st.integers(0, 20)),
), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=ACTIONS, mode=st.sampled_from(["recompute", "swap", "auto"]),
       caching=st.booleans(), seed=st.integers(0, 1000))
def test_random_forks_aborts_and_preemptions_keep_the_pool_whole(actions, mode, caching, seed):
    """Random groups, steps and aborts on a pool small enough to preempt: the invariants hold
    after every step (debug checks), every output has its n sequences, and every block comes
    back."""
    engine = make_sim_engine(num_blocks=20, num_host_blocks=12, seed=seed, preemption_mode=mode,
                             enable_prefix_caching=caching, kv_watermark=0.0)
    ids: list[str] = []
    n_of: dict[str, int] = {}
    finals = {}
    admitted = []

    def record(outs):
        for o in outs:
            assert len(o.outputs) == n_of[o.request_id]
            if o.finished:
                assert o.request_id not in finals
                finals[o.request_id] = o

    for action in actions:
        if action[0] == "add":
            _, prompt_len, n, max_tokens = action
            rid = f"r{len(ids)}"
            ids.append(rid)
            n_of[rid] = n
            # Prompts share their first tokens, so prefix caching has something to share.
            request, rejected = engine.add_request([1 + (i % 5) for i in range(prompt_len)],
                                                   SamplingParams(n=n, max_tokens=max_tokens,
                                                                  seed=seed), request_id=rid)
            admitted.append(request)
            if rejected is not None:
                record([rejected])
        elif action[0] == "step":
            for _ in range(action[1]):
                if engine.has_unfinished_requests():
                    record(engine.step())
        elif ids:
            out = engine.abort_request(ids[action[1] % len(ids)])
            if out is not None:
                record([out])
        engine.scheduler.check_integrity()
    while engine.has_unfinished_requests():
        record(engine.step())
    assert set(finals) == set(ids)
    for o in finals.values():
        for c in o.outputs:
            assert c.finish_reason in ("stop", "length", "abort", "rejected")
    assert engine.kv.pool.num_used_blocks == 0
    assert engine.kv.host_pool is not None and engine.kv.host_pool.num_used_blocks == 0
    assert not engine.scheduler.groups and not engine.scheduler.requests
    # Every sequence's output state went with its request's final output.
    assert all(seq.engine_state is None for r in admitted
               for seq in (r.group.seqs if r.group else [r]))


# --- KV contents: a runner whose logits are a function of what it reads ---------------------

_MOD = (1 << 61) - 1


class ProvenanceRunner(SimRunner):
    """Holds, in every KV slot, the token written there and a hash of the whole prefix up to
    it, as a real model's KV depends on the whole prefix. Each step it checks that every slot
    a sequence reads holds a prefix consistent with the slots before it (never a slot nobody
    wrote), and its logits are drawn from the hash of everything read: KV that came from the
    wrong sequence, or a copy or swap made in the wrong order, changes the tokens."""

    needs_inputs = True  # it reads the tokens, positions and block tables (SimRunner does not)

    def __init__(self, num_blocks: int, num_host_blocks: int, block_size: int = 4) -> None:
        engine = sim_engine_config(block_size, 128, 32, 8)
        super().__init__(engine, num_blocks, FixedCostModel(1.0), SimClock())
        self.num_host_blocks = num_host_blocks
        self.bs = block_size
        self.dev = np.zeros((num_blocks * block_size, 2), dtype=np.int64)  # (hash, token)
        self.host = np.zeros(((num_host_blocks + 1) * block_size, 2), dtype=np.int64)

    def _blocks(self, a: np.ndarray, b: int) -> np.ndarray:
        return a[b * self.bs:(b + 1) * self.bs]

    def _copy(self, src: np.ndarray, dst: np.ndarray, pairs) -> None:  # type: ignore[no-untyped-def]
        assert len({d for _, d in pairs}) == len(pairs), f"copies share a destination: {pairs}"
        saved = [self._blocks(src, s).copy() for s, _ in pairs]
        for (_, d), block in zip(pairs, saved, strict=True):
            self._blocks(dst, d)[:] = block

    def copy_blocks(self, pairs):  # type: ignore[no-untyped-def]
        self._copy(self.dev, self.dev, pairs)

    def swap_out(self, pairs):  # type: ignore[no-untyped-def]
        self._copy(self.dev, self.host, pairs)

    def swap_in(self, pairs):  # type: ignore[no-untyped-def]
        self._copy(self.host, self.dev, pairs)

    def execute(self, step):  # type: ignore[no-untyped-def]
        super().execute(step)
        bs, rows = self.bs, []
        for i in range(step.num_seqs):
            q0, q1 = int(step.query_start_loc[i]), int(step.query_start_loc[i + 1])
            table = step.block_tables[i]
            start = int(step.positions[q0])
            prev = 0
            for p in range(start):  # what attention reads
                h, token = self.dev[table[p // bs] * bs + p % bs]
                assert h == (prev * 1_000_003 + int(token) + 1) % _MOD, (
                    f"sequence {i} reads position {p}: KV of another prefix (or none)")
                prev = int(h)
            for k in range(q0, q1):  # what this step writes
                p, token = int(step.positions[k]), int(step.input_ids[k])
                prev = (prev * 1_000_003 + token + 1) % _MOD
                self.dev[table[p // bs] * bs + p % bs] = (prev, token)
            rows.append(prev)
        last = {int(q) - 1: h for q, h in zip(step.query_start_loc[1:], rows, strict=True)}
        return np.stack([np.random.default_rng(last[int(k)]).normal(size=SIM_VOCAB)
                         for k in step.logits_indices]).astype(np.float32)


def run_workload(requests, num_blocks, num_host_blocks=32, **options):  # type: ignore[no-untyped-def]
    """Final token ids per (request, sequence) of ``requests`` ((id, prompt, params, step to
    arrive at[, priority])), or "rejected", on a ProvenanceRunner."""
    runner = ProvenanceRunner(num_blocks, num_host_blocks)
    config = EngineOptions(**{"max_num_seqs": 8, "max_num_batched_tokens": 32,
                              "max_model_len": 128, "debug_checks": True, **options})
    engine = LLMEngine(runner, None, config, (SIM_EOS,), clock=runner.clock)
    results = {rid: o if o == "rejected" else [c.token_ids for c in o.outputs]
               for rid, o in drive_arrivals(engine, requests, max_steps=3000).items()}
    assert engine.kv.pool.num_used_blocks == 0
    return results, engine.counters.preemptions


def test_a_forked_member_never_writes_a_block_the_prefix_cache_holds():
    # The group is preempted and recomputed; its new leader fills and caches the block at the
    # prompt's end with its own output, then finishes; the member holding that block must copy
    # it, or X, arriving later with the leader's tokens, hits the cache and reads the member's
    # KV, and its tokens change.
    def workload(x_prompt):  # type: ignore[no-untyped-def]
        return [("A", [9] * 7, SamplingParams(max_tokens=5, ignore_eos=True, seed=2), 0, 0),
                ("g", [1, 2, 3, 4, 5, 6], SamplingParams(n=2, max_tokens=3, ignore_eos=True,
                                                         seed=0), 1, 0),
                ("X", x_prompt, SamplingParams(max_tokens=3, ignore_eos=True, seed=1), 12, 0)]
    options = {"preemption_mode": "recompute", "kv_watermark": 0.0}
    first, _ = run_workload(workload([1]), 64, **options)
    x_prompt = [1, 2, 3, 4, 5, 6, *first["g"][0][:2], 0]  # the leader's first 8 tokens, then 0
    roomy, _ = run_workload(workload(x_prompt), 64, **options)
    tight, preempted = run_workload(workload(x_prompt), 6, **options)
    assert preempted and tight == roomy


def test_a_copy_on_write_into_a_block_a_swap_out_just_freed_lands_after_it():
    def workload():  # type: ignore[no-untyped-def]
        p = SamplingParams(n=2, max_tokens=6, ignore_eos=True, seed=0)
        return [("low", [1, 2, 3, 4, 5, 6], p, 0, 1), ("high", [7] * 6, p, 2, 0)]
    roomy, _ = run_workload(workload(), 64, preemption_mode="swap", enable_prefix_caching=False)
    tight, preempted = run_workload(workload(), 6, num_host_blocks=16, preemption_mode="swap",
                                    enable_prefix_caching=False, kv_watermark=0.0)
    assert preempted and tight == roomy


def test_a_group_that_cannot_fit_the_pool_together_is_refused():
    engine = make_sim_engine(num_blocks=8)
    _, rejected = engine.add_request([1, 2, 3, 4], SamplingParams(n=3, max_tokens=12),
                                     request_id="g")
    assert rejected is not None and "need 10 KV blocks; the KV cache has 7" in (
        rejected.error or "")


WORKLOADS = st.lists(st.tuples(st.integers(1, 20), st.integers(1, 4), st.integers(1, 10),
                               st.integers(0, 6), st.integers(0, 3)), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=WORKLOADS, mode=st.sampled_from(["recompute", "swap", "auto"]),
       caching=st.booleans(), num_blocks=st.integers(12, 30), seed=st.integers(0, 99))
def test_preemption_swaps_and_forks_never_change_what_a_sequence_reads(workload, mode, caching,
                                                                        num_blocks, seed):
    """The same requests on a roomy pool (no preemption) and on a tight one: every sequence's
    tokens are the same, so every slot each one read held its own prefix's KV."""
    def requests():  # type: ignore[no-untyped-def]
        return [(f"r{i}", [1 + (k * (1 + j)) % 5 for k in range(plen)],
                 SamplingParams(n=n, max_tokens=max_tokens, seed=seed + i), at)
                for i, (plen, n, max_tokens, at, j) in enumerate(workload)]
    options = {"preemption_mode": mode, "enable_prefix_caching": caching, "kv_watermark": 0.0}
    tight, _ = run_workload(requests(), num_blocks, num_host_blocks=8, **options)
    roomy, _ = run_workload(requests(), 400, **options)
    for rid, got in tight.items():
        if got != "rejected":
            assert got == roomy[rid], rid


# --- the default model: one prefill, and each sequence as its own seeded request -------------


@pytest.fixture
def llm(default_llm):
    """The session's default-model LLM (fp32 matmuls: batch-invariant)."""
    return default_llm


PROMPT = "Write a short poem about the sea, the wind and the boats that sail on it."


@pytest.mark.slow
def test_n4_shares_the_prompt_blocks_and_each_sequence_equals_its_seed_alone(llm):
    engine = llm.engine
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=123, ignore_eos=True)
    engine.add_request(PROMPT, params, request_id="group")
    prompt_len = engine.scheduler.groups["group"].leader.num_prompt_tokens
    engine.step()  # the prefill, and the fork
    one = engine.kv.blocks_needed(prompt_len)
    assert engine.kv.pool.num_used_blocks == one < 4 * one
    group_out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            group_out = o
    assert group_out is not None and group_out.finished
    # Copy on write: at most one private block per forked sequence for the partial block.
    alone = llm.generate([PROMPT] * 4, [SamplingParams(max_tokens=12, temperature=1.0,
                                                       seed=123 + j, ignore_eos=True)
                                        for j in range(4)])
    assert [c.token_ids for c in group_out.outputs] == [a.token_ids for a in alone]
    assert [c.text for c in group_out.outputs] == [a.text for a in alone]
    assert len({tuple(c.token_ids) for c in group_out.outputs}) > 1, "the seeds did not differ"
    assert engine.kv.pool.num_used_blocks == 0


@pytest.mark.slow
def test_generate_returns_each_prompts_n_outputs(llm):
    outs = llm.generate(["Hello", "Name a colour:"], SamplingParams(n=2, max_tokens=4, seed=7))
    assert [len(o.outputs) for o in outs] == [2, 2]
    assert all(len(c.token_ids) <= 4 and c.finished for o in outs for c in o.outputs)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_preempted_group_generates_what_an_unpreempted_one_does(tiny_engines, mode):
    """Real KV (a tiny random model): a group forced out by swap or recompute, copies on write
    included, comes back with exactly the tokens it would have had."""
    from kvflow.runtime import create_runner

    def run(num_blocks: int, **options) -> tuple[list[list[list[int]]], int]:
        runner = create_runner("torch", tiny_engines["llama-gqa4", "torch"], num_blocks,
                               num_host_blocks=64)
        config = EngineOptions(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                               enable_prefix_caching=False, kv_watermark=0.0,
                               debug_checks=True, **options)
        engine = LLMEngine(runner, None, config, (), clock=SimClock())
        try:
            for g in range(2):
                engine.add_request([3 + (g * 5 + i) % 90 for i in range(10)],
                                   SamplingParams(n=3, max_tokens=14, temperature=1.0,
                                                  seed=40 + g, ignore_eos=True),
                                   request_id=f"g{g}")
            finals = {}
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        finals[o.request_id] = [c.token_ids for c in o.outputs]
            preempted = engine.counters.preemptions
            assert engine.kv.pool.num_used_blocks == 0
            return [finals[f"g{g}"] for g in range(2)], preempted
        finally:
            runner.close()

    roomy, none = run(64)
    tight, preempted = run(16, preemption_mode=mode)
    assert none == 0 and preempted > 0
    assert tight == roomy
