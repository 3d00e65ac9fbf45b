"""The LoRA slot limit in the scheduler: at most ``max_loras`` distinct adapters run at once (so
in any step), a request of another adapter waits without holding back the base model's, is not
starved, and preemption and resume keep to the limit. Pure Python: hand-built requests, a
scheduler on a small KV pool, a hand runner."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.orchestrator.request import Request, RequestStatus
from kvflow.orchestrator.sampling.params import SamplingParams
from tests.helpers import EOS, chunks, make_scheduler_for_test, run_step


def lora_request(rid: str, lora: str | None, prompt_len: int = 4, max_tokens: int = 3,
                 priority: int = 0, arrival: float = 0.0) -> Request:
    """A request under adapter ``lora`` (None: the base model)."""
    return Request(rid, list(range(10, 10 + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival, priority,
                   (EOS,), lora_name=lora, lora_id=None if lora is None else 1)


def step_adapters(out) -> set[str]:
    return {s.request.lora_name for s in out.scheduled if s.request.lora_name is not None}


def test_a_third_adapter_waits_while_two_run_and_the_base_goes_past_it():
    sched = make_scheduler_for_test(max_loras=2, max_num_batched_tokens=64)
    for r in (lora_request("a", "A"), lora_request("b", "B"), lora_request("c", "C"),
              lora_request("base", None)):
        sched.add_request(r)
    out = run_step(sched)
    assert set(chunks(out)) == {"a", "b", "base"}  # c waits for a slot; base needs none
    assert sched.requests["c"].status == RequestStatus.WAITING
    assert dict(sched.loras.running) == {"A": 1, "B": 1}
    while sched.requests.get("a") is not None:  # a and b finish; then c runs
        assert step_adapters(run_step(sched)) <= {"A", "B"}
    out = run_step(sched)
    assert "c" in chunks(out) and dict(sched.loras.running) == {"C": 1}


def test_a_waiting_adapter_is_not_starved_by_a_stream_of_running_ones():
    """max_loras=1: A's requests keep coming, but none that came after the B request is
    admitted before it, so A drains and B gets the slot."""
    sched = make_scheduler_for_test(max_loras=1, max_num_batched_tokens=64)
    sched.add_request(lora_request("a0", "A", max_tokens=4))
    run_step(sched)
    sched.add_request(lora_request("b", "B"))
    scheduled_before_b: set[str] = set()
    for i in range(1, 12):
        sched.add_request(lora_request(f"a{i}", "A", max_tokens=4))
        out = run_step(sched)
        if "b" in chunks(out):
            break
        scheduled_before_b |= set(chunks(out))
    assert sched.requests["b"].status == RequestStatus.RUNNING
    assert scheduled_before_b == {"a0"}  # none of the A requests that came after b


def test_base_requests_are_admitted_past_a_blocked_adapter():
    sched = make_scheduler_for_test(max_loras=1, max_num_batched_tokens=64)
    sched.add_request(lora_request("a", "A", max_tokens=6))
    run_step(sched)
    sched.add_request(lora_request("b", "B"))
    sched.add_request(lora_request("base", None))
    out = run_step(sched)
    assert "base" in chunks(out) and "b" not in chunks(out)


def test_priority_preemption_frees_a_slot_for_a_higher_priority_adapter():
    sched = make_scheduler_for_test(max_loras=1, policy="priority",
                                    max_num_batched_tokens=64)
    sched.add_request(lora_request("low", "A", priority=5, max_tokens=8))
    run_step(sched)
    sched.add_request(lora_request("high", "B", priority=0))
    out = run_step(sched)
    assert "high" in chunks(out)
    assert sched.requests["low"].status == RequestStatus.PREEMPTED
    assert dict(sched.loras.running) == {"B": 1}
    while sched.requests.get("high") is not None:
        run_step(sched)
    out = run_step(sched)  # the preempted one resumes once its adapter fits again
    assert "low" in chunks(out) and dict(sched.loras.running) == {"A": 1}


def test_priority_preemption_of_a_request_that_frees_no_slot_does_not_happen():
    sched = make_scheduler_for_test(max_loras=1, policy="priority",
                                    max_num_batched_tokens=64)
    sched.add_request(lora_request("keep", "A", priority=0, max_tokens=8))
    sched.add_request(lora_request("low", None, priority=5, max_tokens=8))
    run_step(sched)
    sched.add_request(lora_request("high", "B", priority=1))
    out = run_step(sched)
    # Preempting "low" (the base) would free no slot: nothing is preempted, "high" waits.
    assert not out.preempted and "high" not in chunks(out)


def test_static_batching_keeps_to_the_limit():
    sched = make_scheduler_for_test(max_loras=1, policy="static", max_num_batched_tokens=64)
    for r in (lora_request("a", "A"), lora_request("b", "B"), lora_request("a2", "A")):
        sched.add_request(r)
    out = run_step(sched)
    assert set(chunks(out)) == {"a"}  # head of line: b waits, and a2 behind it


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([None, "A", "B", "C", "D"]),
                          st.integers(1, 12), st.integers(1, 6), st.integers(0, 3)),
                min_size=1, max_size=14),
       st.integers(1, 3), st.sampled_from(["fcfs", "priority", "sjf"]))
def test_every_step_holds_at_most_max_loras_adapters_and_every_request_ends(specs, max_loras,
                                                                           policy):
    sched = make_scheduler_for_test(num_blocks=24, max_loras=max_loras, policy=policy,
                                    max_num_batched_tokens=16, max_num_seqs=4)
    for i, (lora, prompt_len, max_tokens, priority) in enumerate(specs):
        assert sched.add_request(lora_request(f"r{i}", lora, prompt_len, max_tokens,
                                              priority, arrival=i * 0.01))
    for _ in range(400):
        if not sched.has_unfinished_requests():
            break
        out = run_step(sched)  # check_integrity: the running adapters within max_loras
        assert len(step_adapters(out)) <= max_loras
    assert not sched.has_unfinished_requests()
    assert not sched.loras.running
