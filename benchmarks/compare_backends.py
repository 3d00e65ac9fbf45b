"""The same engine steps through every runner available here: do they agree?

    python benchmarks/compare_backends.py --onnx-engine engines/tiny-ort \\
        --torch-engine engines/tiny-torch [--tensorrt-engine engines/tiny-trt]

Runs a prefill step, a mixed step (a prefill chunk with decodes) and a decode batch through
ONNX Runtime (the reference), the PyTorch runner, the Triton runner (the CUDA runner on a GPU,
the Triton interpreter without one) and TensorRT when its engine and TensorRT are present.
Reports the largest logit difference and the top-1 agreement against ONNX Runtime, as a
markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvflow.build.engine_config import EngineConfig  # noqa: E402
from kvflow.kv_manager import KVCacheManager  # noqa: E402
from kvflow.reports.writers import write_report  # noqa: E402
from kvflow.runtime import create_runner  # noqa: E402
from kvflow.runtime.step_builder import SeqChunk, build_step  # noqa: E402


def steps(vocab: int, block_size: int, num_blocks: int):
    """Three steps over one KV manager, as an engine would issue them, in order."""
    rng = np.random.default_rng(0)
    kv = KVCacheManager(num_blocks, block_size)
    prompts = {i: rng.integers(3, vocab, size=n).tolist() for i, n in enumerate((40, 9, 23))}
    for i, ids in prompts.items():
        kv.allocate_slots(i, len(ids) + 2)
    yield "prefill 40 + 9", build_step(kv, [SeqChunk(0, prompts[0], 0, 40, True),
                                            SeqChunk(1, prompts[1], 0, 9, True)])
    yield "chunk 23 + 2 decodes", build_step(kv, [
        SeqChunk(0, prompts[0] + [7], 40, 1, True), SeqChunk(1, prompts[1] + [7], 9, 1, True),
        SeqChunk(2, prompts[2], 0, 23, True)])
    yield "3 decodes", build_step(kv, [SeqChunk(0, prompts[0] + [7, 8], 41, 1, True),
                                       SeqChunk(1, prompts[1] + [7, 8], 10, 1, True),
                                       SeqChunk(2, prompts[2] + [8], 23, 1, True)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--onnx-engine", required=True)
    p.add_argument("--torch-engine", required=True)
    p.add_argument("--tensorrt-engine", default=None)
    p.add_argument("--out", default="reports/compare_backends.md")
    args = p.parse_args()
    if not torch.cuda.is_available():  # the Triton runner's kernels in the interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    engine = EngineConfig.load(args.onnx_engine)
    runs = {"onnxruntime": ("onnxruntime", args.onnx_engine),
            "torch": ("torch", args.torch_engine), "triton": ("triton", args.torch_engine)}
    if args.tensorrt_engine:
        runs["tensorrt"] = ("tensorrt", args.tensorrt_engine)
    num_blocks = 64
    logits: dict[str, dict[str, np.ndarray]] = {}
    notes = []
    for label, (runner_name, folder) in runs.items():
        try:
            runner = create_runner(runner_name, folder, num_blocks)
        except (RuntimeError, FileNotFoundError, ValueError) as e:
            notes.append(f"- {label}: not run ({e})")
            continue
        try:
            logits[label] = {name: runner.execute(step) for name, step in
                             steps(engine.model.vocab_size, engine.limits.block_size,
                                   num_blocks)}
        finally:
            runner.close()
    ref = logits["onnxruntime"]
    lines = ["# Runners on the same steps, against ONNX Runtime", "",
             "| runner | step | max abs logit diff | top-1 agreement |", "|---|---|---|---|"]
    for label, per_step in logits.items():
        if label == "onnxruntime":
            continue
        for name, got in per_step.items():
            diff = float(np.abs(got - ref[name]).max())
            agree = float((got.argmax(-1) == ref[name].argmax(-1)).mean())
            lines.append(f"| {label} | {name} | {diff:.2e} | {agree:.0%} |")
    write_report(args.out, lines + [""] + notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
