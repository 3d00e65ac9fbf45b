"""An asyncio API over the engine loop: ``async for out in engine.add_request(...)``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.engine_loop import EngineLoop, StepHook
from kvflow.orchestrator.outputs import RequestOutput
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.text.tokenizer import Prompt


class AsyncLLMEngine:
    """asyncio front end: ``async for out in engine.add_request(...)`` streams deltas."""

    def __init__(self, engine: LLMEngine, step_hook: StepHook | None = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.loop = EngineLoop(engine, step_hook=step_hook, on_failure=on_failure)

    @classmethod
    def from_engine_dir(cls, engine_dir: str, **overrides: Any) -> AsyncLLMEngine:
        from kvflow.orchestrator.llm import create_engine

        return cls(create_engine(engine_dir, **overrides))

    async def add_request(self, request_id: str, prompt: Prompt,
                          params: SamplingParams | None = None,
                          priority: int = 0,
                          is_cancelled: Callable[[], bool] | None = None,
                          tenant: str | None = None,
                          cache_salt: str | None = None,
                          lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; leaving the iterator early aborts the request, and so
        does ``is_cancelled()`` turning true (polled by the loop before every step).
        ``lora_name``: the LoRA adapter it runs under (None: the base model).

        Raises:
            RuntimeError: the engine loop has stopped (it failed, or was shut down): nothing
                would ever answer.
        """
        if not self.loop.is_alive:
            raise RuntimeError(f"the engine loop has stopped: {self.loop.error!r}")
        aio_loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def on_output(out: RequestOutput) -> None:
            aio_loop.call_soon_threadsafe(outputs.put_nowait, out)

        self.loop.submit(request_id, prompt, params or SamplingParams(), on_output, priority,
                         is_cancelled=is_cancelled, tenant=tenant, cache_salt=cache_salt,
                         lora_name=lora_name)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.loop.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def shutdown(self) -> None:
        self.loop.shutdown()
        if not self.loop.is_alive:  # never pull the pool (or the ring) from a running step
            self.loop.engine.close()
