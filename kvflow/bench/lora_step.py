"""The LoRA cost of one engine step, measured on the runner alone (``benchmarks/lora.py``).

Served figures on a shared machine move with its load by tens of percent; a step timed on the
runner, the cases interleaved repeat by repeat, says what the adapters themselves cost. Cases,
each on a decode step of ``batch`` sequences at ``context`` tokens and on a prefill of
``batch`` prompts of ``prompt`` tokens:

* ``base graph``: the runner made without a LoRA pool (the graph ``kvflow serve`` runs with
  LoRA off);
* ``LoRA graph, base requests``: the runner with a pool of ``len(adapters)`` slots, no token on
  an adapter (``lora_slots`` None);
* ``1 adapter``: every token on slot 0;
* ``N adapters``: the sequences spread over all the slots, round robin.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.runtime.base import ModelRunner, StepInput


def _step(block_size: int, num_blocks: int, vocab: int, batch: int, start: int,
          num_new: int) -> StepInput:
    """``batch`` sequences each computing ``num_new`` tokens (ids below ``vocab``) after
    ``start`` cached ones."""
    from kvflow.kv_manager import KVCacheManager
    from kvflow.runtime.step_builder import SeqChunk, build_step

    kv = KVCacheManager(num_blocks, block_size)
    chunks = []
    for i in range(batch):
        ids = [(7 * i + 13 * p) % (min(vocab, 1000) - 3) + 3 for p in range(start + num_new)]
        assert kv.allocate_slots(i, start + num_new), "the step's KV does not fit"
        chunks.append(SeqChunk(i, ids, start, num_new, True))
    return build_step(kv, chunks)


def _slots(step: StepInput, slot_of_seq: list[int] | None) -> StepInput:
    """``step`` with each sequence's tokens on ``slot_of_seq[i]`` (None: no LoRA)."""
    from dataclasses import replace

    if slot_of_seq is None:
        return replace(step, lora_slots=None)
    counts = np.diff(step.query_start_loc)
    return replace(step, lora_slots=np.repeat(np.asarray(slot_of_seq, np.int32), counts))


def step_costs(engine_dir: str | Path, adapters: Mapping[str, Path], *, max_lora_rank: int,
               batch: int = 8, context: int = 160, prompt: int = 128, repeats: int = 20,
               quantized_matmul: str = "fp32",
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Median (and p10/p90) ms of each case's decode and prefill step; ``repeats`` rounds of
    every case in turn (prefill: a quarter as many), after one warm-up each."""
    from kvflow.build.engine_config import EngineConfig
    from kvflow.lora import load_lora_adapter
    from kvflow.runtime import create_runner

    cfg = EngineConfig.load(engine_dir)
    block = cfg.limits.block_size
    per_seq = -(-(max(context + 1, prompt)) // block)
    num_blocks = batch * per_seq + 1
    n = len(adapters)
    base = create_runner(None, engine_dir, num_blocks, quantized_matmul=quantized_matmul)
    lora = create_runner(None, engine_dir, num_blocks, quantized_matmul=quantized_matmul,
                         max_loras=n, max_lora_rank=max_lora_rank)
    try:
        for slot, (name, path) in enumerate(adapters.items()):
            lora.load_lora(slot, load_lora_adapter(name, path, cfg.model, max_lora_rank))
        cases: list[tuple[str, ModelRunner, list[int] | None]] = [
            ("base graph", base, None), ("LoRA graph, base requests", lora, None),
            ("1 adapter", lora, [0] * batch), (f"{n} adapters", lora, [i % n
                                                                     for i in range(batch)])]
        vocab = cfg.model.vocab_size
        steps = {"decode": _step(block, num_blocks, vocab, batch, context, 1),
                 "prefill": _step(block, num_blocks, vocab, batch, 0, prompt)}
        out: dict[str, Any] = {"batch": batch, "context": context, "prompt": prompt,
                               "repeats": repeats, "adapters": n, "rank": max_lora_rank,
                               "quantized_matmul": quantized_matmul, "cases": {}}
        for kind, step in steps.items():
            reps = repeats if kind == "decode" else max(3, repeats // 4)
            inputs = [(name, runner, _slots(step, slots)) for name, runner, slots in cases]
            times: dict[str, list[float]] = {name: [] for name, _, _ in inputs}
            for _name, runner, s in inputs:
                runner.execute(s)  # warm-up
            for _ in range(reps):
                for name, runner, s in inputs:
                    t0 = time.perf_counter()
                    runner.execute(s)
                    times[name].append((time.perf_counter() - t0) * 1000)
            for name, ms in times.items():
                q = statistics.quantiles(ms, n=10) if len(ms) > 1 else ms * 9
                out["cases"].setdefault(name, {})[kind] = {
                    "p50_ms": statistics.median(ms), "p10_ms": q[0], "p90_ms": q[-1]}
            log(f"[bench lora] step {kind}: " + ", ".join(
                f"{name} {statistics.median(ms):.1f} ms" for name, ms in times.items()))
        return out
    finally:
        base.close()
        lora.close()
