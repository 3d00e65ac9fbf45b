"""Scheduler behaviour with hand-built requests and hand-written runner outputs (no model)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.orchestrator.request import Request, RequestStatus
from kvflow.orchestrator.sampling.params import SamplingParams
from tests.helpers import (
    EOS,
    TOKEN,
    FakeClock,
    chunks,
    make_request,
    make_scheduler_for_test,
    run_step,
)


def test_token_budget_is_shared_and_prompts_are_chunked():
    sched = make_scheduler_for_test()
    for rid in "abc":
        sched.add_request(make_request(rid, 10))
    assert chunks(run_step(sched)) == {"a": 10, "b": 6}
    assert chunks(run_step(sched)) == {"a": 1, "b": 4, "c": 10}  # decode first, then chunks
    assert chunks(run_step(sched)) == {"a": 1, "b": 1, "c": 1}


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sched = make_scheduler_for_test(enable_chunked_prefill=False)
    sched.add_request(make_request("a", 10))
    sched.add_request(make_request("b", 10))
    assert chunks(run_step(sched)) == {"a": 10}  # b does not fit the remaining 6: waits
    assert chunks(run_step(sched)) == {"a": 1, "b": 10}


def test_long_prefill_threshold_caps_one_requests_chunk():
    sched = make_scheduler_for_test(long_prefill_token_threshold=4)
    sched.add_request(make_request("a", 10))
    sched.add_request(make_request("b", 3))
    assert chunks(run_step(sched)) == {"a": 4, "b": 3}
    assert chunks(run_step(sched)) == {"a": 4, "b": 1}


def test_max_num_seqs_bounds_the_running_batch():
    sched = make_scheduler_for_test(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, 2))
    out = run_step(sched)
    assert set(chunks(out)) == {"a", "b"} and sched.num_waiting == 1


def test_sampling_only_when_a_chunk_reaches_the_end_of_the_prompt():
    sched = make_scheduler_for_test(max_num_batched_tokens=8)
    sched.add_request(make_request("a", 12))
    out = run_step(sched)
    assert [s.sample for s in out.scheduled] == [False]
    assert sched.requests["a"].num_output_tokens == 0
    out = run_step(sched)
    assert [s.sample for s in out.scheduled] == [True]
    assert sched.requests["a"].output_token_ids == [TOKEN]
    assert sched.requests["a"].metrics.first_token_time is not None


def test_preemption_frees_the_newest_request_and_it_recomputes_everything():
    clock = FakeClock()
    # 6 usable blocks of 4 tokens: a and b (8-token prompts) take 2 blocks each.
    sched = make_scheduler_for_test(num_blocks=7, clock=clock, max_num_batched_tokens=64,
                                    kv_watermark=0.0)
    sched.add_request(make_request("a", 8, max_tokens=16, arrival=0.0))
    sched.add_request(make_request("b", 8, max_tokens=16, arrival=1.0))
    run_step(sched)
    # Each decode step adds a token; at 12 tokens each needs a 4th... blocks run out.
    preempted = []
    for _ in range(12):
        out = run_step(sched)
        preempted += [r.request_id for r in out.preempted]
        if preempted:
            break
    assert preempted == ["b"]  # the newer one
    b = sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert "b" not in sched.kv.block_tables and sched.waiting[0] is b
    assert b.metrics.num_preemptions == 1
    outputs_before = list(b.output_token_ids)
    # Once a finishes, b comes back and recomputes prompt + the outputs it had.
    while sched.requests.get("a") is not None:
        out = run_step(sched)
    while b.status != RequestStatus.RUNNING:
        out = run_step(sched)
    assert chunks(out)["b"] == 8 + len(outputs_before)
    assert b.output_token_ids[: len(outputs_before)] == outputs_before


def test_preemption_takes_the_lowest_priority_first():
    sched = make_scheduler_for_test(num_blocks=7, policy="priority", max_num_batched_tokens=64,
                                    kv_watermark=0.0)
    sched.add_request(make_request("low", 8, max_tokens=16, priority=5, arrival=0.0))
    sched.add_request(make_request("high", 8, max_tokens=16, priority=0, arrival=1.0))
    run_step(sched)
    victims = []
    for _ in range(12):
        victims += [r.request_id for r in run_step(sched).preempted]
    assert victims and victims[0] == "low"


def test_priority_admission_order_and_aging():
    clock = FakeClock()
    sched = make_scheduler_for_test(policy="priority", max_num_seqs=1, priority_aging_s=10.0,
                                    clock=clock)
    sched.add_request(make_request("old-low", 2, max_tokens=1, priority=3, arrival=0.0))
    sched.add_request(make_request("new-high", 2, max_tokens=1, priority=1, arrival=0.0))
    assert chunks(run_step(sched)) == {"new-high": 2}
    # Now old-low has waited 25 s: effective priority 3 - 2.5 = 0.5 beats a fresh priority 1.
    clock.now = 25.0
    sched.add_request(make_request("fresh", 2, max_tokens=1, priority=1, arrival=25.0))
    assert chunks(run_step(sched)) == {"old-low": 2}
    assert chunks(run_step(sched)) == {"fresh": 2}


def test_static_batching_runs_a_batch_to_completion_before_admitting():
    sched = make_scheduler_for_test(policy="static", static_batch_size=2,
                                    max_num_batched_tokens=64)
    sched.add_request(make_request("a", 4, max_tokens=1))
    sched.add_request(make_request("b", 4, max_tokens=3))
    sched.add_request(make_request("c", 4, max_tokens=1))
    assert chunks(run_step(sched)) == {"a": 4, "b": 4}
    # KV for b's whole length (4 + 3 tokens = 2 blocks) was reserved up front.
    assert len(sched.kv.block_tables["b"]) == 2
    assert chunks(run_step(sched)) == {"b": 1}  # a finished; c is not admitted mid-batch
    assert chunks(run_step(sched)) == {"b": 1}
    assert chunks(run_step(sched)) == {"c": 4}


@pytest.mark.parametrize(("prompt_len", "cfg", "reason"), [
    (0, {}, "at least one token"),
    (256, {}, "max_model_len is 256"),
    (100, {"enable_chunked_prefill": False}, "max_num_batched_tokens (16)"),
    (40, {"num_blocks": 9}, "the KV cache's capacity per sequence is 32 tokens"),
    # Refused, not cut short: prompt + max_tokens (or min_tokens) must fit.
    (250, {}, "prompt has 250 tokens and max_tokens is 10: 260 tokens, more than "
              "max_model_len (256 tokens)"),
    (30, {"num_blocks": 9}, "prompt has 30 tokens and max_tokens is 10: 40 tokens, more than "
                            "the KV cache's capacity per sequence (32 tokens)"),
])
def test_requests_that_can_never_run_are_rejected_at_once(prompt_len, cfg, reason):
    sched = make_scheduler_for_test(**cfg)
    request = make_request("r", prompt_len, max_tokens=10)
    assert not sched.add_request(request)
    assert request.status == RequestStatus.REJECTED and reason in request.reject_reason
    assert request.reject_code == "bad_request"
    assert not sched.has_unfinished_requests()


def test_min_tokens_is_bounded_by_the_context_when_max_tokens_is_none():
    sched = make_scheduler_for_test()
    request = Request("r", list(range(10, 20)), SamplingParams(max_tokens=None,
                                                               min_tokens=10**9), 0.0)
    assert not sched.add_request(request)
    assert "min_tokens is 1000000000" in request.reject_reason


def test_a_full_queue_rejects_with_a_reason():
    sched = make_scheduler_for_test(max_waiting_requests=2)
    assert sched.add_request(make_request("a", 2))
    assert sched.add_request(make_request("b", 2))
    c = make_request("c", 2)
    assert not sched.add_request(c)
    assert "waiting queue is full (max_waiting_requests=2)" in c.reject_reason
    assert c.reject_code == "overloaded"


def test_abort_frees_blocks_at_once():
    sched = make_scheduler_for_test()
    sched.add_request(make_request("a", 10, max_tokens=50))
    run_step(sched)
    assert sched.kv.pool.num_used_blocks == 3
    sched.abort_request("a")
    assert sched.kv.pool.num_used_blocks == 0
    sched.check_integrity()


def test_stop_conditions_eos_stop_token_and_length():
    sched = make_scheduler_for_test()
    sched.add_request(make_request("eos", 2, max_tokens=10))
    sched.add_request(make_request("stop-id", 2, max_tokens=10, stop_token_ids=[9]))
    sched.add_request(make_request("len", 2, max_tokens=2))
    sched.add_request(make_request("min", 2, max_tokens=10, min_tokens=2))
    run_step(sched, tokens={"eos": EOS, "stop-id": 9, "len": TOKEN, "min": EOS})
    assert set(sched.requests) == {"len", "min"}
    run_step(sched, tokens={"min": EOS})
    assert set(sched.requests) == set()


# --- properties over random workloads ---------------------------------------------------------
workloads = st.fixed_dictionaries({
    # (prompt length, max_tokens, priority, arrival step, tenant, timeout in steps or None)
    "requests": st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3),
                                   st.integers(0, 5), st.integers(0, 2),
                                   st.one_of(st.none(), st.integers(1, 20))),
                         min_size=1, max_size=25),
    "num_blocks": st.integers(12, 60),
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "budget": st.integers(8, 64),
    "max_num_seqs": st.integers(1, 8),
    "chunked": st.booleans(),
    "policy": st.sampled_from(["fcfs", "priority", "cache_aware", "sjf", "fair", "static"]),
    "priority_preemption": st.booleans(),
    "max_preemptions": st.integers(0, 3),
    "max_queue_delay_ms": st.one_of(st.none(), st.sampled_from([5.0, 20.0])),
    "long_cap": st.one_of(st.none(), st.integers(1, 2)),
    "eos_every": st.integers(0, 7),
    "abort_every": st.integers(0, 9),
    "caching": st.booleans(),
    "preemption_mode": st.sampled_from(["recompute", "swap", "auto"]),
    "host_blocks": st.sampled_from([0, 4, 32]),
})


@settings(max_examples=150, deadline=None)
@given(workloads)
def test_random_workloads_finish_and_return_every_block(w):
    clock = FakeClock()
    sched = make_scheduler_for_test(
        num_blocks=w["num_blocks"], block_size=w["block_size"], clock=clock,
        max_num_batched_tokens=w["budget"], max_num_seqs=w["max_num_seqs"],
        enable_chunked_prefill=w["chunked"], policy=w["policy"], priority_aging_s=0.5,
        enable_prefix_caching=w["caching"], preemption_mode=w["preemption_mode"],
        num_host_blocks=w["host_blocks"], cache_aware_max_wait_s=3.0, sjf_max_wait_s=4.0,
        priority_preemption=w["priority_preemption"],
        max_preemptions_per_request=w["max_preemptions"],
        max_queue_delay_ms=w["max_queue_delay_ms"], max_long_partial_prefills=w["long_cap"],
        long_prefill_token_threshold=8 if w["long_cap"] else 0, tenant_weights="t0=2")
    pending = sorted(enumerate(w["requests"]), key=lambda x: x[1][3])
    everyone, accepted = [], []
    step = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][1][3] <= step:  # arrivals at this step
            i, (plen, max_tokens, prio, _, tenant, timeout) = pending.pop(0)
            r = make_request(f"r{i}", plen, max_tokens=max_tokens, priority=prio,
                             arrival=clock.now, tenant=f"t{tenant}",
                             timeout_ms=None if timeout is None else 1000 * timeout)
            everyone.append(r)
            if sched.add_request(r):
                accepted.append(r)
        step += 1
        clock.now += 1.0
        tokens = {}
        if w["eos_every"]:
            tokens = {r.request_id: EOS for r in sched.running if step % w["eos_every"] == 0}
        run_step(sched, tokens=tokens)
        if w["abort_every"] and step % w["abort_every"] == 0 and sched.running:
            sched.abort_request(sched.running[0].request_id)
            sched.check_integrity()
        assert step < 5000, "a request starved"
    assert all(r.is_finished for r in everyone)
    for r in accepted:
        assert r.status != RequestStatus.REJECTED
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.max_output_tokens
        # A deadline is kept to the step: nothing runs past it, and nothing ends early.
        if r.status == RequestStatus.FINISHED_TIMEOUT:
            assert r.metrics.finished_time >= r.deadline
        elif r.deadline is not None:
            assert r.metrics.finished_time < r.deadline
    for r in everyone:
        if r.status == RequestStatus.REJECTED:
            assert r.reject_cause in ("bad_request", "queue_full", "queue_delay"), r
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks
    assert not sched.kv.block_tables and not sched.kv.host_tables
    if sched.kv.host_pool is not None:
        assert sched.kv.host_pool.num_free_blocks == sched.kv.host_pool.num_usable_blocks
    sched.check_integrity()


# --- prefix caching, swap, cache-aware ordering ------------------------------------------------
def test_a_shared_prefix_is_reused_not_recomputed():
    sched = make_scheduler_for_test(enable_prefix_caching=True, max_num_batched_tokens=64)
    first = make_request("first", 10, max_tokens=1)
    sched.add_request(first)
    run_step(sched)  # computes 10 tokens: blocks 0-1 (8 tokens) become cached
    assert first.is_finished
    second = Request("second", list(range(10, 18)) + [99, 98, 97], SamplingParams(max_tokens=1),
                     1.0, 0, (EOS,))
    sched.add_request(second)
    out = run_step(sched)
    assert chunks(out) == {"second": 3}  # 8 of its 11 tokens came from the cache
    assert second.metrics.cached_tokens == 8
    assert sched.prefix_cache_hits == 8 and sched.prefix_cache_queries == 10 + 11


def test_whole_prompt_cached_still_computes_its_last_block():
    sched = make_scheduler_for_test(enable_prefix_caching=True, max_num_batched_tokens=64)
    sched.add_request(make_request("a", 8, max_tokens=1))
    run_step(sched)
    again = make_request("b", 8, max_tokens=1)
    sched.add_request(again)
    out = run_step(sched)
    assert chunks(out) == {"b": 4} and again.metrics.cached_tokens == 4
    assert again.output_token_ids == [TOKEN]


def test_different_salts_never_share_blocks():
    sched = make_scheduler_for_test(enable_prefix_caching=True, max_num_batched_tokens=64)
    a = Request("a", list(range(10, 22)), SamplingParams(max_tokens=1), 0.0, 0, (EOS,),
                cache_salt="tenant-a")
    sched.add_request(a)
    run_step(sched)
    b = Request("b", list(range(10, 22)), SamplingParams(max_tokens=1), 0.0, 0, (EOS,),
                cache_salt="tenant-b")
    sched.add_request(b)
    assert chunks(run_step(sched)) == {"b": 12} and b.metrics.cached_tokens == 0
    c = Request("c", list(range(10, 22)), SamplingParams(max_tokens=1), 0.0, 0, (EOS,),
                cache_salt="tenant-a")
    sched.add_request(c)
    assert chunks(run_step(sched)) == {"c": 4} and c.metrics.cached_tokens == 8


def test_preemption_by_swap_keeps_the_computed_tokens():
    sched = make_scheduler_for_test(num_blocks=7, max_num_batched_tokens=64, kv_watermark=0.0,
                                    num_host_blocks=8, preemption_mode="swap")
    sched.add_request(make_request("a", 8, max_tokens=16, arrival=0.0))
    sched.add_request(make_request("b", 8, max_tokens=16, arrival=1.0))
    run_step(sched)
    swapped_out = []
    for _ in range(12):
        out = run_step(sched)
        swapped_out += out.blocks_to_swap_out
        if out.preempted:
            break
    b = sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and sched.kv.is_swapped("b")
    assert b.num_computed_tokens > 8 and len(swapped_out) == sched.kv.blocks_needed(
        b.num_computed_tokens)
    computed = b.num_computed_tokens
    while sched.requests.get("a") is not None:
        run_step(sched)
    while b.status != RequestStatus.RUNNING:
        out = run_step(sched)
    assert len(out.blocks_to_swap_in) == len(swapped_out)
    assert chunks(out)["b"] == 1  # resumes decoding: nothing recomputed
    assert b.num_computed_tokens == computed + 1


def test_auto_mode_recomputes_when_the_host_pool_is_full():
    sched = make_scheduler_for_test(num_blocks=7, max_num_batched_tokens=64, kv_watermark=0.0,
                                    num_host_blocks=1, preemption_mode="auto")
    sched.add_request(make_request("a", 8, max_tokens=16, arrival=0.0))
    sched.add_request(make_request("b", 8, max_tokens=16, arrival=1.0))
    for _ in range(14):
        out = run_step(sched)
        if out.preempted:
            break
    assert out.preempted and not out.blocks_to_swap_out
    assert sched.requests["b"].num_computed_tokens == 0


def test_cache_aware_prefers_the_longest_cached_prefix_but_not_forever():
    clock = FakeClock()
    sched = make_scheduler_for_test(enable_prefix_caching=True, policy="cache_aware",
                                    max_num_seqs=1, cache_aware_max_wait_s=5.0, clock=clock,
                                    max_num_batched_tokens=64)
    sched.add_request(make_request("warm", 12, max_tokens=1))
    run_step(sched)
    cold = Request("cold", [500 + i for i in range(12)], SamplingParams(max_tokens=1), 0.0, 0,
                   (EOS,))
    hot = make_request("hot", 13, max_tokens=1, arrival=0.5)
    sched.add_request(cold)
    sched.add_request(hot)
    assert set(chunks(run_step(sched))) == {"hot"}  # despite arriving later
    clock.now = 10.0
    sched.add_request(make_request("hot2", 13, max_tokens=1, arrival=10.0))
    assert set(chunks(run_step(sched))) == {"cold"}  # waited past the guard: it goes first
