"""``kv_cache_dtype``: an fp16 KV cache. One option (flag, LLM argument, Triton parameter), pools
and byte counts that follow it, swaps and block copies that move its bits unchanged, host kernels
that read it exactly, the simulator's KV bytes, and fp16 KV numerics against fp32 KV."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest

from kvflow.cli import make_parser
from kvflow.orchestrator.options import (
    EngineOptions,
    engine_overrides,
    options_from_parameters,
    options_to_parameters,
)
from kvflow.runtime.base import (
    HOST_AUTO_KV_CACHE_DTYPES,
    KV_CACHE_DTYPES,
    KV_CACHE_NUMPY_DTYPES,
    kv_bytes_per_block,
    resolve_kv_cache_dtype,
)
from kvflow.runtime.kv_cache import HostKVPool
from kvflow.sim.cost_model import HARDWARE, RooflineCostModel, StepShape, model_spec
from tests.helpers import run_host_attention

# fp16 KV against fp32 KV on the tiny engines (random weights, |logits| up to about 3), over
# prompts in two chunks and 8 decode steps each. Measured on every tiny model, both CPU runners:
# max |delta logit| 5.1e-4 to 1.1e-3 (K/V rounded to 11 significant bits), no greedy token
# changed in 24 steps per model. The bound leaves about 5x of headroom.
FP16_LOGIT_ATOL = 5e-3


def help_of(command: str) -> str:
    return make_parser()._subparsers._group_actions[0].choices[command].format_help()


# --- the option -------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["serve", "dynamo-worker"])
def test_every_command_that_takes_engine_options_has_the_flag(command):
    text = re.sub(r"\s+", " ", help_of(command))
    assert "--kv-cache-dtype {" + ",".join(KV_CACHE_DTYPES) + "}" in text
    assert "int8 is not built yet" in text
    argv = [command, "--kv-cache-dtype", "fp16"]
    if command == "dynamo-worker":
        argv += ["--engine", "/x"]
    assert engine_overrides(make_parser().parse_args(argv)) == {"kv_cache_dtype": "fp16"}


def test_int8_and_unknown_values_are_refused_naming_the_field(capsys, tiny_engines):
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'int8' is not built yet .*choose one "
                                         r"of \('auto', 'fp32', 'fp16'\)"):
        EngineOptions(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp32', "
                                         r"'fp16'\), got 'bf16'"):
        EngineOptions().with_overrides(kv_cache_dtype="bf16")
    from kvflow import LLM

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(tiny_engines["llama-gqa4", "torch"], kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not built yet"):
        options_to_parameters({"kv_cache_dtype": "int8"})  # kvflow serve, before a server starts
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_the_triton_parameter_reaches_the_engine_plan(tiny_engines, tmp_path):
    from kvflow.orchestrator.llm import plan_engine
    from kvflow.triton_backend.launcher import ServerConfig, prepare_workspace
    from kvflow.triton_backend.model import BACKEND_PARAMETERS

    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    prepare_workspace(ServerConfig(engine, engine_args={"kv_cache_dtype": "fp16"}), tmp_path)
    text = (tmp_path / "models" / "kvflow" / "config.pbtxt").read_text()
    pairs = dict(re.findall(r'parameters \{ key: "(\w+)", value: \{ string_value: "([^"]*)" \} \}',
                            text))
    overrides = options_from_parameters(pairs, reserved=BACKEND_PARAMETERS)
    assert overrides == {"kv_cache_dtype": "fp16"}
    assert plan_engine(engine, **overrides).kv_cache_dtype == "fp16"


def test_auto_is_the_host_default_on_cpu_runners_and_the_engine_dtype_on_gpu_ones(tiny_engines):
    from kvflow.build.engine_config import EngineConfig

    ort = EngineConfig.load(tiny_engines["llama-gqa4", "onnxruntime"])
    torch_engine = EngineConfig.load(tiny_engines["llama-gqa4", "torch"])
    assert resolve_kv_cache_dtype("auto", ort, None) == "fp16"
    assert resolve_kv_cache_dtype("auto", torch_engine, "torch") == "fp32"
    assert resolve_kv_cache_dtype("auto", torch_engine, "triton") == "fp32"
    assert resolve_kv_cache_dtype("auto", replace(torch_engine, dtype="float16"),
                                  "triton") == "fp16"
    assert resolve_kv_cache_dtype("auto", replace(torch_engine, dtype="bfloat16"),
                                  "triton") == "bf16"
    assert resolve_kv_cache_dtype("auto", replace(torch_engine, backend="tensorrt",
                                                  dtype="float16"), None) == "fp16"
    for runner in ("onnxruntime", "torch", "triton", None):
        assert resolve_kv_cache_dtype("fp16", torch_engine, runner) == "fp16"
    assert EngineOptions().kv_cache_dtype == "auto"


def test_host_pools_refuse_other_types_naming_what_they_hold(tiny_engines):
    from kvflow.build.engine_config import EngineConfig
    from kvflow.runtime.torch_runner import TorchRunner

    engine = tiny_engines["llama-gqa4", "torch"]
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'bf16' cannot be a host KV pool's "
                                         r"type; a host pool holds one of \('fp32', 'fp16'\)"):
        TorchRunner(engine, EngineConfig.load(engine), 8, kv_cache_dtype="bf16")
    with pytest.raises(ValueError, match="a host KV pool holds one of"):
        HostKVPool(1, 4, 4, 1, 8, np.float64)


# --- the pool and its bytes -------------------------------------------------------------------
@pytest.mark.parametrize("runner", ["torch", "onnxruntime"])
def test_fp16_halves_block_bytes_and_doubles_the_blocks_of_the_same_budget(tiny_engines,
                                                                           runner):
    from kvflow.build.engine_config import EngineConfig
    from kvflow.orchestrator.llm import create_engine, plan_engine

    engine_dir = tiny_engines["llama-gqa4", runner]
    config = EngineConfig.load(engine_dir)
    fp32_block = kv_bytes_per_block(config, "fp32")
    budget = {"kv_cache_bytes": 40 * fp32_block, "swap_space_bytes": 8 * fp32_block}
    p32 = plan_engine(engine_dir, kv_cache_dtype="fp32", **budget)
    p16 = plan_engine(engine_dir, kv_cache_dtype="fp16", **budget)
    assert (p32.num_blocks, p32.num_host_blocks) == (40, 8)
    assert (p16.num_blocks, p16.num_host_blocks) == (80, 16)
    engine = create_engine(engine_dir, kv_cache_dtype="fp16", **budget)
    try:
        r = engine.runner
        assert r.kv_cache_dtype == "fp16" and r.num_blocks == 80
        assert r.kv_bytes_per_block == fp32_block // 2 == engine.kv.bytes_per_block
        pool = r.pool  # type: ignore[attr-defined]
        assert all(a.dtype == np.float16 for a in (*pool.k, *pool.v, *pool.host_k))
        assert pool.nbytes == 80 * r.kv_bytes_per_block
    finally:
        engine.close()


def test_the_default_pool_is_the_host_default(tiny_engines):
    from kvflow.orchestrator.llm import create_engine

    engine = create_engine(tiny_engines["llama-gqa4", "torch"], num_kv_blocks=8)
    try:
        assert engine.runner.kv_cache_dtype == HOST_AUTO_KV_CACHE_DTYPES["torch"]
        pool = engine.runner.pool  # type: ignore[attr-defined]
        assert pool.k[0].dtype == KV_CACHE_NUMPY_DTYPES[HOST_AUTO_KV_CACHE_DTYPES["torch"]]
    finally:
        engine.close()


def test_swap_and_copy_on_write_move_fp16_blocks_bit_for_bit():
    pool = HostKVPool(2, 8, 4, 2, 8, np.float16, num_host_blocks=4)
    assert pool.nbytes == HostKVPool(2, 8, 4, 2, 8, np.float32).nbytes // 2
    rng = np.random.default_rng(0)
    for a in (*pool.k, *pool.v):  # every bit pattern: subnormals, -0, inf, NaNs
        a.view(np.uint16)[...] = rng.integers(0, 1 << 16, a.shape, dtype=np.uint16)
    before = [a.view(np.uint16).copy() for a in (*pool.k, *pool.v)]
    pool.swap_out([(1, 1), (3, 2)])
    for a in (*pool.k, *pool.v):
        a[[1, 3]] = 0
    pool.swap_in([(1, 5), (2, 6)])
    pool.copy_blocks([(5, 7)])
    for a, b in zip((*pool.k, *pool.v), before, strict=True):
        bits = a.view(np.uint16)
        np.testing.assert_array_equal(bits[5], b[1])
        np.testing.assert_array_equal(bits[6], b[3])
        np.testing.assert_array_equal(bits[7], b[1])
    pool.close()


GREEDY_ARGS = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def test_prefix_caching_with_fp16_gives_the_outputs_of_fp16_without_it(tiny_engines):
    from kvflow import LLM, SamplingParams

    rng = np.random.default_rng(7)
    base = rng.integers(3, 300, size=30).tolist()
    others = [base[:16] + [5, 6, 7], base[:18] + [8, 9], list(base), base + [11, 12]]
    params = SamplingParams(**GREEDY_ARGS)
    results = {}
    for caching in (True, False):
        with LLM(tiny_engines["llama-gqa4", "torch"], kv_cache_dtype="fp16",
                 enable_prefix_caching=caching) as llm:
            outs = llm.generate([base], params) + llm.generate(others, params)
        results[caching] = outs
    assert [o.outputs[0].token_ids for o in results[True]] == \
        [o.outputs[0].token_ids for o in results[False]]
    assert all(o.cached_tokens > 0 for o in results[True][1:])


def test_swap_preemption_with_fp16_keeps_the_outputs(tiny_engines, tmp_path):
    from kvflow import LLM, SamplingParams

    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 300, size=20).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    trace = tmp_path / "steps.json"
    # 4 requests of up to 44 tokens need 44 blocks of 4 tokens; 24 force preemptions.
    with LLM(engine, kv_cache_dtype="fp16", num_kv_blocks=24, preemption_mode="swap",
             enable_prefix_caching=False, trace_steps=str(trace)) as llm:
        tight = llm.generate(prompts, params)
        preemptions = llm.engine.counters.preemptions
    with LLM(engine, kv_cache_dtype="fp16", enable_prefix_caching=False) as llm:
        roomy = llm.generate(prompts, params)
    steps = [e["args"] for e in json.loads(trace.read_text())["traceEvents"]
             if e.get("cat") == "step"]
    assert preemptions > 0
    assert sum(s.get("swap_out_blocks", 0) for s in steps) > 0
    assert sum(s.get("swap_in_blocks", 0) for s in steps) > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]


# --- the host kernels -------------------------------------------------------------------------
def test_the_half_to_float_conversions_are_exact_on_all_65536_halves():
    import numba

    from kvflow.plugins.paged_attention_native import half_to_float, half_to_float_software

    @numba.njit
    def widen(h, out):  # type: ignore[no-untyped-def]
        for i in range(h.shape[0]):
            out[i] = half_to_float(h[i])  # the kernel's: F16C here, if the CPU has it

    @numba.njit
    def widen_software(h, out):  # type: ignore[no-untyped-def]
        for i in range(h.shape[0]):
            out[i] = half_to_float_software(h[i])

    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = halves.view(np.float16).astype(np.float32)
    got, got_software = np.empty_like(want), np.empty_like(want)
    widen(halves, got)
    widen_software(halves, got_software)
    # Bit for bit, subnormals, -0 and infinities included; NaNs stay NaN (the hardware quiets a
    # signalling one, as NumPy does not), and the software conversion keeps even their bits.
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    np.testing.assert_array_equal(got_software.view(np.uint32), want.view(np.uint32))


MIXED = [(0, 37), (5, 1), (100, 1), (64, 20), (0, 1), (31, 33), (16, 1)]


@pytest.mark.parametrize("kernel", ["native", "host"])
def test_host_kernels_on_an_fp16_pool_match_the_reference_on_the_same_pool(kernel):
    torch = pytest.importorskip("torch")
    from kvflow.plugins.paged_attention_host import paged_attention_host
    from kvflow.plugins.paged_attention_native import paged_attention_native
    from kvflow.plugins.paged_attention_ref import paged_attention_ref, random_step

    fn = paged_attention_native if kernel == "native" else paged_attention_host
    heads, kv_heads, head_dim = 9, 3, 64
    step = random_step(MIXED, heads, kv_heads, head_dim, 16, torch.float32,
                       torch.Generator().manual_seed(0))
    step["slot_mapping"][3] = -1  # a padding slot: written by neither
    step["k_cache"], step["v_cache"] = step["k_cache"].half(), step["v_cache"].half()
    out, k_cache, v_cache = run_host_attention(fn, step, heads, kv_heads, head_dim)
    t = step["q"].shape[0]
    ref = paged_attention_ref(**step).reshape(t, -1).numpy()  # reads the fp16 pool as fp32
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    # Writes round to nearest even, as NumPy's and torch's casts do: the same bits.
    np.testing.assert_array_equal(k_cache.view(np.uint16), step["k_cache"].numpy().view(np.uint16))
    np.testing.assert_array_equal(v_cache.view(np.uint16), step["v_cache"].numpy().view(np.uint16))


# --- numerics: fp16 KV against fp32 KV --------------------------------------------------------
def make_runner(runner_name: str, engine_dir, kv_cache_dtype: str):  # type: ignore[no-untyped-def]
    """``onnxruntime-segmented``: the ORT runner's fallback (its graph cut at the attention
    nodes, the numba kernel between), whether or not the native op loads here."""
    from kvflow.runtime import create_runner

    if runner_name != "onnxruntime-segmented":
        return create_runner(runner_name, engine_dir, 64, kv_cache_dtype=kv_cache_dtype)
    from kvflow.build.engine_config import EngineConfig
    from kvflow.runtime.ort_runner import OnnxRuntimeRunner

    return OnnxRuntimeRunner(engine_dir, EngineConfig.load(engine_dir), 64,
                             kv_cache_dtype=kv_cache_dtype, attention="segmented")


@pytest.mark.parametrize("runner_name", ["onnxruntime", "onnxruntime-segmented", "torch"])
@pytest.mark.parametrize("model_name", ["llama-gqa4", "qwen2-bias"])
def test_fp16_kv_logits_stay_close_to_fp32_kv_and_greedy_tokens_agree(tiny_engines, model_name,
                                                                      runner_name):
    from kvflow.kv_manager import KVCacheManager
    from kvflow.runtime.step_builder import SeqChunk, build_step

    engine = tiny_engines[model_name, runner_name.removesuffix("-segmented")]
    runners = {dt: make_runner(runner_name, engine, dt) for dt in ("fp32", "fp16")}
    if runner_name == "onnxruntime-segmented":
        assert all(r.attention == "segmented" for r in runners.values())  # type: ignore[attr-defined]
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 320, size=n).tolist() for n in (23, 9, 40)]
    worst = 0.0
    try:
        for prompt in prompts:
            seq = list(prompt)
            kv = KVCacheManager(64, 4)
            kv.allocate_slots("s", len(seq))
            half = len(seq) // 2  # two chunks: the second attends to stored (rounded) K/V
            chunks = [SeqChunk("s", seq, 0, half, False),
                      SeqChunk("s", seq, half, len(seq) - half, True)]
            logits = {}
            for chunk in chunks:
                step = build_step(kv, [chunk])
                logits = {dt: r.execute(step) for dt, r in runners.items()}
            for _ in range(8):
                worst = max(worst, float(np.abs(logits["fp16"] - logits["fp32"]).max()))
                assert np.argmax(logits["fp16"][0]) == np.argmax(logits["fp32"][0])
                seq.append(int(np.argmax(logits["fp32"][0])))
                kv.allocate_slots("s", len(seq))
                step = build_step(kv, [SeqChunk("s", seq, len(seq) - 1, 1, True)])
                logits = {dt: r.execute(step) for dt, r in runners.items()}
            kv.free("s")
    finally:
        for r in runners.values():
            r.close()
    print(f"{model_name} {runner_name}: max |delta logit| fp16 vs fp32 KV {worst:.2e}")
    assert 0 < worst < FP16_LOGIT_ATOL, worst  # rounded, so not equal; close


# --- the simulator --------------------------------------------------------------------------
def test_the_simulators_kv_bytes_and_blocks_follow_the_dtype():
    auto, fp16 = model_spec("smollm2-135m"), model_spec("smollm2-135m", kv_cache_dtype="fp16")
    assert fp16.kv_bytes_per_token * 2 == auto.kv_bytes_per_token  # an fp32 model
    llama32 = model_spec("llama-3-8b", tp=2, kv_cache_dtype="fp32")
    assert llama32.kv_bytes_per_token == 2 * model_spec("llama-3-8b").kv_bytes_per_token
    hw = HARDWARE["CPU"]
    assert fp16.kv_blocks_for(hw, 16) >= 2 * auto.kv_blocks_for(hw, 16)
    # A decode step of 32 sequences of 768 tokens: the KV bytes it reads and writes halve.
    from kvflow.runtime.base import StepInput

    n = 32
    step = StepInput(np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64),
                     np.zeros((n, 0), np.int32), np.full(n, 768, np.int32),
                     np.arange(n + 1, dtype=np.int32), np.arange(n, dtype=np.int64))
    shape = StepShape.of(step)
    weights = auto.num_params * auto.dtype_bytes
    kv32 = RooflineCostModel(hw, auto).memory_bytes(shape) - weights
    kv16 = RooflineCostModel(hw, fp16).memory_bytes(shape) - weights
    assert kv16 * 2 == pytest.approx(kv32)
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not built yet"):
        model_spec("smollm2-135m", kv_cache_dtype="int8")


def test_kvflow_simulate_takes_the_dtype(tmp_path):
    def run(*extra: str) -> dict:
        out = tmp_path / "-".join(extra or ("auto",))
        args = make_parser().parse_args([
            "simulate", "--hardware", "CPU", "--model", "smollm2-135m", "--workload", "random",
            "--num-prompts", "8", "--input-len", "64", "--output-len", "8",
            "--request-rate", "inf", "--max-model-len", "512", "--out", str(out),
            "--no-progress", *extra])
        assert args.func(args) == 0
        return json.loads((out / "report.json").read_text())["config"]

    auto, fp16 = run(), run("--kv-cache-dtype", "fp16")
    assert fp16["kv_cache_dtype"] == "fp16"
    assert fp16["kv_bytes_per_token"] * 2 == auto["kv_bytes_per_token"]
    assert fp16["simulation"]["num_kv_blocks"] >= 2 * auto["simulation"]["num_kv_blocks"]
    with pytest.raises(ValueError, match="--kv-cache-dtype sets the roofline"):
        args = make_parser().parse_args(["simulate", "--cost", str(tmp_path / "c.json"),
                                         "--kv-cache-dtype", "fp16", "--num-kv-blocks", "9"])
        args.func(args)


def test_a_dynamo_worker_advertises_the_blocks_of_its_dtype(tiny_engines):
    """The KV router sizes each worker by the blocks it registers: fp16 registers twice the
    blocks for the same --kv-cache-bytes (the KV events carry block hashes, never bytes)."""
    import asyncio

    pytest.importorskip("dynamo.common.backend")
    from kvflow.build.engine_config import EngineConfig
    from kvflow.dynamo.worker import KvflowDynamoEngine

    engine_dir = tiny_engines["llama-gqa4", "torch"]
    budget = str(40 * kv_bytes_per_block(EngineConfig.load(engine_dir), "fp32"))

    async def registered(dtype: str) -> int:
        worker, _ = KvflowDynamoEngine.from_parsed(make_parser().parse_args([
            "dynamo-worker", "--engine", str(engine_dir), "--kv-cache-dtype", dtype,
            "--kv-cache-bytes", budget, "--no-kv-events"]))
        try:
            config = await worker.start(0)
        finally:
            await worker.cleanup()
        return config.llm.total_kv_blocks

    # 40 and 80 blocks, less the null block
    assert (asyncio.run(registered("fp32")), asyncio.run(registered("fp16"))) == (39, 79)


@pytest.mark.slow  # the default model
def test_default_model_greedy_text_with_fp16_kv_equals_fp32_kv(default_engines):
    """SmolLM2-135M (Q4_1, fp32 matmuls), the held-in prompts of test_default_model, 32 greedy
    tokens each: the same text. Measured teacher-forced over those prompts and the chat one
    (160 steps): max |delta logit| 1.9e-2 (native attention op), 2.5e-2 (segmented), no argmax
    changed."""
    from kvflow import LLM, SamplingParams
    from tests.test_default_model import PROMPTS

    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    tokens = {}
    for dtype in ("fp32", "fp16"):
        with LLM(default_engines["onnxruntime"], kv_cache_dtype=dtype, quantized_matmul="fp32",
                 num_kv_blocks=64) as llm:
            tokens[dtype] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert tokens["fp16"] == tokens["fp32"]
