"""A step bounded in time (``max_step_ms``): the token budget follows the target step time from
the measured cost per token, within ``max_num_batched_tokens``; long prompts are chunked under
it and the decodes run every step. Step times are fed by hand or by the simulator's clock:
nothing here reads the wall clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.orchestrator.scheduler.step_budget import (
    FIRST_STEP_TOKENS,
    GROWTH,
    StepBudget,
    default_max_step_ms,
)
from kvflow.sim.cost_model import CostModel, StepShape
from kvflow.sim.runner import SIM_EOS, SimClock, SimRunner, sim_engine_config
from tests.helpers import FakeClock, make_request, make_scheduler_for_test, run_step


def linear(fixed_s: float, per_token_s: float):
    return lambda n: fixed_s + per_token_s * n


def drive(budget: StepBudget, cost, steps: int, decode_every: int = 4) -> list[int]:
    """Run ``steps`` steps of the budget's size (every ``decode_every``-th a decode-only step
    of 4 tokens, as a served mix has), each taking ``cost(tokens)``; the planned sizes."""
    planned = []
    for k in range(steps):
        n = 4 if k % decode_every == decode_every - 1 else budget.tokens
        planned.append(n)
        budget.observe(n, cost(n))
    return planned


# --- the estimator -----------------------------------------------------------------------------

def test_the_budget_converges_to_the_target_from_measured_step_times():
    budget = StepBudget(0.2, max_tokens=2048)
    assert budget.tokens == FIRST_STEP_TOKENS  # nothing measured: a small first step
    cost = linear(0.010, 0.002)  # 95 tokens fit 200 ms
    planned = drive(budget, cost, 12)
    assert budget.fit == pytest.approx((0.010, 0.002))
    assert budget.tokens == 95
    # The way there never planned a step past twice the largest one measured.
    largest = 0
    for n in planned:
        assert n <= max(FIRST_STEP_TOKENS, GROWTH * largest)
        largest = max(largest, n)


def test_the_whole_step_is_charged_to_its_tokens_until_sizes_vary():
    budget = StepBudget(0.2, max_tokens=2048)
    for _ in range(5):
        budget.observe(24, 0.120)  # 5 ms a token, as far as one size can tell
    assert budget.fit is None and budget.per_token_s == pytest.approx(0.005)
    assert budget.tokens == 40  # 200 ms / 5 ms
    budget.observe(48, 0.180)  # sizes vary: 2.5 ms a token over a 60 ms fixed cost
    assert budget.fit is not None and budget.fit[1] > 0


def test_slow_decodes_alone_still_leave_a_prompt_a_measuring_step():
    """Decodes of one token at 400 ms each (a busy machine) cannot tell their fixed cost from
    a cost per token: charged whole to the token, a prompt would get one token a step, and
    the steps would never vary. It gets FIRST_STEP_TOKENS, the step that tells them apart."""
    budget = StepBudget(0.2, max_tokens=2048)
    for _ in range(10):
        budget.observe(1, 0.402)
    assert budget.fit is None and budget.tokens == FIRST_STEP_TOKENS
    budget.observe(FIRST_STEP_TOKENS, 0.4 + 0.002 * FIRST_STEP_TOKENS)
    assert budget.fit == pytest.approx((0.4, 0.002))
    assert abs(budget.tokens - 50) <= 1  # past the target: half of it, 100 ms, for tokens


def test_max_num_batched_tokens_still_caps_the_budget():
    budget = StepBudget(0.2, max_tokens=64)
    drive(budget, linear(0.001, 1e-5), 20)
    assert budget.tokens == 64
    assert StepBudget(0.2, max_tokens=8).tokens == 8  # the first step too


def test_a_fixed_cost_past_the_target_still_lets_a_chunk_advance():
    """No budget meets a 50 ms target when a bare step takes 80 ms: the tokens may then add
    half the target (25 ms), not one token a step; and half the fixed cost where the target
    is met only by a sliver."""
    budget = StepBudget(0.05, max_tokens=512)
    drive(budget, linear(0.080, 0.001), 20)
    assert budget.tokens == 25
    budget = StepBudget(0.1, max_tokens=512)
    drive(budget, linear(0.060, 0.001), 20)  # 60 ms fixed: the target is still met
    assert abs(budget.tokens - 40) <= 1


def test_the_budget_adapts_when_the_cost_per_token_changes():
    budget = StepBudget(0.2, max_tokens=2048)
    drive(budget, linear(0.010, 0.002), 40)
    assert budget.tokens == 95
    drive(budget, linear(0.010, 0.004), 200)  # the machine got twice as slow per token
    assert abs(budget.tokens - 47) <= 2
    drive(budget, linear(0.010, 0.001), 200)  # and then faster than at first
    assert abs(budget.tokens - 190) <= 6


def test_steps_of_one_size_that_get_slower_shrink_the_budget():
    """A long prompt alone in chunks of one size (long_prefill_token_threshold caps them), each
    costlier than the last (its attention reads a longer context): without spread the fit
    cannot refit its slope, yet it follows their time, so the next step's plan shrinks."""
    budget = StepBudget(0.2, max_tokens=2048)
    drive(budget, linear(0.010, 0.002), 40)
    assert budget.tokens == 95
    for step in range(1000):  # long enough for the steps of other sizes to be forgotten
        extra = min(0.0002 * step, 0.1)  # up to 100 ms more a step, whatever its size
        budget.observe(64, 0.010 + extra + 0.002 * 64)
    assert 40 <= budget.tokens <= 50  # (200 - 110) ms / 2 ms = 45


def test_the_first_step_and_pauses_do_not_set_the_cost():
    """A runner's first step (its lazy setup) is not measured, and a pause counts for at most
    OUTLIER_FACTOR times the step's prediction: one slow step cannot collapse the budget."""
    budget = StepBudget(0.2, max_tokens=2048)
    cost = linear(0.010, 0.002)
    budget.observe(32, 3.0)  # the first step: seconds of setup
    assert budget.per_token_s is None and budget.tokens == FIRST_STEP_TOKENS
    drive(budget, cost, 12)
    assert budget.tokens == 95
    budget.observe(95, 5.0)  # a pause of seconds in one step
    assert budget.tokens >= 95 // 2
    drive(budget, cost, 200)  # forgotten
    assert abs(budget.tokens - 95) <= 1


def test_bad_target_is_refused():
    with pytest.raises(ValueError, match="target_s must be > 0"):
        StepBudget(0.0, 16)


def test_the_default_target_is_the_runners():
    assert default_max_step_ms("onnxruntime") == default_max_step_ms("torch") == 200.0
    assert default_max_step_ms("triton") == default_max_step_ms("sim") == 0.0


# --- the scheduler -----------------------------------------------------------------------------

def timed_step(sched, cost):
    """One step whose time, ``cost(tokens)``, the scheduler observes as the engine's recorder
    reports it."""
    out = run_step(sched)
    decode = sum(1 for s in out.scheduled if s.is_decode)
    n = out.num_batched_tokens
    sched.observe_step(n - decode, cost(n), n)
    return out


def test_a_4k_prompt_is_chunked_under_the_budget_while_every_decode_runs():
    cost = linear(0.005, 0.004)  # 48 tokens fit 200 ms
    sched = make_scheduler_for_test(num_blocks=400, block_size=16, clock=FakeClock(),
                                    max_num_batched_tokens=2048, max_model_len=8192,
                                    max_step_ms=200.0)
    streams = [make_request(f"s{k}", 20, max_tokens=400) for k in range(3)]
    for r in streams:
        sched.add_request(r)
    for _ in range(10):
        timed_step(sched, cost)
    assert all(r.num_output_tokens > 0 for r in streams)
    assert sched.token_budget == 48
    sched.add_request(make_request("long", 4096, max_tokens=2))
    long_chunks = []
    while sched.requests["long"].num_output_tokens == 0:
        out = timed_step(sched, cost)
        got = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
        assert all(got[r.request_id] == 1 for r in streams), got  # the decodes, every step
        assert out.num_batched_tokens <= 48
        assert cost(out.num_batched_tokens) <= 0.2
        long_chunks.append(got.get("long", 0))
    assert sum(long_chunks) == 4096
    assert max(long_chunks) == 48 - 3 and len(long_chunks) >= 4096 // 45


def test_no_time_target_is_max_num_batched_tokens():
    sched = make_scheduler_for_test(max_num_batched_tokens=16)
    assert sched.step_budget is None and sched.token_budget == 16
    sched.add_request(make_request("a", 40))
    assert run_step(sched).num_batched_tokens == 16


def test_decodes_behind_a_prefill_keep_their_token_when_the_budget_falls():
    """A prompt admitted before a short one keeps prefilling while the short one decodes
    behind it; when the measured cost rises and the budget collapses, the prompt's chunk
    leaves the decode its token (no stall), and the prompt still advances."""
    sched = make_scheduler_for_test(num_blocks=400, max_num_batched_tokens=64,
                                    max_model_len=2048, max_step_ms=100.0,
                                    long_prefill_token_threshold=20)
    cheap = linear(0.001, 0.001)
    sched.add_request(make_request("long", 1000, max_tokens=2))
    timed_step(sched, cheap)  # "long": its first chunk (20)
    sched.add_request(make_request("short", 4, max_tokens=300))
    out = timed_step(sched, cheap)  # "long" 20, "short" admitted with 4
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("long", 20), ("short", 4)]
    dear = linear(0.2, 0.1)  # 100 ms a token, over a fixed cost past the target
    for n in (1, 30) * 100:  # the machine slowed down (as steps of other sizes measured it)
        sched.observe_step(0, dear(n), n)
    for _ in range(20):
        out = timed_step(sched, dear)
        got = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
        assert got["short"] == 1 and got["long"] >= 1, got
    assert sched.token_budget == 1
    assert got == {"long": 2, "short": 1}  # a token per running request and one more


# --- the simulator: the same scheduler on simulated time ---------------------------------------

@dataclass(frozen=True)
class AttentionCost(CostModel):
    """A step costs a fixed part, a part per token and a part per attention pair (so a chunk
    late in a long prompt costs more per token than an early one)."""

    fixed_s: float = 0.004
    per_token_s: float = 0.0005
    per_pair_s: float = 2e-8

    def step_time_s(self, shape: StepShape) -> float:
        return (self.fixed_s + self.per_token_s * shape.num_tokens
                + self.per_pair_s * shape.attention_pairs)


def worst_gap_beside_a_long_prompt(max_step_ms: float) -> tuple[float, int]:
    """A stream decodes while a 4,000-token prompt arrives, on simulated time: the stream's
    worst gap between tokens after its first, and the prompt's number of chunks."""
    clock = SimClock()
    runner = SimRunner(sim_engine_config(16, 8192, 4096, 8), 700, AttentionCost(), clock)
    options = EngineOptions(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=8192,
                            max_step_ms=max_step_ms, debug_checks=True)
    engine = LLMEngine(runner, None, options, (SIM_EOS,), clock=clock)
    stream, _ = engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=300,
                                                                        ignore_eos=True))
    for _ in range(20):
        engine.step()
    long, _ = engine.add_request(list(range(1, 4001)), SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    times = stream.metrics.token_times
    chunks = sum(1 for s in engine.step_stats for rid, n in s.scheduled
                 if rid == long.request_id and n > 1)
    return max(b - a for a, b in zip(times[1:], times[2:], strict=False)), chunks


def test_the_simulator_feeds_the_budget_and_the_stream_keeps_its_gap():
    unbounded, one = worst_gap_beside_a_long_prompt(0.0)
    bounded, many = worst_gap_beside_a_long_prompt(50.0)
    assert one == 1 and unbounded > 0.5  # the whole prompt in one step: a long stall
    assert many > 10
    assert bounded < 2 * 0.050  # the target: under twice the step target
