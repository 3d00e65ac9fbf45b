"""Scheduler and bookkeeping overhead per step, with a runner that returns instantly.

256 running requests decoding (after their prefills), measured over many steps: the time of
everything but the model (schedule + step inputs, sampling, append + detokenize + outputs),
broken down, plus a cProfile of what remains. Writes a markdown report.

    python benchmarks/scheduler_overhead.py --engine engines/bench/onnxruntime
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np

from kvflow.build.engine_config import EngineConfig
from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.reports.writers import write_report
from kvflow.runtime.base import ModelRunner, StepInput
from kvflow.text.tokenizer import EngineTokenizer


class InstantRunner(ModelRunner):
    """Returns fixed logits at once: the model costs nothing."""

    name = "instant"

    def __init__(self, engine: EngineConfig, num_blocks: int, vocab: int) -> None:
        super().__init__(engine, num_blocks)
        rng = np.random.default_rng(0)
        self._logits = rng.standard_normal((512, vocab)).astype(np.float32)
        self._argmax = np.argmax(self._logits, axis=1)

    def execute(self, step: StepInput) -> np.ndarray:
        return self._logits[: len(step.logits_indices)]

    def execute_argmax(self, step: StepInput) -> np.ndarray:
        # As the ONNX Runtime runner does, inside the model: its cost is the model's.
        return self._argmax[: len(step.logits_indices)]


def decoding_engine(engine_dir: str, num_requests: int, steps: int, vocab: int | None,
                    detokenize: bool, **options: object) -> LLMEngine:
    """An engine over an :class:`InstantRunner` with ``num_requests`` requests past their
    prefills, each with room for ``steps`` more decode steps; ``options``: more
    :class:`EngineOptions` fields."""
    engine_cfg = EngineConfig.load(engine_dir)
    vocab = vocab or engine_cfg.model.vocab_size
    sched = EngineOptions(max_num_seqs=num_requests, max_num_batched_tokens=8192,
                          max_model_len=2048, **options)  # type: ignore[arg-type]
    blocks = num_requests * (2048 // engine_cfg.limits.block_size) + 1
    runner = InstantRunner(engine_cfg, blocks, vocab)
    tokenizer = EngineTokenizer(engine_dir) if detokenize else None
    engine = LLMEngine(runner, tokenizer, sched, engine_cfg.model.eos_token_ids)
    engine.sampler.vocab_size = min(engine.sampler.vocab_size, vocab)
    params = SamplingParams(max_tokens=steps + 30, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(list(range(100, 132)), params, request_id=f"r{i}")
    while engine.scheduler.num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    return engine


def run(engine_dir: str, num_requests: int, steps: int, vocab: int | None,
        detokenize: bool) -> dict:
    engine = decoding_engine(engine_dir, num_requests, steps, vocab, detokenize)
    vocab = engine.sampler.vocab_size
    engine.step_stats.clear()
    wall = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        wall.append(time.perf_counter() - t0)
    stats = list(engine.step_stats)
    # The profile comes from further steps, so that its own cost stays out of the timings.
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(min(steps, 20)):
        engine.step()
    profiler.disable()
    assert all(s.num_scheduled_seqs == num_requests for s in stats)
    buf = io.StringIO()
    pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(18)
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {
        "vocab": vocab, "detokenize": detokenize,
        "step_ms": ms(wall),
        "schedule_ms": ms([s.schedule_time_s for s in stats]),
        "sample_ms": ms([s.sample_time_s for s in stats]),
        "postprocess_ms": ms([s.postprocess_time_s for s in stats]),
        "model_ms": ms([s.model_time_s for s in stats]),
        "profile": buf.getvalue(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/bench/onnxruntime",
                   help="engine folder (only its config and tokenizer are read)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", default="reports/scheduler_overhead.md")
    args = p.parse_args()
    cases = [(32, False), (32, True), (None, True)]
    results = [run(args.engine, args.requests, args.steps, v, d) for v, d in cases]
    lines = [f"# Per-step overhead, {args.requests} running requests (median of {args.steps} "
             "steps, instant runner)", "",
             "| vocab | detokenize | step total ms | schedule + inputs | sample | "
             "append + detok + outputs |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['vocab']} | {r['detokenize']} | {r['step_ms']:.2f} | "
                     f"{r['schedule_ms']:.2f} | {r['sample_ms']:.2f} | "
                     f"{r['postprocess_ms']:.2f} |")
    lines += ["", "Profile of the last case (cumulative):", "", "```", results[-1]["profile"],
              "```"]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
