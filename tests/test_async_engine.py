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
            stream = engine.add_request("c", "a long one", long)
            got = 0
            async for _ in stream:
                got += 1
                if got == 3:
                    break
            # Leaving the iterator closes it (CPython does so once it is released; here at
            # once, so that the abort is queued before the read below, on the same inbox).
            await stream.aclose()
            return a, b, await asyncio.to_thread(engine.loop.call, lambda e: (
                e.kv.pool.num_used_blocks, e.scheduler.num_running, e.counters.finished,
                e.counters.generation_tokens))
        finally:
            engine.shutdown()

    a, b, (used_blocks, running, finished, generated) = asyncio.run(run())
    assert "".join(o.delta_text for o in a) == offline[0].text
    assert a[-1].finished and a[-1].token_ids == offline[0].token_ids
    assert b[-1].text == offline[1].text
    # "c" ended by the abort, its 200 tokens far from done, and holds no KV.
    assert (used_blocks, running, finished) == (0, 0, 3)
    assert generated < 12 + 12 + 200


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
