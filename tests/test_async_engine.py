"""The asyncio API and the background engine loop, on a tiny engine."""

from __future__ import annotations

import asyncio

import pytest

from kvflow import LLM, SamplingParams
from kvflow.orchestrator.async_engine import AsyncLLMEngine


@pytest.fixture()
def engine_dir(tiny_engines):
    return tiny_engines["llama-gqa4", "torch"]


def test_async_streams_equal_offline_and_abort_frees_blocks(engine_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(engine_dir) as llm:
        offline = llm.generate(["hello world", "abc"], params)

    async def run():
        engine = AsyncLLMEngine.from_engine_dir(str(engine_dir))
        try:
            async def collect(rid, prompt):
                deltas = [o async for o in engine.add_request(rid, prompt, params)]
                return deltas

            a, b = await asyncio.gather(collect("a", "hello world"), collect("b", "abc"))

            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            got = 0
            async for _ in engine.add_request("c", "a long one", long):
                got += 1
                if got == 3:
                    break  # leaving the iterator aborts the request
            used = await asyncio.to_thread(
                engine.loop.call, lambda e: (e.kv.pool.num_used_blocks, e.scheduler.num_running))
            for _ in range(50):
                if used == (0, 0):
                    break
                await asyncio.sleep(0.05)
                used = await asyncio.to_thread(
                    engine.loop.call,
                    lambda e: (e.kv.pool.num_used_blocks, e.scheduler.num_running))
            return a, b, used
        finally:
            engine.shutdown()

    a, b, used = asyncio.run(run())
    assert "".join(o.delta_text for o in a) == offline[0].text
    assert a[-1].finished and a[-1].token_ids == offline[0].token_ids
    assert b[-1].text == offline[1].text
    assert used == (0, 0)


def test_rejected_request_ends_the_stream_with_a_reason(engine_dir):
    async def run():
        engine = AsyncLLMEngine.from_engine_dir(str(engine_dir))
        try:
            return [o async for o in engine.add_request("x", [5] * 600, SamplingParams())]
        finally:
            engine.shutdown()

    outs = asyncio.run(run())
    assert len(outs) == 1 and outs[0].finish_reason == "rejected"
    assert "max_model_len is 256" in outs[0].error
