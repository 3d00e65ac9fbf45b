"""The simulator: the real scheduler in simulated time, and the roofline cost model."""

from __future__ import annotations

import pytest

from kvflow.orchestrator.options import EngineOptions
from kvflow.sim.cost_model import (
    HARDWARE,
    MODELS,
    FixedCostModel,
    HardwareSpec,
    ModelSpec,
    RooflineCostModel,
    StepShape,
)
from kvflow.sim.simulator import simulate
from kvflow.workloads.specs import RequestSpec
from kvflow.workloads.synthetic import random_workload


def test_two_requests_with_known_step_times_give_exact_ttft_and_e2e():
    # A arrives at 0, B at 0.5; every step takes 1 s; 4-token prompts, 3 output tokens each.
    specs = [RequestSpec(0.0, 4, 3), RequestSpec(0.5, 4, 3)]
    result = simulate(specs, FixedCostModel(1.0), EngineOptions(max_model_len=64),
                      num_blocks=32, block_size=4)
    a, b = result.timings
    # step 1 [0,1): A's prompt -> A token 1 at 1.0. step 2 [1,2): A decode + B's prompt.
    # step 3 [2,3): both decode -> A done at 3.0. step 4 [3,4): B's last token.
    assert a.token_times_s == [1.0, 2.0, 3.0]
    assert b.token_times_s == [2.0, 3.0, 4.0]
    assert a.ttft_s == 1.0 and a.e2e_s == 3.0
    assert b.ttft_s == 1.5 and b.e2e_s == 3.5
    assert result.batches == [[("0", 4)], [("0", 1), ("1", 4)], [("0", 1), ("1", 1)],
                              [("1", 1)]]
    assert result.duration_s == 4.0


def test_roofline_against_hand_computed_step_times():
    hw = HardwareSpec("toy", peak_flops=1e12, mem_bandwidth_bytes_s=1e11, flops_efficiency=0.5,
                      mem_efficiency=0.5, step_overhead_s=0.001)
    model = ModelSpec("toy", num_params=1e9, num_layers=2, hidden_size=64, num_heads=4,
                      num_kv_heads=2, head_dim=16, vocab_size=100, dtype_bytes=2)
    cost = RooflineCostModel(hw, model)
    # One decode at context 100: memory-bound.
    decode = StepShape(new_tokens=(1,), seq_lens=(100,), num_logits=1)
    flops = 2e9 * 1 + 4 * 2 * 4 * 16 * 100  # linear + attention over 100 positions
    kv_per_token = 2 * 2 * 2 * 16 * 2
    mem = 1e9 * 2 + 100 * kv_per_token + 1 * kv_per_token
    assert cost.compute_flops(decode) == pytest.approx(flops)
    assert cost.memory_bytes(decode) == pytest.approx(mem)
    assert cost.step_time_s(decode) == pytest.approx(max(flops / 5e11, mem / 5e10) + 0.001)
    assert mem / 5e10 > flops / 5e11
    # A 1000-token prefill: compute-bound; causal pairs 1000 * 1001 / 2.
    prefill = StepShape(new_tokens=(1000,), seq_lens=(1000,), num_logits=1)
    flops = 2e9 * 1000 + 4 * 2 * 4 * 16 * (1000 * 1001 / 2)
    assert cost.compute_flops(prefill) == pytest.approx(flops)
    assert cost.step_time_s(prefill) == pytest.approx(flops / 5e11 + 0.001)
    # Tensor parallelism divides both sides.
    tp2 = RooflineCostModel(hw, ModelSpec(**{**model.__dict__, "tp": 2}))
    assert tp2.step_time_s(prefill) == pytest.approx(flops / 5e11 / 2 + 0.001)


def test_presets_exist_and_give_plausible_decode_times():
    for hw in ("H100", "H200", "A100", "L40S", "CPU"):
        assert hw in HARDWARE
    cost = RooflineCostModel(HARDWARE["H100"], MODELS["llama-3-8b"])
    t = cost.step_time_s(StepShape((1,) * 32, (1024,) * 32, 32))
    assert 0.005 < t < 0.05  # ~16 GB of weights at ~2.7 TB/s + overhead


@pytest.mark.slow
def test_simulator_and_real_engine_make_identical_decisions(tiny_engines):
    """The same requests, one step = one fixed second: the real engine (tiny model, real runner)
    and the simulator schedule the same batches, step by step."""
    from kvflow.orchestrator.engine import LLMEngine
    from kvflow.orchestrator.sampling.params import SamplingParams
    from kvflow.runtime import create_runner
    from kvflow.sim.runner import SimClock

    # Twelve requests within 4 s (4 steps), each running 8-24 decode steps: four run at once.
    # Sequences grow to 18-54 tokens (up to 14 blocks of 4): four running ones need more than
    # the 23 usable blocks, so the scheduler must preempt, and both sides must preempt alike.
    specs = random_workload(12, 20, 16, rate=2.0, burstiness=1.0, seed=5, range_ratio=0.5)
    # The token budget alone: a step bounded in time (the torch runner's default) would plan
    # from measured step times, and the real engine's are not the simulator's.
    sched = EngineOptions(max_num_seqs=4, max_num_batched_tokens=24, max_model_len=128,
                          enable_prefix_caching=False, max_step_ms=0.0)
    sim = simulate(specs, FixedCostModel(1.0), sched, num_blocks=24, block_size=4)

    clock = SimClock()
    runner = create_runner("torch", tiny_engines["llama-gqa4", "torch"], 24)
    real = LLMEngine(runner, None, sched, (), clock=clock)
    pending = sorted(enumerate(specs), key=lambda x: (x[1].arrival_s, x[0]))
    try:
        while pending or real.has_unfinished_requests():
            if not real.has_unfinished_requests():
                clock.now = max(clock.now, pending[0][1].arrival_s)
            while pending and pending[0][1].arrival_s <= clock.now:
                i, s = pending.pop(0)
                real.add_request([3 + (i * 7 + j) % 300 for j in range(s.prompt_tokens)],
                                 SamplingParams(max_tokens=s.output_tokens, temperature=0.0,
                                                ignore_eos=True),
                                 request_id=str(i), arrival_time=s.arrival_s)
            real.step()
            clock.now += 1.0
        batches = [s.scheduled for s in real.step_stats]  # as the simulator reads its own
    finally:
        runner.close()
    assert sim.counters.preemptions > 0
    assert batches == sim.batches


# --- KV fragmentation, series, priorities ------------------------------------------------------

def test_static_batching_reserves_whole_sequences_which_shows_as_fragmentation():
    # One request, 4-token prompt, 8 output tokens, blocks of 4: static batching reserves
    # 12 slots (3 blocks) up front. After the prefill step 4 slots are filled: 8/12 unfilled.
    specs = [RequestSpec(0.0, 4, 8)]
    static = EngineOptions(max_model_len=64, policy="static", enable_prefix_caching=False)
    result = simulate(specs, FixedCostModel(1.0), static, num_blocks=16, block_size=4,
                      series_period_s=1.0)
    # A sample is the state as of its time, before the events due then: at 0.0 the request
    # has not arrived; at 1.0 the prefill step has ended.
    empty, first = result.series[:2]
    assert empty["t_s"] == 0.0 and empty["kvflow_kv_cache_usage_ratio"] == 0.0
    assert first["t_s"] == 1.0
    assert first["kvflow_kv_cache_fragmentation_ratio"] == pytest.approx(8 / 12)
    assert first["kvflow_kv_cache_usage_ratio"] == pytest.approx(3 / 15)  # block 0 is null
    assert first["batch_tokens"] == 4 and first["kvflow_num_requests_running"] == 1
    # Continuous batching allocates as it goes: 1 block after the prefill, 0 unfilled.
    cont = simulate(specs, FixedCostModel(1.0), EngineOptions(max_model_len=64),
                    num_blocks=16, block_size=4, series_period_s=1.0)
    assert cont.series[1]["kvflow_kv_cache_fragmentation_ratio"] == 0.0
    assert cont.series[1]["kvflow_kv_cache_usage_ratio"] == pytest.approx(1 / 15)
    assert [r["t_s"] for r in cont.series] == [float(t) for t in range(0, 9)] + [8.0]
    assert cont.queue_s == [0.0]


def test_priorities_reach_the_real_priority_scheduler():
    # Two requests waiting at t=0 behind a full batch slot: the one of priority 0 goes first.
    specs = [RequestSpec(0.0, 4, 2), RequestSpec(0.0, 4, 2), RequestSpec(0.0, 4, 2)]
    sched = EngineOptions(max_num_seqs=1, max_model_len=64, policy="priority")
    result = simulate(specs, FixedCostModel(1.0), sched, num_blocks=16, block_size=4,
                      priorities=[1, 1, 0])
    order = sorted(range(3), key=lambda i: result.timings[i].token_times_s[0])
    assert order[0] == 2
    with pytest.raises(ValueError, match="priorities"):
        simulate(specs, FixedCostModel(1.0), sched, 16, 4, priorities=[0])


# --- the calibrated (linear) cost model --------------------------------------------------------

def test_nonnegative_fit_recovers_known_coefficients_and_drops_negative_ones():
    from kvflow.sim.cost_model import LINEAR_FEATURES, fit_nonnegative, linear_features

    truth = {"step": 2e-3, "tokens": 1e-4, "seqs": 5e-5, "attention_pairs": 0.0,
             "context_tokens": 1e-6, "first_chunks": 3e-3}
    shapes = [StepShape((n,), (n,), 1) for n in (8, 64, 256, 512)]
    shapes += [StepShape((1,) * b, (c,) * b, b) for b in (1, 4, 16) for c in (32, 512)]
    shapes += [StepShape((64, 1), (128, 40), 2), StepShape((32, 1, 1), (32, 9, 90), 3)]
    rows = [linear_features(s) for s in shapes]
    times = [sum(truth[k] * x for k, x in zip(LINEAR_FEATURES, r, strict=True)) for r in rows]
    coef = fit_nonnegative(rows, times)
    for k, c in zip(LINEAR_FEATURES, coef, strict=True):
        assert c == pytest.approx(truth[k], rel=1e-6, abs=1e-12), k
    # Data a negative per-sequence cost (5e-5 - 1e-4) would fit better: it is held at 0, and
    # the others stay non-negative.
    skew = [t - 1e-4 * r[2] for t, r in zip(times, rows, strict=True)]
    skewed = dict(zip(LINEAR_FEATURES, fit_nonnegative(rows, skew), strict=True))
    assert skewed["seqs"] == 0.0
    assert min(skewed.values()) >= 0.0


def test_linear_cost_model_round_trips_and_rejects_bad_files(tmp_path):
    from kvflow.sim.cost_model import LINEAR_FEATURES, LinearCostModel

    coef = dict(zip(LINEAR_FEATURES, (1e-3, 2e-4, 3e-5, 1e-9, 1e-7, 5e-3), strict=True))
    model = LinearCostModel(coef, {"engine": "x"})
    shape = StepShape((100, 1), (100, 50), 2)  # one request starts, one decodes
    assert shape.num_first_chunks == 1
    assert model.step_time_s(shape) == pytest.approx(
        1e-3 + 2e-4 * 101 + 3e-5 * 2 + 1e-9 * shape.attention_pairs + 1e-7 * 150 + 5e-3)
    model.save(tmp_path / "c.json")
    again = LinearCostModel.load(tmp_path / "c.json")
    assert again.coefficients == coef and again.meta == {"engine": "x"}
    with pytest.raises(ValueError, match=">= 0"):
        LinearCostModel({**coef, "seqs": -1.0})
    with pytest.raises(FileNotFoundError, match="simulate calibrate"):
        LinearCostModel.load(tmp_path / "missing.json")


def test_kv_blocks_for_a_model_on_a_device():
    m = MODELS["llama-3-8b"]  # 16 GB of weights, 128 KiB of KV per token
    blocks = m.kv_blocks_for(HARDWARE["H100"], 16)
    assert blocks == int((80e9 * 0.9 - 8.03e9 * 2) // (16 * 131072))
    with pytest.raises(ValueError, match="does not fit"):
        MODELS["llama-3-70b"].kv_blocks_for(HARDWARE["H100"], 16)
    assert ModelSpec(**{**MODELS["llama-3-70b"].__dict__, "tp": 4}).kv_blocks_for(
        HARDWARE["H100"], 16) > 0


def test_step_shape_matches_the_full_step_build():
    """A runner with needs_inputs False (the simulator's) gets the same step shape as the
    full build would give, without the token ids, slots or block tables."""
    import numpy as np

    from kvflow.kv_manager import KVCacheManager
    from kvflow.runtime.step_builder import SeqChunk, build_step, build_step_shape

    kv = KVCacheManager(num_blocks=16, block_size=4)
    assert kv.allocate_slots("a", 9) and kv.allocate_slots("b", 3)
    chunks = [SeqChunk("a", list(range(9)), 8, 1, True),
              SeqChunk("b", [7, 8, 9], 0, 3, False)]
    full, shape = build_step(kv, chunks), build_step_shape(chunks)
    for name in ("seq_lens", "query_start_loc", "logits_indices"):
        assert np.array_equal(getattr(full, name), getattr(shape, name)), name
        assert getattr(full, name).dtype == getattr(shape, name).dtype, name
    assert shape.input_ids.size == 0 and shape.block_tables.shape == (2, 0)
