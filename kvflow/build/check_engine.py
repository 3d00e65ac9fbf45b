"""``kvflow check-engine``: an engine's outputs against a reference on the same step inputs,
compared by Polygraphy. What to run when an engine's outputs look wrong::

    kvflow check-engine engines/smollm2-135m                 # CPU: onnxruntime vs torch
    kvflow check-engine engines/llama-trt --reference onnxruntime   # GPU: TensorRT vs ORT

The step inputs are recorded once from the engine's own step builder
(:func:`~kvflow.runtime.step_builder.build_step` over a
:class:`~kvflow.kv_manager.KVCacheManager`): ``prefill``, four sequences' prompts in one step
(lengths across block boundaries), then ``decode``, one token more for each. Each runner is
wrapped as a Polygraphy runner and run through ``Comparator.run`` over the same feeds (every
runner has its own KV pool, filled by the same steps); ``Comparator.compare_accuracy`` then
compares the logits of each step with ``CompareFunc.simple``: an element differs when it
exceeds both ``atol`` and ``rtol * |reference|``. ``--steps decode`` still runs the prefill
(the decode reads its KV) but compares the decode alone.

The engine runs with the engine options it is served with (``--runner``,
``--quantized-matmul``, ``--kv-cache-dtype``); the default tolerances follow from its
arithmetic (:func:`default_tolerance`), and ``--atol``/``--rtol`` override them. Exit status 0:
every compared output is within tolerance; 1: the first output that is not is named.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.build.check_reference import REFERENCES, reference_runner
from kvflow.build.engine_config import EngineConfig
from kvflow.orchestrator.options import EngineOptions, add_engine_option_args, engine_overrides
from kvflow.runtime.base import ModelRunner, StepInput

STEPS = ("prefill", "decode")
_RUNNER_OPTIONS = ("runner", "quantized_matmul", "kv_cache_dtype")


@dataclass(frozen=True)
class Tolerance:
    """Polygraphy's elementwise check: an element differs if it exceeds ``atol`` and
    ``rtol * |reference|``; ``why``: the arithmetic that sets them."""

    atol: float
    rtol: float
    why: str


def default_tolerance(engine: EngineConfig, runner: str, quantized_matmul: str,
                      kv_cache_dtype: str) -> Tolerance:
    """The tolerance the engine's arithmetic earns against an fp32 reference on the same
    weights, about twice to twenty times the largest error measured on SmolLM2-135M's recorded
    steps (docs/benchmarks.md, "check-engine"): fp32 throughout, 6e-5; an fp16 KV cache, 0.014;
    int8 activations (decode steps under ``quantized_matmul`` auto or int8), 0.87, spread over
    every logit. Half-precision engines (TensorRT's, the triton runner's) are not measured yet:
    no GPU has run one."""
    if engine.dtype != "float32":
        return Tolerance(1.0, 0.1, f"{engine.dtype} arithmetic (not measured yet)")
    if engine.quantization and quantized_matmul in ("auto", "int8") and runner == "onnxruntime":
        return Tolerance(2.0, 0.1, f"int8 activations on quantized weights (quantized_matmul "
                                   f"{quantized_matmul})")
    if kv_cache_dtype == "fp16":
        return Tolerance(0.05, 0.01, "fp16 KV cache")
    return Tolerance(1e-3, 1e-3, "fp32 throughout")


@dataclass
class RecordedStep:
    """One recorded engine step: its name and its inputs."""

    name: str
    step: StepInput

    def feed(self) -> OrderedDict[str, np.ndarray]:
        return OrderedDict((f, getattr(self.step, f)) for f in StepInput.__dataclass_fields__)


def record_steps(engine: EngineConfig, seed: int = 0) -> tuple[list[RecordedStep], int]:
    """``prefill`` and ``decode`` for up to four sequences within the engine's limits (see the
    module doc); returns them and the KV blocks they need (the null block included)."""
    from kvflow.kv_manager import KVCacheManager
    from kvflow.runtime.step_builder import SeqChunk, build_step

    limits, vocab = engine.limits, engine.model.vocab_size
    bs = limits.block_size
    lens = [3 * bs + 9, 2 * bs + 1, bs, 5][:limits.max_batch_size]
    lens = [max(1, min(n, limits.max_model_len - 1)) for n in lens]
    while sum(lens) > limits.max_num_tokens:  # shrink the longest until one step holds them
        i = int(np.argmax(lens))
        lens[i] = max(1, lens[i] // 2)
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(3, vocab, size=n + 1).tolist() for n in lens]
    num_blocks = 1 + sum(-(-(n + 1) // bs) for n in lens)
    kv = KVCacheManager(num_blocks, bs)
    for i, n in enumerate(lens):
        kv.allocate_slots(i, n)
    prefill = build_step(kv, [SeqChunk(i, tokens[i], 0, n, True) for i, n in enumerate(lens)])
    for i, n in enumerate(lens):
        kv.allocate_slots(i, n + 1)
    decode = build_step(kv, [SeqChunk(i, tokens[i], n, 1, True) for i, n in enumerate(lens)])
    return [RecordedStep("prefill", prefill), RecordedStep("decode", decode)], num_blocks


def polygraphy_runner(name: str, make: Callable[[], ModelRunner]) -> Any:
    """A kvflow runner as a Polygraphy ``BaseRunner``: made on ``activate``, one feed = one
    step, ``logits`` out, closed on ``deactivate``."""
    from polygraphy.backend.base import BaseRunner
    from polygraphy.common import TensorMetadata

    from kvflow.build.profile import INPUT_DTYPES

    class StepRunner(BaseRunner):
        def __init__(self) -> None:
            super().__init__(name=name)
            self.runner: ModelRunner | None = None

        def activate_impl(self) -> None:
            self.runner = make()

        def get_input_metadata_impl(self) -> TensorMetadata:
            meta = TensorMetadata()
            for f in StepInput.__dataclass_fields__:
                if f not in INPUT_DTYPES:  # lora_slots: optional, no input of the engine graph
                    continue
                meta.add(f, INPUT_DTYPES[f], (-1, -1) if f == "block_tables" else (-1,))
            return meta

        def infer_impl(self, feed_dict: dict[str, np.ndarray]) -> OrderedDict:
            assert self.runner is not None
            t0 = time.perf_counter()
            logits = np.asarray(self.runner.execute(StepInput(**feed_dict)), dtype=np.float32)
            self.inference_time = time.perf_counter() - t0
            return OrderedDict(logits=logits[:, : self.runner.vocab_size])

        def deactivate_impl(self) -> None:
            if self.runner is not None:
                self.runner.close()
            self.runner = None

    return StepRunner()


@dataclass
class CheckResult:
    """One compared output of one step."""

    step: str
    output: str
    shape: list[int]
    passed: bool
    max_abs: float
    max_rel: float
    mean_abs: float
    top1_agree: int
    rows: int


@dataclass
class CheckReport:
    """What ``kvflow check-engine`` found."""

    engine: str
    candidate: str
    reference: str
    tolerance: Tolerance
    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def first_failure(self) -> CheckResult | None:
        return next((r for r in self.results if not r.passed), None)

    def as_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "candidate": self.candidate, "reference": self.reference,
                "tolerance": vars(self.tolerance), "passed": self.passed,
                "results": [vars(r) for r in self.results]}


def check_engine(engine_dir: str | Path, reference: str | None = None,
                 steps: Sequence[str] = STEPS, model: str | None = None,
                 atol: float | None = None, rtol: float | None = None,
                 plot_dir: str | Path | None = None, **options: Any) -> CheckReport:
    """Compare the engine (run with engine ``options``: ``runner``, ``quantized_matmul``,
    ``kv_cache_dtype``) with ``reference`` (default: ``onnxruntime`` for a TensorRT engine,
    else ``torch``) on the recorded steps ``steps``; see the module doc. ``plot_dir``:
    Polygraphy's error plots (PNG), a folder per step."""
    from polygraphy.comparator import Comparator, CompareFunc
    from polygraphy.comparator.struct import RunResults

    from kvflow.build.report import quiet_polygraphy
    from kvflow.runtime import create_runner
    from kvflow.runtime.base import resolve_kv_cache_dtype

    engine_dir = Path(engine_dir)
    engine = EngineConfig.load(engine_dir)
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        raise ValueError(f"--steps must name some of {STEPS}, got {list(steps)}")
    opts = EngineOptions().with_overrides(**options)
    runner_name = opts.runner or engine.backend
    reference = reference or ("onnxruntime" if runner_name == "tensorrt" else "torch")
    if reference not in REFERENCES:
        raise ValueError(f"--reference must be one of {REFERENCES}, got {reference!r}")
    kv_dtype = resolve_kv_cache_dtype(opts.kv_cache_dtype, engine, opts.runner)
    tolerance = default_tolerance(engine, runner_name, opts.quantized_matmul, kv_dtype)
    if atol is not None or rtol is not None:
        tolerance = Tolerance(tolerance.atol if atol is None else atol,
                              tolerance.rtol if rtol is None else rtol, "given")
    recorded, num_blocks = record_steps(engine)
    last = max(STEPS.index(s) for s in steps)
    fed = recorded[: last + 1]
    # Steps before a compared one run uncompared: every runner's KV must hold what they wrote.
    compared = [i for i, r in enumerate(fed) if r.name in steps]
    feeds = [r.feed() for r in fed]
    candidate = f"{runner_name} (quantized_matmul {opts.quantized_matmul}, kv {kv_dtype})"
    quiet_polygraphy()
    with tempfile.TemporaryDirectory(prefix="kvflow-check-") as scratch:
        runners = [
            polygraphy_runner(candidate, lambda: create_runner(
                opts.runner, engine_dir, num_blocks, cuda_graphs=opts.cuda_graphs,
                quantized_matmul=opts.quantized_matmul, kv_cache_dtype=opts.kv_cache_dtype)),
            polygraphy_runner(f"{reference} reference", lambda: reference_runner(
                reference, engine_dir, engine, num_blocks, model, Path(scratch))),
        ]
        results = Comparator.run(runners, data_loader=feeds)
    report = CheckReport(str(engine_dir), candidate, f"{reference} reference", tolerance)
    names = list(results.keys())
    for i in compared:
        # One comparison per step, so that each step's plot has a folder of its own.
        kept = RunResults()
        for name in names:
            kept.add([results[name][i]], runner_name=name)
        plots = str(Path(plot_dir) / fed[i].name) if plot_dir else None
        accuracy = Comparator.compare_accuracy(kept, compare_func=CompareFunc.simple(
            atol=tolerance.atol, rtol=tolerance.rtol, save_error_metrics_plot=plots))
        # Polygraphy >= 0.53 returns a list of AccuracyResult (one per comparison); older ones
        # the AccuracyResult itself: runner pair -> per-iteration {output: result}.
        if not hasattr(accuracy, "items"):
            accuracy = next(iter(accuracy))
        (_, (outputs,)), = accuracy.items()
        for out_name, result in outputs.items():
            a, b = (results[name][i][out_name] for name in names)
            report.results.append(CheckResult(
                fed[i].name, out_name, list(a.shape), bool(result), float(result.max_absdiff),
                float(result.max_reldiff), float(result.mean_absdiff),
                int((a.argmax(-1) == b.argmax(-1)).sum()), int(a.shape[0])))
    return report


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("engine_dir", metavar="ENGINE_DIR", help="the engine folder to check")
    p.add_argument("--reference", choices=REFERENCES, default=None,
                   help="what to compare with: torch (the PyTorch step model in fp32 on the "
                        "checkpoint the engine was built from: checks weights and arithmetic) "
                        "or onnxruntime (the engine's own graph on ONNX Runtime in fp32: checks "
                        "the arithmetic). Default: onnxruntime for a TensorRT engine, else torch")
    p.add_argument("--steps", default=",".join(STEPS),
                   help=f"comma-separated steps to compare, of {','.join(STEPS)} "
                        "(default: both)")
    p.add_argument("--model", default=None,
                   help="the engine's checkpoint, for the torch reference (default: the "
                        "packaged model when the engine was built from it)")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: "
                   "from the engine's arithmetic, printed)")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: "
                   "from the engine's arithmetic, printed)")
    p.add_argument("--report", default=None, help="also write the comparison as JSON here")
    p.add_argument("--plot-dir", default=None, help="also save Polygraphy's plot of each "
                   "step's errors against the reference's values (PNG), a folder per step")
    add_engine_option_args(p, only=_RUNNER_OPTIONS)


def main(args: argparse.Namespace) -> int:
    report = check_engine(args.engine_dir, args.reference,
                          [s.strip() for s in args.steps.split(",") if s.strip()], args.model,
                          args.atol, args.rtol, args.plot_dir, **engine_overrides(args))
    tol = report.tolerance
    print(f"[check-engine] {report.engine}: {report.candidate} vs {report.reference}; "
          f"tolerance atol {tol.atol:g}, rtol {tol.rtol:g} ({tol.why}); an element differs "
          "when it exceeds both")
    print(f"  {'step':8} {'output':8} {'shape':>14} {'max abs':>10} {'max rel':>10} "
          f"{'mean abs':>10} {'top-1':>7}  verdict")
    for r in report.results:
        shape = "x".join(map(str, r.shape))
        print(f"  {r.step:8} {r.output:8} {shape:>14} {r.max_abs:10.3g} {r.max_rel:10.3g} "
              f"{r.mean_abs:10.3g} {r.top1_agree:>3}/{r.rows:<3}  "
              f"{'ok' if r.passed else 'DIFFERS'}")
    if args.report:
        Path(args.report).write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    failure = report.first_failure()
    if failure is not None:
        print(f"[check-engine] FAILED: step {failure.step!r}, output {failure.output!r} differs "
              f"from the reference: max abs error {failure.max_abs:.4g} (atol {tol.atol:g}), "
              f"max rel error {failure.max_rel:.4g} (rtol {tol.rtol:g})")
        return 1
    print(f"[check-engine] passed: {len(report.results)} outputs within tolerance")
    return 0
