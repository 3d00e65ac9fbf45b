"""One options dataclass: it generates the CLI flags, the Triton parameters and the LLM overrides'
validation; and the invariants it can switch on in a running engine."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import fields

import pytest

from kvflow.orchestrator.options import (
    EngineOptions,
    format_option,
    option_fields,
    options_from_parameters,
    options_to_parameters,
    parse_option,
)
from kvflow.orchestrator.scheduler.registry import SCHEDULERS

# A value for each option other than its default, valid on the tiny engines (limits 256/256/16).
NON_DEFAULT = {
    "enable_lora": True, "lora_modules": {"ad": "/tmp/kvflow-options-test-lora"}, "max_loras": 2,
    "max_lora_rank": 8,
    "max_num_seqs": 3, "max_num_batched_tokens": 40, "max_step_ms": 0.0, "max_model_len": 100,
    "enable_chunked_prefill": False, "long_prefill_token_threshold": 8,
    "max_waiting_requests": 7, "policy": "priority", "priority_aging_s": 2.5,
    "kv_watermark": 0.05, "static_batch_size": 2, "enable_prefix_caching": False,
    "preemption_mode": "swap", "recompute_tokens_per_s": 123.0, "swap_bytes_per_s": 1e6,
    "cache_aware_max_wait_s": 1.5, "priority_preemption": False,
    "max_preemptions_per_request": 1, "sjf_max_wait_s": 3.0, "tenant_weights": "a=2,b=1",
    "fair_output_weight": 1.5, "request_timeout_s": 30.0, "max_queue_delay_ms": 500.0,
    "max_long_partial_prefills": 1, "kv_cache_bytes": 1 << 20, "kv_cache_memory_fraction": 0.25,
    "num_kv_blocks": 64, "swap_space_bytes": 1 << 20, "runner": "torch", "cuda_graphs": False,
    "quantized_matmul": "int8", "kv_cache_dtype": "fp16",
    "trace_steps": "/tmp/kvflow-options-test-steps.json",
    "trace_max_steps": 50,
    "speculative": "draft", "num_speculative_tokens": 3, "speculative_draft_length": "fixed",
    "draft_engine": "/tmp/kvflow-options-test-draft",
    "debug_checks": True,
    "kv_offload_bytes": 1 << 20, "kv_disk_dir": "/tmp/kvflow-options-test-tiers",
    "kv_disk_bytes": 1 << 22,
}


def serve_parser() -> argparse.ArgumentParser:
    from kvflow.cli import make_parser

    return make_parser()


def test_every_option_has_help_and_a_test_value():
    assert set(NON_DEFAULT) == set(EngineOptions.names())
    for f in option_fields():
        assert f.metadata["help"], f"{f.name} has no help text"
        assert NON_DEFAULT[f.name] != getattr(EngineOptions(), f.name), f.name


def test_the_cli_flags_are_generated_and_round_trip_every_option():
    from kvflow.orchestrator.options import engine_overrides

    argv = ["serve"]
    for name, value in NON_DEFAULT.items():
        if value is True:
            argv.append("--" + name.replace("_", "-"))
        elif value is False and name == "cuda_graphs":
            argv.append("--enforce-eager")
        elif value is False:
            argv.append("--no-" + name.removeprefix("enable_").replace("_", "-"))
        else:
            argv += ["--" + name.replace("_", "-"), format_option(value)]
    args = serve_parser().parse_args(argv)
    assert engine_overrides(args) == NON_DEFAULT
    # Flags not given stay out: the engine folder's own limits then apply.
    assert engine_overrides(serve_parser().parse_args(["serve"])) == {}


def test_cli_choices_come_from_the_registries(capsys):
    from kvflow.runtime import RUNNERS

    help_text = serve_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "{" + ",".join(SCHEDULERS) + "}" in help_text
    assert "{" + ",".join(RUNNERS) + "}" in help_text
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["serve", "--policy", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["serve", "--max-num-seqs", "ten"])
    assert "max_num_seqs must be int, got 'ten'" in capsys.readouterr().err


def test_triton_parameters_round_trip_every_option():
    params = options_to_parameters(NON_DEFAULT)
    assert all(isinstance(v, str) for v in params.values())
    reserved = ("engine_dir", "python_paths")
    back = options_from_parameters({**params, "engine_dir": "/x", "python_paths": "[]"},
                                   reserved=reserved)
    assert back == NON_DEFAULT
    assert parse_option("static_batch_size", "none") is None


def test_unknown_or_mistyped_options_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['max_num_seq'\]; "
                                         r"known: \[.*'max_num_seqs'"):
        EngineOptions().with_overrides(max_num_seq=4)
    with pytest.raises(ValueError, match="unknown engine option 'maxseqs'"):
        options_from_parameters({"maxseqs": "4"})
    with pytest.raises(ValueError, match="max_num_seqs must be int, got '4'"):
        EngineOptions().with_overrides(max_num_seqs="4")
    with pytest.raises(ValueError, match="enable_prefix_caching must be bool, got 'maybe'"):
        parse_option("enable_prefix_caching", "maybe")
    with pytest.raises(ValueError, match="policy must be one of"):
        EngineOptions(policy="sjf-ish")


def test_llm_overrides_are_validated_by_the_same_dataclass(tiny_engines):
    from kvflow.orchestrator.llm import plan_engine

    engine = tiny_engines["llama-gqa4", "torch"]
    plan = plan_engine(engine, **NON_DEFAULT)
    for name, value in NON_DEFAULT.items():
        assert getattr(plan.scheduler, name) == value
    assert plan.num_blocks == 64 and plan.runner == "torch" and plan.cuda_graphs is False
    with pytest.raises(ValueError, match="known:"):
        plan_engine(engine, max_tokens=3)
    with pytest.raises(ValueError, match="max_num_seqs=17 exceeds the engine's build limit of 16"):
        plan_engine(engine, max_num_seqs=17)


def test_kvflow_serve_writes_one_triton_parameter_per_option(tiny_engines, tmp_path):
    from kvflow.triton_backend.launcher import ServeError, ServerConfig, prepare_workspace

    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    cfg = ServerConfig(engine, engine_args={"max_num_seqs": 4, "enable_prefix_caching": False})
    prepare_workspace(cfg, tmp_path)
    text = (tmp_path / "models" / "kvflow" / "config.pbtxt").read_text()
    pairs = dict(re.findall(r'parameters \{ key: "(\w+)", value: \{ string_value: "([^"]*)" \} \}',
                            text))
    from kvflow.triton_backend.model import BACKEND_PARAMETERS

    assert options_from_parameters(pairs, reserved=BACKEND_PARAMETERS) == {
        "max_num_seqs": 4, "enable_prefix_caching": False}
    # The name the OpenAI frontend serves: the checkpoint's, never a path.
    assert pairs["served_model_name"] == "llama-gqa4"
    # The paths go beside the config, not into it (clients can read the config).
    assert "engine_dir" not in pairs and "python_paths" not in pairs
    serve = json.loads((tmp_path / "models" / "kvflow" / "serve.json").read_text())
    assert serve["engine_dir"] == str(engine.resolve()) and serve["python_paths"]
    with pytest.raises(ServeError, match="unknown engine option"):
        ServerConfig(engine, engine_args={"max_num_seq": 4})


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_max_step_ms_out_of_range_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="max_step_ms must be finite, >= 0"):
        EngineOptions(max_step_ms=bad)


def test_max_step_ms_needs_chunked_prefill():
    with pytest.raises(ValueError, match="max_step_ms=150 needs enable_chunked_prefill"):
        EngineOptions(max_step_ms=150, enable_chunked_prefill=False)
    assert EngineOptions(max_step_ms=0.0, enable_chunked_prefill=False).max_step_ms == 0.0


def test_max_step_ms_defaults_by_runner_and_reaches_the_scheduler(tiny_engines):
    """Unset, the target step time is the runner's default: 200 ms on a CPU runner; 0 turns
    the time bound off (the token budget is max_num_batched_tokens), as does chunked prefill
    off; a value given is the scheduler's target. The flag and the Triton parameter come from
    the field (the round-trip tests above)."""
    from kvflow import LLM

    engine = tiny_engines["llama-gqa4", "torch"]
    cases = (({}, 200.0), ({"max_step_ms": 0.0}, 0.0), ({"max_step_ms": 50.0}, 50.0),
             ({"enable_chunked_prefill": False}, 0.0))
    for overrides, want in cases:
        with LLM(engine, max_num_batched_tokens=64, **overrides) as llm:
            assert llm.engine.options.max_step_ms == want, overrides
            budget = llm.engine.scheduler.step_budget
            assert (budget is None) == (want == 0.0), overrides
            if budget is not None:
                assert budget.target_s == want / 1000 and budget.max_tokens == 64
            else:
                assert llm.engine.scheduler.token_budget == 64


def test_options_dataclass_is_frozen():
    assert all(f.name for f in fields(EngineOptions))
    with pytest.raises(AttributeError):
        EngineOptions().max_num_seqs = 3  # type: ignore[misc]


# --- debug mode: invariants checked after every step --------------------------------------------

def test_debug_checks_catch_a_corrupted_pool_on_the_next_step(tiny_engines):
    from kvflow import LLM, SamplingParams

    engine = tiny_engines["llama-gqa4", "torch"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for checks in (False, True):
        with LLM(engine, debug_checks=checks) as llm:
            llm.engine.add_request([5, 6, 7, 8, 9], params)
            llm.engine.step()  # the prefill: the request now holds a block
            request = llm.engine.scheduler.running[0]
            block = llm.engine.kv.block_tables[request.request_id][0]
            llm.engine.kv.pool.ref_counts[block] += 1  # a leak: a reference no table holds
            if checks:
                with pytest.raises(AssertionError, match="reference counts"):
                    llm.engine.step()
            else:
                llm.engine.step()  # unnoticed without the checks


def test_debug_checks_default_comes_from_one_environment_variable(monkeypatch):
    monkeypatch.setenv("KVFLOW_DEBUG_CHECKS", "1")
    assert EngineOptions().debug_checks is True
    monkeypatch.setenv("KVFLOW_DEBUG_CHECKS", "0")
    assert EngineOptions().debug_checks is False
    monkeypatch.delenv("KVFLOW_DEBUG_CHECKS")
    assert EngineOptions().debug_checks is False


@pytest.mark.parametrize("bad, field", [
    ({"kv_offload_bytes": -1}, "kv_offload_bytes"),
    ({"kv_disk_bytes": -5, "kv_disk_dir": "/tmp/x"}, "kv_disk_bytes"),
    ({"kv_disk_dir": "/tmp/x"}, "kv_disk_bytes"),
    ({"kv_disk_bytes": 1 << 20}, "kv_disk_dir"),
])
def test_kv_tier_options_are_checked_by_name(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineOptions(**bad)
    assert EngineOptions().kv_offload_bytes == 0 and EngineOptions().kv_disk_dir is None
