"""The scheduling decisions of the design's sections 6.2-6.4, each with a fake clock and
hand-written runner outputs: SJF, fair share (VTC), priority preemption and its bound,
deadlines in every phase, SLO admission, and the long-prompt cap."""

from __future__ import annotations

import pytest

from kvflow.orchestrator.options import EngineOptions, parse_tenant_weights
from kvflow.orchestrator.request import RequestStatus
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.orchestrator.scheduler.output import RunnerOutput
from kvflow.orchestrator.scheduler.policies import FairShare
from kvflow.reports.summary import jain_index
from tests.helpers import (
    FakeClock,
    chunks,
    make_request,
    make_scheduler_for_test,
    run_step,
)


def admitted_order(sched, steps=1000) -> list[str]:
    """Request ids in the order they were first scheduled."""
    order: list[str] = []
    for _ in range(steps):
        for s in run_step(sched).scheduled:
            if s.request.request_id not in order:
                order.append(s.request.request_id)
        if not sched.has_unfinished_requests():
            break
    return order


# --- sjf --------------------------------------------------------------------------------------
def test_sjf_admits_the_shortest_job_first_counting_max_tokens():
    sched = make_scheduler_for_test(policy="sjf", max_num_seqs=1, max_num_batched_tokens=64)
    sched.add_request(make_request("long", 20, max_tokens=4))      # 24
    sched.add_request(make_request("short", 4, max_tokens=4))      # 8
    sched.add_request(make_request("mid", 4, max_tokens=12))       # 16
    sched.add_request(make_request("unknown", 10, max_tokens=None))  # 10: output unknown
    assert admitted_order(sched) == ["short", "unknown", "mid", "long"]


def test_sjf_starvation_bound_lets_an_old_long_job_go_first():
    clock = FakeClock()
    sched = make_scheduler_for_test(policy="sjf", max_num_seqs=1, sjf_max_wait_s=10.0,
                                    clock=clock, max_num_batched_tokens=64)
    sched.add_request(make_request("long", 30, max_tokens=2, arrival=0.0))
    sched.add_request(make_request("short-0", 2, max_tokens=2, arrival=0.0))
    assert chunks(run_step(sched)) == {"short-0": 2}
    run_step(sched)  # short-0 finishes
    clock.now = 11.0  # long has waited past sjf_max_wait_s
    sched.add_request(make_request("short-1", 2, max_tokens=2, arrival=11.0))
    assert chunks(run_step(sched)) == {"long": 30}


# --- fair share: the virtual token counter ----------------------------------------------------
def test_vtc_counts_weighted_prompt_and_output_tokens():
    sched = make_scheduler_for_test(policy="fair", tenant_weights="b=2", fair_output_weight=2.0,
                                    max_num_batched_tokens=64)
    sched.add_request(make_request("a0", 10, max_tokens=3, tenant="a"))
    sched.add_request(make_request("b0", 10, max_tokens=3, tenant="b"))
    run_step(sched)  # both prefill 10 and sample one token: 10 + 2
    counters = sched.policy.counters
    assert counters == {"a": 12.0, "b": 6.0}
    run_step(sched)  # one decode each: 2 per output token
    assert counters == {"a": 14.0, "b": 7.0}


def test_vtc_lifts_a_newly_active_tenant_to_the_least_served_active_one():
    sched = make_scheduler_for_test(policy="fair", max_num_batched_tokens=64, max_num_seqs=8)
    policy = sched.policy
    assert isinstance(policy, FairShare)
    sched.add_request(make_request("a0", 20, max_tokens=8, tenant="a"))
    sched.add_request(make_request("b0", 4, max_tokens=8, tenant="b"))
    run_step(sched)
    run_step(sched)
    least = min(policy.counters.values())
    assert policy.counters["b"] == least < policy.counters["a"]
    # c arrives with no history: lifted to b's counter, not left at 0 to catch up on others.
    sched.add_request(make_request("c0", 4, max_tokens=2, tenant="c"))
    assert policy.counters["c"] == least
    # A tenant that comes back keeps a counter above the lift: idle time earns no credit,
    # and its past service is not forgotten either.
    while sched.has_unfinished_requests():
        run_step(sched)
    before = dict(policy.counters)
    sched.add_request(make_request("a1", 4, max_tokens=2, tenant="a"))
    assert policy.counters["a"] == before["a"]
    # With nobody active, a newcomer is lifted to the counter of the tenant that left last.
    sched.abort_request("a1")
    sched.add_request(make_request("d0", 4, max_tokens=2, tenant="d"))
    assert policy.counters["d"] == policy.counters["a"]


def test_fair_share_interleaves_a_light_tenant_with_a_backlogged_heavy_one():
    sched = make_scheduler_for_test(policy="fair", max_num_seqs=1, max_num_batched_tokens=64)
    for i in range(6):
        sched.add_request(make_request(f"heavy-{i}", 12, max_tokens=2, tenant="heavy"))
    for i in range(3):
        sched.add_request(make_request(f"light-{i}", 4, max_tokens=2, tenant="light"))
    order = admitted_order(sched)
    # fcfs would run all six heavy requests first; fair share serves light within two.
    assert order.index("light-0") <= 1
    assert [r for r in order if r.startswith("light")] == ["light-0", "light-1", "light-2"]
    assert order.index("light-2") < order.index("heavy-5")


def test_tenant_weights_are_checked_by_name():
    assert parse_tenant_weights(" a=2, b=0.5 ") == {"a": 2.0, "b": 0.5}
    for bad in ("a", "a=0", "a=-1", "=3", "a=x", "a=inf"):
        with pytest.raises(ValueError, match="tenant_weights"):
            EngineOptions(tenant_weights=bad)


def test_jain_index_of_equal_and_skewed_shares():
    assert jain_index([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)


# --- priority preemption ----------------------------------------------------------------------
def test_a_higher_priority_arrival_preempts_when_max_num_seqs_blocks_it():
    sched = make_scheduler_for_test(policy="priority", max_num_seqs=1, max_num_batched_tokens=64)
    low = make_request("low", 4, max_tokens=20, priority=5)
    sched.add_request(low)
    run_step(sched)
    run_step(sched)
    sched.add_request(make_request("high", 4, max_tokens=2, priority=0))
    out = run_step(sched)
    assert [r.request_id for r in out.preempted] == ["low"] and chunks(out) == {"high": 4}
    assert low.status == RequestStatus.PREEMPTED and sched.waiting[0] is low
    # high finishes; low resumes (recomputing) and finishes with all its tokens.
    while sched.has_unfinished_requests():
        run_step(sched)
    assert low.status == RequestStatus.FINISHED_LENGTH and low.num_output_tokens == 20


def test_a_higher_priority_arrival_preempts_when_kv_blocks_block_it():
    # 8 usable blocks of 4: low holds 5 once it decodes (16 + 1 tokens); high needs 4.
    sched = make_scheduler_for_test(num_blocks=9, policy="priority", max_num_seqs=4,
                                    max_num_batched_tokens=64, kv_watermark=0.0)
    sched.add_request(make_request("low", 16, max_tokens=8, priority=5))
    run_step(sched)
    sched.add_request(make_request("high", 16, max_tokens=2, priority=0))
    out = run_step(sched)
    assert [r.request_id for r in out.preempted] == ["low"] and chunks(out) == {"high": 16}


def test_equal_priority_or_fcfs_never_preempts_for_an_arrival():
    for policy, prio in (("priority", 5), ("fcfs", 0)):
        sched = make_scheduler_for_test(policy=policy, max_num_seqs=1, max_num_batched_tokens=64)
        sched.add_request(make_request("low", 4, max_tokens=20, priority=5))
        run_step(sched)
        sched.add_request(make_request("high", 4, max_tokens=2, priority=prio))
        assert not run_step(sched).preempted


def test_preemption_is_not_wasted_when_it_could_not_make_room():
    # 12 usable blocks of 4: decoding, mid (priority -1) holds 5, low 3; 4 are free. high
    # (-1) outranks only low, and low's 3 blocks + the 4 free are fewer than the 8 it needs.
    sched = make_scheduler_for_test(num_blocks=13, policy="priority", max_num_seqs=4,
                                    max_num_batched_tokens=64, kv_watermark=0.0)
    sched.add_request(make_request("mid", 16, max_tokens=20, priority=-1))
    sched.add_request(make_request("low", 8, max_tokens=20, priority=5))
    run_step(sched)
    sched.add_request(make_request("high", 32, max_tokens=2, priority=-1))
    out = run_step(sched)
    assert not out.preempted and sched.requests["low"].status == RequestStatus.RUNNING
    assert "high" not in chunks(out)  # it waits for room instead


def test_a_request_preempted_k_times_is_not_preempted_again():
    sched = make_scheduler_for_test(policy="priority", max_num_seqs=1, max_num_batched_tokens=64,
                                    max_preemptions_per_request=2)
    low = make_request("low", 4, max_tokens=40, priority=5)
    sched.add_request(low)
    preemptions = 0
    for k in range(4):
        while low.status != RequestStatus.RUNNING:
            run_step(sched)
        sched.add_request(make_request(f"high-{k}", 4, max_tokens=1, priority=0))
        out = run_step(sched)
        preemptions += len(out.preempted)
    assert preemptions == 2 and low.metrics.num_preemptions == 2
    assert low.status == RequestStatus.RUNNING  # the third and fourth high ones waited


def test_an_aged_request_is_not_preempted_for_a_fresh_one():
    clock = FakeClock()
    sched = make_scheduler_for_test(policy="priority", max_num_seqs=1, priority_aging_s=1.0,
                                    clock=clock, max_num_batched_tokens=64)
    sched.add_request(make_request("low", 4, max_tokens=40, priority=2, arrival=0.0))
    run_step(sched)
    clock.now = 3.0  # low has aged to -1: above a fresh priority 0
    sched.add_request(make_request("high", 4, max_tokens=1, priority=0, arrival=3.0))
    assert not run_step(sched).preempted


# --- deadlines --------------------------------------------------------------------------------
@pytest.mark.parametrize("phase", ["waiting", "prefill", "decode"])
def test_a_deadline_ends_the_request_in_each_phase_and_frees_its_blocks(phase):
    clock = FakeClock()
    sched = make_scheduler_for_test(clock=clock, max_num_seqs=1, max_num_batched_tokens=8)
    blocker = make_request("blocker", 4, max_tokens=30)
    sched.add_request(blocker)
    victim = make_request("victim", 20, max_tokens=30, timeout_ms=5000, arrival=0.0)
    if phase != "waiting":
        sched.abort_request("blocker")
    sched.add_request(victim)
    steps = {"waiting": 1, "prefill": 1, "decode": 4}[phase]
    for _ in range(steps):
        run_step(sched)
    clock.now = 5.0
    out = run_step(sched)
    assert victim.status == RequestStatus.FINISHED_TIMEOUT
    assert victim.status.finish_reason == "timeout"
    assert out.timed_out == [(victim, phase)]
    assert "victim" not in sched.kv.block_tables and "victim" not in sched.requests
    if phase == "decode":
        assert victim.num_output_tokens >= 1  # the partial output stays with the request
    if phase == "waiting":
        assert chunks(out) == {"blocker": 1}  # everything else keeps running
    sched.check_integrity()


def test_the_servers_default_timeout_applies_and_a_request_overrides_it():
    clock = FakeClock()
    sched = make_scheduler_for_test(clock=clock, request_timeout_s=2.0)
    a = make_request("default", 4, max_tokens=50)
    b = make_request("own", 4, max_tokens=50, timeout_ms=10_000)
    sched.add_request(a)
    sched.add_request(b)
    assert a.deadline == 2.0 and b.deadline == 10.0
    clock.now = 2.0
    run_step(sched)
    assert a.status == RequestStatus.FINISHED_TIMEOUT and b.status == RequestStatus.RUNNING


def test_timeout_ms_is_checked_by_name():
    with pytest.raises(ValueError, match=r"timeout_ms must be in \[1, "):
        SamplingParams(timeout_ms=0)
    with pytest.raises(ValueError, match="timeout_ms must be an int"):
        SamplingParams.from_dict({"timeout_ms": 1.5})


def test_a_timed_out_group_ends_every_sequence():
    from kvflow.orchestrator.request import Request, SequenceGroup

    clock = FakeClock()
    sched = make_scheduler_for_test(clock=clock, max_num_batched_tokens=64)
    params = SamplingParams(n=3, max_tokens=30, timeout_ms=3000)
    seqs = [Request(f"g#{j}", list(range(10, 20)), params, 0.0, 0, (2,), parent_id="g",
                    index=j) for j in range(3)]
    SequenceGroup("g", seqs)
    sched.add_request(seqs[0])
    run_step(sched)
    run_step(sched)
    clock.now = 3.0
    out = run_step(sched)
    assert out.timed_out == [(seqs[0], "decode")]
    assert all(s.status == RequestStatus.FINISHED_TIMEOUT for s in seqs)
    assert not sched.kv.block_tables and not sched.groups
    sched.check_integrity()


# --- SLO admission ----------------------------------------------------------------------------
def test_slo_admission_refuses_at_once_when_the_queue_holds_too_much_work():
    sched = make_scheduler_for_test(max_queue_delay_ms=100.0, max_num_seqs=1,
                                    max_model_len=4096, num_blocks=1200,
                                    max_num_batched_tokens=64)
    sched.observe_step(1000, 1.0)  # measured: 1000 prefill tokens/s
    assert sched.prefill_tokens_per_s == pytest.approx(1000.0)
    assert sched.add_request(make_request("first", 60))   # nothing queued ahead: 0 ms
    assert sched.add_request(make_request("second", 60))  # 60 tokens ahead: 60 ms
    late = make_request("third", 60)                       # 120 tokens ahead: 120 ms
    assert not sched.add_request(late)
    assert late.status == RequestStatus.REJECTED and late.reject_cause == "queue_delay"
    assert late.reject_code == "overloaded"
    assert late.reject_reason.startswith("server overloaded: predicted queue delay 120 ms "
                                         "exceeds max_queue_delay_ms=100")
    # Once the queue drains, the prediction drops and requests are taken again.
    run_step(sched)
    run_step(sched)
    assert sched.add_request(make_request("fourth", 60))


def test_prefill_rate_is_measured_from_steps():
    sched = make_scheduler_for_test(recompute_tokens_per_s=500.0)
    assert sched.prefill_tokens_per_s == 500.0  # the prior, until a step is seen
    sched.observe_step(0, 1.0)  # decode-only steps say nothing about prefill
    assert sched.prefill_tokens_per_s == 500.0
    for _ in range(100):
        sched.observe_step(400, 0.1)
    assert sched.prefill_tokens_per_s == pytest.approx(4000.0)


# --- the long-prompt cap ----------------------------------------------------------------------
def test_at_most_max_long_partial_prefills_long_prompts_prefill_at_once():
    sched = make_scheduler_for_test(max_num_batched_tokens=32, long_prefill_token_threshold=8,
                                    max_long_partial_prefills=1, num_blocks=128)
    sched.add_request(make_request("long-a", 40))
    sched.add_request(make_request("long-b", 40))
    sched.add_request(make_request("short", 6))
    # long-b is passed over (one long prefill at a time); the short one behind it is not.
    assert chunks(run_step(sched)) == {"long-a": 8, "short": 6}
    for _ in range(3):
        assert "long-b" not in chunks(run_step(sched))
    # long-a's last chunk: it is no longer long, and long-b starts.
    assert "long-b" in chunks(run_step(sched))


def test_the_long_prompt_cap_needs_a_threshold():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineOptions(max_long_partial_prefills=1)


# --- regressions found in review ---------------------------------------------------------------
def make_group(gid, prompt_len, n, arrival=0.0, priority=0, **params):
    from kvflow.orchestrator.request import Request, SequenceGroup

    p = SamplingParams(n=n, **params)
    seqs = [Request(f"{gid}#{j}", list(range(10, 10 + prompt_len)), p, arrival, priority, (2,),
                    parent_id=gid, index=j) for j in range(n)]
    SequenceGroup(gid, seqs)
    return seqs


def group_step(sched, token=7, tokens=None):
    """run_step, with forked members' first tokens too (as the engine samples them)."""
    tokens = tokens or {}
    out = sched.schedule()
    sampled = {}
    for s in (s for s in out.scheduled if s.sample):
        r, g = s.request, s.request.group
        sampled[r.request_id] = tokens.get(r.request_id, token)
        if g is not None and g.parked and r is g.leader and not r.output_token_ids:
            sampled.update({m.request_id: tokens.get(m.request_id, token)
                            for m in g.parked if not m.output_token_ids})
    sched.update_from_output(out, RunnerOutput({rid: [t] for rid, t in sampled.items()}))
    sched.check_integrity()
    return out


def test_a_group_keeps_its_deadline_when_its_first_sequence_finished_and_the_heap_compacts():
    clock = FakeClock()
    sched = make_scheduler_for_test(clock=clock, num_blocks=256, max_num_batched_tokens=64,
                                    max_num_seqs=8)
    g = make_group("g", 4, 2, max_tokens=200, timeout_ms=10_000)
    sched.add_request(g[0])
    group_step(sched)
    group_step(sched, tokens={"g#0": 2})  # g#0 stops at EOS; g#1 goes on
    for k in range(70):  # short requests with deadlines come and go: the heap compacts
        sched.add_request(make_request(f"r{k}", 4, max_tokens=1, timeout_ms=1))
        group_step(sched)
    clock.now = 0.002
    group_step(sched)
    clock.now = 20.0
    group_step(sched)
    assert g[1].status == RequestStatus.FINISHED_TIMEOUT


def test_no_preemption_when_the_token_budget_is_what_blocks_the_arrival():
    sched = make_scheduler_for_test(policy="priority", enable_chunked_prefill=False,
                                    max_num_batched_tokens=16, max_num_seqs=8, num_blocks=64)
    sched.add_request(make_request("mid", 4, max_tokens=50, priority=-1))
    sched.add_request(make_request("low", 4, max_tokens=50, priority=5))
    run_step(sched)
    run_step(sched)
    # 16 tokens, but mid's decode leaves 15 even with low gone: low must not be preempted.
    sched.add_request(make_request("high", 16, max_tokens=2, priority=0))
    out = run_step(sched)
    assert not out.preempted and chunks(out) == {"mid": 1, "low": 1}


def test_kv_shortage_evicts_by_aged_priority_as_priority_preemption_does():
    clock = FakeClock()
    sched = make_scheduler_for_test(policy="priority", priority_aging_s=10.0, clock=clock,
                                    num_blocks=9, max_num_batched_tokens=64, kv_watermark=0.0)
    old = make_request("old", 16, max_tokens=12, priority=1, arrival=0.0)   # aged: -1.5
    fresh = make_request("fresh", 16, max_tokens=12, priority=0, arrival=20.0)  # aged: -0.5
    clock.now = 25.0
    sched.add_request(old)
    sched.add_request(fresh)
    victims = []
    for _ in range(4):
        victims += [r.request_id for r in run_step(sched).preempted]
    assert victims == ["fresh"]  # once, and not the request that outranks it


def test_the_preemption_bound_holds_for_a_group_as_a_whole():
    sched = make_scheduler_for_test(policy="priority", max_num_seqs=2,
                                    max_num_batched_tokens=16, num_blocks=128,
                                    max_preemptions_per_request=1)
    low = make_group("low", 40, 2, priority=5, max_tokens=30, ignore_eos=True)
    sched.add_request(low[0])
    group_step(sched)
    sched.add_request(make_request("h1", 4, max_tokens=1, priority=0))
    for _ in range(6):
        group_step(sched)
    assert low[1].status == RequestStatus.RUNNING and low[0].metrics.num_preemptions == 1
    sched.add_request(make_request("h2", 4, max_tokens=1, priority=0))
    assert not group_step(sched).preempted
    assert max(r.metrics.num_preemptions for r in low) == 1


def test_forked_sequences_first_tokens_are_charged_to_their_tenant():
    from kvflow.orchestrator.request import Request, SequenceGroup

    sched = make_scheduler_for_test(policy="fair", max_num_batched_tokens=64)
    params = SamplingParams(n=4, max_tokens=1)
    seqs = [Request(f"g#{j}", list(range(10, 20)), params, 0.0, 0, (2,), tenant="a",
                    parent_id="g", index=j) for j in range(4)]
    SequenceGroup("g", seqs)
    sched.add_request(seqs[0])
    group_step(sched)
    assert sched.policy.counters["a"] == 10 + 4 * 2.0  # the prompt once, four first tokens


def test_blocks_another_request_still_holds_are_not_counted_as_freed():
    from kvflow.orchestrator.request import Request

    sched = make_scheduler_for_test(policy="priority", enable_prefix_caching=True,
                                    num_blocks=17, max_num_batched_tokens=64, max_num_seqs=8,
                                    kv_watermark=0.0)
    kv = sched.kv
    sched.add_request(make_request("mid", 17, max_tokens=30, priority=-1))
    run_step(sched)
    sched.add_request(make_request("low", 20, max_tokens=30, priority=5))  # shares mid's
    run_step(sched)
    run_step(sched)
    own = [b for b in kv.block_tables["low"] if kv.pool.ref_counts[b] == 1]
    # One block more than preempting low can really free:
    length = 4 * (kv.num_free_blocks + len(own) + 1)
    sched.add_request(Request("high", list(range(1000, 1000 + length)),
                              SamplingParams(max_tokens=2), 0.0, 0, (2,)))
    assert not run_step(sched).preempted


def test_cache_hits_on_held_blocks_cost_no_free_block_when_preempting():
    from kvflow.orchestrator.request import Request

    sched = make_scheduler_for_test(policy="priority", enable_prefix_caching=True,
                                    num_blocks=17, max_num_batched_tokens=64, max_num_seqs=8,
                                    kv_watermark=0.0)
    sched.add_request(make_request("mid", 40, max_tokens=20, priority=-1))
    run_step(sched)
    sched.add_request(Request("low", list(range(500, 512)), SamplingParams(max_tokens=40),
                              0.0, 5, (2,)))
    run_step(sched)
    run_step(sched)
    # high: 6 blocks, 4 of them cached in mid's: it needs 2, and preempting low frees 4.
    high = Request("high", list(range(10, 26)) + list(range(900, 908)),
                   SamplingParams(max_tokens=2), 0.0, 0, (2,))
    sched.add_request(high)
    out = run_step(sched)
    assert [r.request_id for r in out.preempted] == ["low"]
    assert high.status == RequestStatus.RUNNING


def test_preempting_a_prefilling_leader_frees_its_parked_members_seats():
    sched = make_scheduler_for_test(policy="priority", max_num_seqs=4,
                                    max_num_batched_tokens=16, long_prefill_token_threshold=8,
                                    num_blocks=128)
    sched.add_request(make_request("mid", 4, max_tokens=60, priority=-1))
    low = make_group("low", 100, 3, priority=5, max_tokens=4)
    sched.add_request(low[0])
    group_step(sched)
    group_step(sched)
    assert sched.num_seats_taken == 4  # mid, low's leader and its two parked members
    high = make_group("high", 4, 2, priority=0, max_tokens=4)
    sched.add_request(high[0])
    out = group_step(sched)
    assert [r.request_id for r in out.preempted] == ["low#0"]
    assert high[0].status == RequestStatus.RUNNING
