"""The engine's LoRA side on the simulator's runner (adapters are real PEFT folders, read and
checked; the simulated model applies nothing): selection per request, the slot pool's LRU,
swaps and evictions, the lifecycle, the prefix cache keyed by adapter, KV events, metrics and
the console. Numerics against HF + PEFT: tests/test_lora_exact.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvflow.kv_manager.block_pool import BlockStored
from kvflow.lora.adapter import LORA_MODULES, module_shape
from kvflow.model.config import ModelConfig
from kvflow.observability.metrics import EngineMetrics, MetricsRegistry, series_key
from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.lora_manager import LoraInUseError
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.outputs import RequestError
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.runtime.step_builder import SeqChunk, build_step_shape
from kvflow.sim.cost_model import FixedCostModel
from kvflow.sim.runner import SIM_EOS, SimClock, SimRunner, sim_engine_config

BLOCK = 4


def write_peft_adapter(folder: Path, config: ModelConfig, rank: int = 4, seed: int = 0,
                       targets: tuple[str, ...] = LORA_MODULES, alpha: float = 8.0) -> Path:
    """A PEFT LoRA folder for ``config`` (random A and B), as PEFT's save_pretrained writes
    it: adapter_config.json and adapter_model.safetensors."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in targets:
            out_f, in_f = module_shape(config, module)
            group = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) \
                else "mlp"
            key = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(size=(rank, in_f)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(size=(out_f, rank)).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
        "bias": "none", "base_model_name_or_path": "sim"}))
    return folder


def sim_engine(**options) -> LLMEngine:
    clock = SimClock()
    config = sim_engine_config(BLOCK, 256, 64, 8)
    runner = SimRunner(config, options.pop("num_blocks", 64), FixedCostModel(0.01), clock)
    opts = EngineOptions(**{"max_num_batched_tokens": 64, "max_model_len": 256,
                            "max_num_seqs": 8, "debug_checks": True, "enable_lora": True,
                            **options})
    return LLMEngine(runner, None, opts, (SIM_EOS,), clock=clock)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    config = sim_engine_config(BLOCK, 256, 64, 8).model
    root = tmp_path_factory.mktemp("sim-loras")
    return {f"a{i}": write_peft_adapter(root / f"a{i}", config, seed=i) for i in range(6)}


def params(max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_lora_modules_load_at_start_and_a_bad_one_is_named(adapters, tmp_path):
    engine = sim_engine(lora_modules={"x": str(adapters["a0"]), "y": str(adapters["a1"])})
    assert [a["name"] for a in engine.list_loras()] == ["x", "y"]
    assert [engine.lora.lora_id(n) for n in ("x", "y")] == [1, 2]
    bad = write_peft_adapter(tmp_path / "big", sim_engine_config(BLOCK, 256, 64, 8).model,
                             rank=32)
    with pytest.raises(ValueError, match=r"lora_modules: adapter 'z' .*rank"):
        sim_engine(lora_modules={"z": str(bad)})
    with pytest.raises(ValueError, match="lora_modules: adapter 'w' .*no such file"):
        sim_engine(lora_modules={"w": str(tmp_path / "missing")})


def test_an_unknown_adapter_is_refused_naming_the_field_model(adapters):
    engine = sim_engine()
    engine.add_lora("known", adapters["a0"])
    with pytest.raises(RequestError, match=r"model: no adapter 'nope'; loaded: \['known'\]"):
        engine.add_request([1, 2, 3], params(), lora_name="nope")
    assert engine.counters.rejected_by_cause["bad_request"] == 1
    off = sim_engine(enable_lora=False)
    assert off.lora is None
    with pytest.raises(RequestError, match="model: no adapter 'known'; LoRA adapters are off"):
        off.add_request([1, 2, 3], params(), lora_name="known")
    with pytest.raises(ValueError, match="LoRA adapters are off on this engine"):
        off.add_lora("known", adapters["a0"])


def test_load_use_unload_and_load_again(adapters):
    engine = sim_engine(max_loras=2)
    engine.add_lora("x", adapters["a0"])
    with pytest.raises(ValueError, match="'x' is loaded already"):
        engine.add_lora("x", adapters["a1"])
    engine.add_request([1, 2, 3, 4, 5], params(6), "run", lora_name="x")
    engine.add_request([1, 2, 3], params(), "wait", lora_name="x", arrival_time=1.0)
    engine.step()
    with pytest.raises(LoraInUseError, match=r"'x' is in use by request\(s\) \['run', 'wait'\]"):
        engine.remove_lora("x")
    run(engine)
    engine.remove_lora("x")
    assert engine.list_loras() == []
    with pytest.raises(RequestError, match="no adapter 'x'"):
        engine.add_request([1, 2], params(), lora_name="x")
    engine.add_lora("other", adapters["a1"])
    engine.add_lora("x", adapters["a2"])  # the same name keeps its lora_id
    assert engine.lora.lora_id("x") == 1 and engine.lora.lora_id("other") == 2
    engine.add_request([1, 2, 3], params(), "again", lora_name="x")
    assert "again" in run(engine)
    with pytest.raises(ValueError, match="'gone' is not loaded"):
        engine.remove_lora("gone")


def test_more_adapters_than_slots_under_load_all_finish_with_evictions_counted(adapters):
    engine = sim_engine(max_loras=2)
    for name, path in adapters.items():
        engine.add_lora(name, path)
    names = [*adapters, None]
    for i in range(28):
        engine.add_request(list(range(1, 6 + i % 5)), params(2 + i % 4), f"r{i}",
                           lora_name=names[i % len(names)])
    seen_per_step = []
    while engine.has_unfinished_requests():
        sched_before = {r.lora_name for r in engine.scheduler.running} - {None}
        engine.step()  # debug_checks: the KV pool, the LoRA counts and slots every step
        seen_per_step.append(len(sched_before))
    assert max(seen_per_step) <= 2
    assert engine.counters.finished == 28
    assert engine.lora.evictions > 0
    assert engine.lora.swaps == engine.lora.evictions + 2  # two loads into free slots
    assert not engine.scheduler.loras.running and engine.kv.pool.num_used_blocks == 0


def test_the_same_prompt_under_two_adapters_or_the_base_shares_no_block(adapters):
    engine = sim_engine(enable_prefix_caching=True)
    engine.add_lora("x", adapters["a0"])
    engine.add_lora("y", adapters["a1"])
    engine.kv.pool.record_events()
    prompt = list(range(1, 18))  # four full blocks
    hits = []
    for rid, lora in (("x1", "x"), ("y1", "y"), ("b1", None), ("x2", "x"), ("y2", "y"),
                      ("b2", None)):
        before = engine.counters.prefix_cache_hits
        engine.add_request(prompt, params(1), rid, lora_name=lora)
        run(engine)
        hits.append(engine.scheduler.prefix_cache_hits - before)
    assert hits[:3] == [0, 0, 0] and hits[3:] == [16, 16, 16]
    stored = [e for e in engine.kv.pool.take_events() if isinstance(e, BlockStored)]
    assert {e.lora_id for e in stored} == {1, 2, None}
    assert len({e.block_hash for e in stored}) == len(stored) == 12
    assert not any(e.salted for e in stored)


def test_step_input_lora_slots_follow_each_chunks_tokens():
    chunks = [SeqChunk("a", [1, 2, 3], 0, 3, True, lora_slot=1),
              SeqChunk("b", [4], 0, 1, True),
              SeqChunk("c", [5, 6], 0, 2, True, lora_slot=0)]
    assert build_step_shape(chunks).lora_slots.tolist() == [1, 1, 1, -1, 0, 0]
    assert build_step_shape(chunks[1:2]).lora_slots is None


def test_metrics_and_console_show_the_adapters(adapters):
    from kvflow.console.state import engine_state

    engine = sim_engine(max_loras=1)
    engine.add_lora("x", adapters["a0"])
    engine.add_lora("y", adapters["a1"])
    engine.add_request([1, 2, 3], params(4), "rx", lora_name="x")
    engine.add_request([1, 2, 3], params(4), "ry", lora_name="y")
    engine.step()
    gauges, totals = EngineMetrics.state(engine)
    running = series_key("kvflow_lora_requests_running", "lora_name", "x")
    assert gauges[running] == 1.0
    assert gauges[series_key("kvflow_lora_requests_running", "lora_name", "y")] == 0.0
    assert gauges["kvflow_lora_resident"] == 1.0
    assert totals["kvflow_lora_swaps_total"] == 1 and totals["kvflow_lora_evictions_total"] == 0
    state = engine_state(engine)
    assert {r["id"]: r["lora_name"] for r in state["requests"]} == {"rx": "x", "ry": "y"}
    assert [(a["name"], a["resident"], a["running"]) for a in state["loras"]] == [
        ("x", True, 1), ("y", False, 0)]
    run(engine)
    reg = MetricsRegistry()
    reg.set_state(*EngineMetrics.state(engine))
    text = reg.exposition({"model": "m"})
    assert 'kvflow_lora_requests_running{model="m",lora_name="y"} 0.0' in text
    assert 'kvflow_lora_evictions_total{model="m"} 1.0' in text


def test_the_engine_loop_takes_lora_name_and_loads_through_call(adapters):
    import queue

    from kvflow.orchestrator.engine_loop import EngineLoop
    from kvflow.orchestrator.outputs import ErrorCode

    loop = EngineLoop(sim_engine())
    try:
        got: queue.SimpleQueue = queue.SimpleQueue()
        loop.submit("early", [1, 2, 3], params(), got.put, lora_name="x")
        early = got.get(timeout=30)
        assert early.finished and early.error_code == ErrorCode.BAD_REQUEST
        assert "model: no adapter 'x'" in early.error
        loop.call(lambda e: e.add_lora("x", adapters["a0"]))
        loop.submit("late", [1, 2, 3], params(), got.put, lora_name="x")
        while not (out := got.get(timeout=30)).finished:
            pass
        assert out.error is None and len(out.outputs[0].token_ids) == 3
        assert [a["name"] for a in loop.call(lambda e: e.list_loras())] == ["x"]
        loop.call(lambda e: e.remove_lora("x"))
    finally:
        loop.shutdown()


def test_static_batches_start_adapters_a_step_may_not_reach(adapters):
    """The static scheduler starts a batch whose requests a token-bound step may not all reach:
    an adapter started but not yet run need not be in a slot (it is loaded on its step), and
    the invariants hold every step (debug_checks)."""
    engine = sim_engine(policy="static", max_num_batched_tokens=8, max_loras=1)
    engine.add_lora("x", adapters["a0"])  # x takes the one slot
    engine.add_lora("y", adapters["a1"])
    engine.add_request(list(range(1, 9)), params(2), "base")
    engine.add_request([1, 2, 3], params(2), "lora", lora_name="y")
    done = run(engine)
    assert sorted(done) == ["base", "lora"] and all(len(t) == 2 for t in done.values())


@pytest.mark.parametrize("name", ['a"', "a}", "{a", "a\\b", "a b", "a=b", "", "x" * 257])
def test_an_adapter_name_that_labels_or_flags_would_misread_is_refused(adapters, name):
    engine = sim_engine()
    with pytest.raises(ValueError, match="lora_name"):
        engine.add_lora(name, adapters["a0"])
    with pytest.raises(ValueError, match="lora_modules"):
        EngineOptions(lora_modules={name: str(adapters["a0"])})
    assert engine.list_loras() == []
