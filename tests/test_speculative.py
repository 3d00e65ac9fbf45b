"""Speculative decoding, pure parts: the scheduler's drafts and rollback, the KV and prefix
cache under random acceptances (hypothesis), the n-gram proposer, the draft-length policy,
and greedy verification (sampled verification: ``test_speculative_verification.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.kv_manager.block_pool import hash_block
from kvflow.orchestrator.request import Request, RequestStatus
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.orchestrator.sampling.sampler import Sampler, SamplingRow, make_generator
from kvflow.orchestrator.scheduler.output import RunnerOutput, SchedulerOutput
from kvflow.orchestrator.speculative.draft_length import DraftLengthPolicy
from kvflow.orchestrator.speculative.proposers import NgramProposer
from kvflow.orchestrator.speculative.verification import verify
from tests.helpers import EOS, TOKEN, make_request, make_scheduler_for_test, run_step


def spec_step(sched, accepted, token=TOKEN):
    """One step in which each sequence with drafts accepts ``accepted(s)`` of them, then
    ``token`` (the correction, or the bonus token); the others sample ``token``."""
    out = sched.schedule()
    sampled = {}
    for s in out.scheduled:
        if s.sample:
            drafts = s.request.spec_token_ids[:s.num_spec_tokens]
            sampled[s.request.request_id] = [*drafts[:accepted(s)], token]
    sched.update_from_output(out, RunnerOutput(sampled))
    sched.check_integrity()
    return out


# --- the scheduler ------------------------------------------------------------------------------
def test_drafts_are_scheduled_with_the_decode_and_rolled_back():
    sched = make_scheduler_for_test()
    r = make_request("a", 6, max_tokens=20)
    sched.add_request(r)
    run_step(sched)  # the prompt, and the first token
    assert r.num_computed_tokens == 6 and r.output_token_ids == [TOKEN]
    r.spec_token_ids = [101, 102, 103]
    out = sched.schedule()
    [s] = out.scheduled
    assert (s.start, s.num_new_tokens, s.num_spec_tokens, s.sample) == (6, 4, 3, True)
    assert s.token_ids()[6:] == [TOKEN, 101, 102, 103]
    sched.update_from_output(out, RunnerOutput({"a": [101, TOKEN]}))
    sched.check_integrity()
    # The last token and one accepted draft have their KV; the rejected two do not count.
    assert r.num_computed_tokens == 8
    assert r.output_token_ids == [TOKEN, 101, TOKEN]
    assert r.spec_token_ids == []
    assert (r.num_draft_tokens, r.num_accepted_tokens, r.num_spec_rejections) == (3, 1, 1)
    # Every draft accepted: the bonus token follows them.
    r.spec_token_ids = [104, 105]
    spec_step(sched, lambda s: s.num_spec_tokens)
    assert r.output_token_ids[-3:] == [104, 105, TOKEN] and r.num_computed_tokens == 11
    assert r.num_spec_rejections == 1


def test_drafts_take_only_the_budget_left():
    sched = make_scheduler_for_test(max_num_batched_tokens=8)
    reqs = [make_request(f"r{i}", 3, max_tokens=20) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    run_step(sched)
    for r in reqs:
        r.spec_token_ids = [101, 102, 103, 104, 105, 106, 107]
    out = spec_step(sched, lambda s: 0)
    assert [(s.num_new_tokens, s.num_spec_tokens) for s in out.scheduled] == [(7, 6), (1, 0)]
    assert out.num_batched_tokens == 8


def test_drafts_never_preempt():
    """Drafts whose blocks the pool lacks are dropped: the decode runs plainly, and no
    running request is preempted for them."""
    sched = make_scheduler_for_test(num_blocks=5, block_size=4)  # 4 usable blocks
    a, b = make_request("a", 7, max_tokens=8), make_request("b", 7, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # each holds 2 blocks, 8 slots, 7 used: the pool is full
    assert sched.kv.num_free_blocks == 0
    a.spec_token_ids = [101, 102, 103]
    out = spec_step(sched, lambda s: 0)
    assert [(s.request.request_id, s.num_spec_tokens) for s in out.scheduled] == [
        ("a", 0), ("b", 0)]
    assert not out.preempted and a.spec_token_ids == []


def test_a_stopping_draft_ends_the_request_there():
    sched = make_scheduler_for_test()
    r = make_request("a", 4, max_tokens=20)
    sched.add_request(r)
    run_step(sched)
    r.spec_token_ids = [101, EOS]  # the output processor cuts after a stopping token
    out = sched.schedule()
    finished = sched.update_from_output(out, RunnerOutput({"a": [101, EOS]}))
    assert finished == [r] and r.status == RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [TOKEN, 101, EOS]
    sched.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_preemption_drops_the_drafts():
    sched = make_scheduler_for_test()
    r = make_request("a", 4, max_tokens=20)
    sched.add_request(r)
    run_step(sched)
    r.spec_token_ids = [101, 102]
    sched._preempt(r, SchedulerOutput())
    assert r.spec_token_ids == [] and r.status != RequestStatus.RUNNING


def _hashes(tokens, n, bs, salt=b""):
    out, parent = [], None
    for i in range(n):
        parent = hash_block(parent, tokens[i * bs:(i + 1) * bs], salt)
        out.append(parent)
    return out


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_kv_and_prefix_cache_stay_exact_under_random_acceptance(data):
    """Speculation on, random drafts, acceptances and aborts, prefix caching on: the pool's
    invariants hold after every step, and every hashed block of a sequence is the hash of
    its accepted tokens (no hash ever covers a rejected draft; none past the computed ones)."""
    bs = 4
    sched = make_scheduler_for_test(num_blocks=24, block_size=bs, enable_prefix_caching=True,
                                    max_num_batched_tokens=24, num_host_blocks=8,
                                    preemption_mode=data.draw(st.sampled_from(
                                        ["recompute", "swap"])))
    shared = list(range(10, 18))
    live: list[Request] = []
    for step in range(data.draw(st.integers(4, 30))):
        if data.draw(st.booleans()):
            n = data.draw(st.integers(1, 10))
            r = Request(f"r{step}", shared[:data.draw(st.integers(0, 8))] + [50 + step] * n,
                        SamplingParams(max_tokens=data.draw(st.integers(1, 16))), 0.0,
                        eos_token_ids=(EOS,))
            sched.add_request(r)
            live.append(r)
        for r in list(sched.running):
            if r.num_tokens - r.num_computed_tokens == 1 and data.draw(st.booleans()):
                r.spec_token_ids = [200 + (i % 7) for i in range(data.draw(st.integers(1, 6)))]
        if live and data.draw(st.integers(0, 9)) == 0:
            sched.abort_request(data.draw(st.sampled_from(live)).request_id)
        spec_step(sched, lambda s: data.draw(st.integers(0, s.num_spec_tokens)),
                  token=data.draw(st.integers(60, 70)))
        kv = sched.kv
        for r in sched.running:
            table = kv.block_tables[r.request_id]
            full = min(r.num_computed_tokens, r.num_tokens) // bs
            want = _hashes(r.token_ids, full, bs)
            for i, block in enumerate(table):
                h = kv.pool.block_hashes[block]
                if i < full:
                    assert h is None or h == want[i], (r, i)
                else:
                    assert h is None, f"{r}: block {i} past the computed tokens is hashed"
    for r in list(sched.running) + list(sched.waiting):
        sched.abort_request(r.request_id)
    sched.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.pool.num_usable_blocks


# --- the n-gram proposer ------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_match():
    r = Request("a", [1, 2, 3, 4, 5, 9, 1, 2, 3, 6, 7, 1, 2, 3], SamplingParams(), 0.0)
    # The longest n-gram matching ``1 2 3`` last ended at position 9: 6 7 1 2 3 follow.
    assert NgramProposer(2, 5).propose([r], [4]) == [[6, 7, 1, 2]]
    r.append_output_token(6)  # ... 2 3 6: matched at "3 6" (and "2 3 6")
    assert NgramProposer(2, 5).propose([r], [3]) == [[7, 1, 2]]
    assert r.proposer_state is not None
    nothing = Request("b", [1, 2, 3, 4], SamplingParams(), 0.0)
    assert NgramProposer(2, 5).propose([nothing], [4]) == [[]]


def test_ngram_index_grows_with_the_sequence():
    proposer = NgramProposer(1, 3)
    r = Request("a", [5, 6, 7], SamplingParams(), 0.0)
    assert proposer.propose([r], [2]) == [[]]
    for t in (5, 6):
        r.append_output_token(t)
    # 5 6 7 5 6: "5 6" ended at 1 before; 7 5 follow.
    assert proposer.propose([r], [2]) == [[7, 5]]


# --- the draft-length policy --------------------------------------------------------------------
def _fitted(a_s, b_s, max_drafts=8):
    policy = DraftLengthPolicy(max_drafts)
    for n in (1, 4, 9, 16, 33, 2, 40):
        policy.observe_step(n, a_s + b_s * n)
    return policy


def test_draft_length_fit_recovers_the_step_cost():
    policy = _fitted(0.010, 0.001)
    a, b = policy.fit
    assert a == pytest.approx(0.010, rel=1e-3) and b == pytest.approx(0.001, rel=1e-3)


def test_draft_length_falls_with_the_batch_and_grows_with_acceptance():
    policy = _fitted(0.010, 0.001)
    for _ in range(50):
        policy.observe_verification(4, 3)
    good = [Request(f"g{i}", [1], SamplingParams(), 0.0) for i in range(64)]
    one = policy.lengths(good[:1], [8])[0]
    assert one >= 4
    many = policy.lengths(good, [8] * 64)
    assert sum(many) < one * 64 and max(many) <= one
    # A step whose fixed cost dominates (a GPU's decode): speculate the most at any batch.
    cheap = _fitted(0.020, 0.0)
    assert cheap.lengths(good, [8] * 64) == [8] * 64
    # A step that costs per token only (no fixed part) never pays for a draft.
    linear = _fitted(1e-6, 0.001)
    assert linear.lengths(good[:1], [8]) == [0]


def test_draft_length_per_request_acceptance():
    policy = _fitted(0.010, 0.001)
    hit = Request("hit", [1], SamplingParams(), 0.0)
    miss = Request("miss", [1], SamplingParams(), 0.0)
    hit.num_accepted_tokens, hit.num_spec_rejections = 60, 2
    miss.num_accepted_tokens, miss.num_spec_rejections = 0, 30
    k_hit, k_miss = policy.lengths([hit, miss], [8, 8])
    assert k_hit > k_miss


def test_draft_length_unfitted_drafts_the_most():
    policy = DraftLengthPolicy(4)
    policy.observe_step(5, 0.01)  # one size alone identifies nothing
    assert policy.fit is None
    assert policy.lengths([Request("a", [1], SamplingParams(), 0.0)], [9]) == [4]


# --- verification (sampled: tests/test_speculative_verification.py) ---------------------------
def test_greedy_verification_with_penalties_and_min_tokens():
    """Greedy verification applies each position's own penalties and min_tokens ban."""
    sampler = Sampler(6, (5,))
    params = SamplingParams(temperature=0, repetition_penalty=50.0, min_tokens=2)
    logits = np.zeros((3, 6), np.float32)
    logits[:, 1] = 3.0  # 1 everywhere, unless penalised once drafted
    logits[:, 5] = 2.5  # EOS next: banned below two output tokens
    logits[:, 2] = 1.0
    row = SamplingRow(params, [0], [], make_generator(0))
    # Position 0: 1. Position 1 (after drafting 1): 1 is penalised, EOS banned (1 output): 2.
    assert verify(sampler, logits, row, [1, 2]) == [1, 2, 5]
    assert verify(sampler, logits, row, [1, 1]) == [1, 2]


# --- the simulator ------------------------------------------------------------------------------
def _simulate(acceptance, draft_length="dynamic", cost=None, rate_specs=None):
    from kvflow.orchestrator.options import EngineOptions
    from kvflow.sim.cost_model import FixedCostModel
    from kvflow.sim.simulator import simulate
    from kvflow.sim.speculation import AcceptanceProposer
    from kvflow.workloads.specs import RequestSpec

    specs = rate_specs or [RequestSpec(0.1 * i, 20, 40) for i in range(4)]
    options = EngineOptions(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                            num_speculative_tokens=4, speculative_draft_length=draft_length,
                            debug_checks=True)
    proposer = None if acceptance is None else (lambda: AcceptanceProposer(acceptance, seed=3))
    return simulate(specs, cost or FixedCostModel(0.01), options, num_blocks=200,
                    block_size=16, proposer=proposer)


def test_simulated_speculation_runs_the_engines_code():
    """Acceptance 1: every step of a decoding request emits 5 tokens (4 drafts and the bonus),
    at a fixed step cost; acceptance 0: one, as without speculation. Lengths are exact."""
    plain = _simulate(None)
    full = _simulate(1.0)
    none = _simulate(0.0)
    for result in (plain, full, none):
        assert [t.output_tokens for t in result.timings] == [40] * 4
    assert full.counters.spec_accepted_tokens == full.counters.spec_draft_tokens > 0
    assert none.counters.spec_accepted_tokens == 0 and none.counters.spec_draft_tokens > 0
    assert full.counters.steps < plain.counters.steps * 0.6
    assert none.counters.steps == plain.counters.steps
    lengths = [n for s in full.steps for n in s.acceptance_lengths]
    assert lengths and set(lengths) <= {1, 2, 3, 4, 5} and max(lengths) == 5


def test_simulated_acceptance_replayed_from_a_trace(tmp_path):
    from kvflow.sim.speculation import AcceptanceProposer, acceptance_lengths_of

    trace = tmp_path / "t.json"
    trace.write_text('{"traceEvents": [{"name": "decode", "cat": "request", '
                     '"args": {"tokens": 12, "drafts": 12, "accepted": 8}}]}')
    lengths = acceptance_lengths_of(trace)
    assert lengths == [3, 3, 3, 3]  # 4 verifications emitting 12 tokens
    proposer = AcceptanceProposer(replay=lengths)
    r = Request("a", [1], SamplingParams(), 0.0)
    assert proposer.propose([r], [4]) == [[0, 0, 1, 1]]
