"""The ONNX Runtime runner's two ways to run a step: one session with the native PagedAttention
op, and the segmented fallback; both against HF transformers, and its thread policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvflow.build.engine_config import EngineConfig  # noqa: E402
from kvflow.plugins import ort_custom_ops  # noqa: E402
from kvflow.runtime import ort_threads  # noqa: E402
from kvflow.runtime.base import StepInput  # noqa: E402
from kvflow.runtime.ort_runner import OnnxRuntimeRunner  # noqa: E402
from kvflow.runtime.ort_threads import (  # noqa: E402
    ThreadPolicy,
    ThreadSetting,
    choose,
)

TOL = 1e-4
ONE, TWO, TWO_SPIN = ThreadSetting(1, False), ThreadSetting(2, False), ThreadSetting(2, True)

needs_native = pytest.mark.skipif(
    ort_custom_ops.library() is None,
    reason=f"the native op is unavailable: {ort_custom_ops.unavailable_reason()}")


def make_runner(engine_dir, attention: str, num_blocks: int = 64, **kw) -> OnnxRuntimeRunner:
    return OnnxRuntimeRunner(engine_dir, EngineConfig.load(engine_dir), num_blocks,
                             num_host_blocks=16, attention=attention, threads=1, **kw)


def step(seqs: list[tuple[list[int], int, int, list[int]]], block_size: int,
         padding_tokens: int = 0) -> StepInput:
    """``(tokens, start, num_new, blocks)`` per sequence, all sampled; then ``padding_tokens``
    rows that write nothing (slot -1) as a one-token sequence over the null block."""
    ids, pos, slots, qsl, lens, logits = [], [], [], [0], [], []
    width = max(len(b) for *_, b in seqs)
    tables = []
    for tokens, start, n, blocks in seqs:
        for p in range(start, start + n):
            ids.append(tokens[p])
            pos.append(p)
            slots.append(blocks[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + n)
        lens.append(start + n)
        logits.append(qsl[-1] - 1)
        tables.append(blocks + [0] * (width - len(blocks)))
    for _ in range(padding_tokens):
        ids.append(0)
        pos.append(0)
        slots.append(-1)
        qsl.append(qsl[-1] + 1)
        lens.append(1)
        tables.append([0] * width)
    return StepInput(np.array(ids, np.int64), np.array(pos, np.int64), np.array(slots, np.int64),
                     np.array(tables, np.int32), np.array(lens, np.int32),
                     np.array(qsl, np.int32), np.array(logits, np.int64))


def hf_last_logits(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].numpy()


@needs_native
@pytest.mark.parametrize("model_name", ["llama-gqa4", "qwen2-bias"])
def test_one_session_equals_segmented_and_hf(tiny_models, tiny_engines, model_name):
    """Chunked prefill, a mixed step with padding slots, decode steps over blocks in scattered
    order: the native runner's logits equal the segmented runner's and HF's."""
    _, hf = tiny_models[model_name]
    engine = tiny_engines[model_name, "onnxruntime"]
    runners = {a: make_runner(engine, a) for a in ("native", "segmented")}
    assert runners["native"].attention == "native"
    rng = np.random.default_rng(7)
    a = rng.integers(3, 320, size=40).tolist()
    b = rng.integers(3, 320, size=12).tolist()
    # blocks out of order, with holes between them
    blocks_a, blocks_b = [9, 3, 17, 5, 30, 12, 2, 41, 22, 8, 50], [33, 7, 44, 19]
    try:
        steps = [
            ([(a, 0, 13, blocks_a)], 0),                            # first chunk of a
            ([(a, 13, 20, blocks_a), (b, 0, 11, blocks_b)], 2),     # next chunk + a fresh prompt
            ([(b, 11, 1, blocks_b), (a, 33, 7, blocks_a)], 1),      # a decode beside a chunk
        ]
        for seqs, padding in steps:
            want = [hf_last_logits(hf, toks[: start + n]) for toks, start, n, _ in seqs]
            for name, r in runners.items():
                got = r.execute(step(seqs, r.block_size, padding))[: len(seqs)]
                for row, ref in enumerate(want):
                    np.testing.assert_allclose(got[row], ref, atol=TOL, rtol=0,
                                               err_msg=f"{name} runner, sequence {row}")
    finally:
        for r in runners.values():
            r.close()


@needs_native
def test_preemption_by_swap_on_the_native_runner(tiny_models, tiny_engines):
    """A sequence swapped out, its device blocks overwritten, swapped back into other blocks:
    decoding goes on exactly as if it had never left."""
    _, hf = tiny_models["llama-gqa4"]
    r = make_runner(tiny_engines["llama-gqa4", "onnxruntime"], "native")
    seq = list(range(20, 47))
    try:
        first = [4, 5, 6, 7, 8, 9, 10]
        r.execute(step([(seq, 0, 26, first)], r.block_size))
        r.swap_out([(blk, i + 1) for i, blk in enumerate(first)])
        r.execute(step([(list(range(100, 128)), 0, 27, first)], r.block_size))  # reuse them
        moved = [30, 31, 12, 13, 40, 41, 42]
        r.swap_in([(i + 1, blk) for i, blk in enumerate(moved)])
        got = r.execute(step([(seq, 26, 1, moved)], r.block_size))[0]
        np.testing.assert_allclose(got, hf_last_logits(hf, seq), atol=TOL, rtol=0)
    finally:
        r.close()


@needs_native
def test_argmax_rows_and_fp16_kv_on_the_native_runner(tiny_models, tiny_engines):
    _, hf = tiny_models["llama-gqa4"]
    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    seq = list(range(30, 60))
    fp32, fp16 = make_runner(engine, "native"), make_runner(engine, "native",
                                                           kv_cache_dtype="fp16")
    try:
        s = step([(seq, 0, 30, [1, 2, 3, 4, 5, 6, 7, 8])], fp32.block_size)
        assert fp32.execute_argmax(s)[0] == np.argmax(hf_last_logits(hf, seq))
        assert fp16.pool.k[0].dtype == np.float16
        np.testing.assert_allclose(fp16.execute(s)[0], fp32.execute(s)[0], atol=2e-2, rtol=0)
    finally:
        fp32.close()
        fp16.close()


def no_compiler_env(tmp_path) -> dict[str, str]:
    """A machine without a C++ compiler: the library can neither be built nor named."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    return {**os.environ, "PATH": str(tmp_path / "bin"),
            "KVFLOW_CACHE_DIR": str(tmp_path / "cache")}


def test_without_the_library_the_segmented_runner_serves_and_says_why(tiny_engines, tmp_path):
    """In a process where the op cannot be built (no headers), the runner logs the reason once
    and the segmented runner generates the same tokens."""
    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    script = (
        "import logging, json, sys\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from kvflow import LLM, SamplingParams\n"
        f"llm = LLM({str(engine)!r}, num_kv_blocks=64)\n"
        "print(json.dumps([llm.engine.runner.attention, llm.generate([[5, 6, 7, 8]],\n"
        "    SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].outputs[0]"
        ".token_ids]))\n"
        "llm.close()\n")
    out = subprocess.run([sys.executable, "-c", script], env=no_compiler_env(tmp_path),
                         capture_output=True, text=True, timeout=300, check=True)
    attention, tokens = json.loads(out.stdout.strip().splitlines()[-1])
    assert attention == "segmented"
    assert out.stderr.count("PagedAttention op is unavailable") == 1, out.stderr
    with make_runner(engine, "segmented") as r:
        from tests.helpers import greedy_generate

        assert tokens == greedy_generate(r, [5, 6, 7, 8], 6)[0]


def test_native_is_refused_with_the_reason_when_unavailable(tiny_engines, tmp_path):
    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    script = ("from kvflow.build.engine_config import EngineConfig\n"
              "from kvflow.runtime.ort_runner import OnnxRuntimeRunner\n"
              f"OnnxRuntimeRunner({str(engine)!r}, EngineConfig.load({str(engine)!r}), 16,"
              " attention='native')\n")
    out = subprocess.run([sys.executable, "-c", script], env=no_compiler_env(tmp_path),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "attention=native" in out.stderr and "unavailable" in out.stderr


# --- the thread policy ------------------------------------------------------------------------

def test_policy_keeps_one_setting_when_the_other_barely_wins():
    ms = {ONE: {1: 10.0, 8: 20.0, 64: 90.0, 512: 800.0},
          TWO: {1: 13.0, 8: 19.5, 64: 50.0, 512: 420.0},
          TWO_SPIN: {1: 12.0, 8: 19.8, 64: 52.0, 512: 430.0}}
    policy = choose(ms)
    assert policy.setting_for(1) == ONE  # 30% faster: a session of its own
    assert policy.setting_for(8) == TWO  # one thread within 5% of two: two covers it
    assert policy.setting_for(512) == TWO and policy.setting_for(100_000) == TWO
    assert policy.settings == [ONE, TWO]
    assert policy.setting_for(2) == ONE and policy.setting_for(3) == TWO  # boundary sqrt(1*8)
    assert ThreadPolicy.from_json(json.loads(json.dumps(policy.to_json()))) == policy
    assert "1 thread" in policy.describe() and "2 threads" in policy.describe()


def test_a_fixed_thread_count_is_one_session_for_every_size():
    policy = ThreadPolicy.fixed(TWO)
    assert policy.settings == [TWO] and policy.setting_for(1) == policy.setting_for(10**6) == TWO


def test_measured_policy_is_cached_and_reused(tiny_engines, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ort_threads, "machine_is_busy", lambda: False)  # CI's may well be
    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    with OnnxRuntimeRunner(engine, EngineConfig.load(engine), 16) as r:
        first = r._variants[0][1]
    cached = list((tmp_path / "thread_policy").glob("*.json"))
    assert len(cached) == 1
    assert set(first.step_ms) >= {"1 thread"}
    with OnnxRuntimeRunner(engine, EngineConfig.load(engine), 16) as r:
        assert r._variants[0][1] == first
