"""Multi-LoRA serving (issue 46): what serving adapters costs against the base model alone.

Served, a closed loop of 8 streams over Triton gRPC, on the default engine, each run on a fresh
``kvflow serve``:

1. the base alone (LoRA off);
2. one adapter, every request on it;
3. eight adapters spread over the requests, ``--max-loras 4`` (slots are swapped under load);
4. the same with ``--max-loras 8`` (every adapter resident).

Every run is served ``--rounds`` times (3), the order rotated from round to round, so that a
change in the machine's load (it is often shared) falls on every run alike: figures are medians
over the rounds, ratios to the base the median of each round's ratio. Reported per run: output
throughput, TTFT and TPOT p50/p99, the adapters' swaps and evictions over the load
(``/metrics`` ``kvflow_lora_*``), tritonserver's peak RSS, and the CPU's ISA. Target: eight
mixed adapters keep >= 0.8x the base's throughput and a median TPOT within 1.25x. The adapters
are random nonzero PEFT adapters (rank 16 on all seven projections by default) made with
``kvflow.lora.synthetic.make_peft_adapter`` on the model's HF weights (for the default GGUF,
transformers' own dequantization of it), kept in ``--out``/adapters.

    python benchmarks/lora.py [--engine engines/smollm2-135m] [--out reports/lora]
    python benchmarks/lora.py --smoke   # a few short requests: checks the report is complete

Writes ``report.md``, ``report.json`` and ``lora.png`` into ``--out``; exits 1 when the report
is incomplete (a run that did not start, failed requests, a missing figure).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from kvflow.bench.lora_adapters import adapter_bytes, hf_folder, prepare_adapters
from kvflow.bench.lora_report import combine_rounds, write_lora_report
from kvflow.bench.lora_serve import served_run, standard_runs
from kvflow.bench.machine import cpu_isa
from kvflow.workloads.prompts import make_prompts
from kvflow.workloads.specs import RequestSpec

SMOKE = {"num_prompts": 4, "prompt_tokens": 16, "output_tokens": 4, "adapters": 2,
         "rank": 4, "max_loras": "1,2", "rounds": 2, "step_repeats": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/smollm2-135m", help="engine folder to serve")
    p.add_argument("--model", default=None,
                   help="the engine's checkpoint, for the adapters' HF weights (default: "
                        "'default' when the engine was built from the packaged model)")
    p.add_argument("--out", default="reports/lora")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per run and round")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--adapters", type=int, default=8, help="adapters of the mixed runs")
    p.add_argument("--rank", type=int, default=16, help="rank of every adapter (and the "
                                                        "server's --max-lora-rank)")
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--max-loras", default="4,8",
                   help="the mixed runs' --max-loras values, comma-separated")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="another engine option for every run (JSON value or string)")
    p.add_argument("--rounds", type=int, default=3,
                   help="serve every run this many times, the order rotated each round; "
                        "figures are medians, ratios to the base paired by round (0: only "
                        "the step on the runner alone)")
    p.add_argument("--step-repeats", type=int, default=20,
                   help="time one step on the runner alone, base against adapters, this many "
                        "times per case (kvflow/bench/lora_step.py); 0: skip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--machine-note", default="The machine was shared with other work while "
                                             "this ran: speeds are rough.",
                   help="a sentence on the machine's state, for the report")
    p.add_argument("--smoke", action="store_true",
                   help=f"a short run that checks the report is complete: {SMOKE}")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    for name in ("num_prompts", "prompt_tokens", "output_tokens", "concurrency", "rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.rounds < 0 or (args.rounds == 0 and args.step_repeats < 1):
        p.error(f"--rounds must be >= 1, or 0 with --step-repeats >= 1, got {args.rounds}")
    try:
        args.max_loras_values = [int(v) for v in args.max_loras.split(",") if v]
    except ValueError:
        p.error(f"--max-loras must be comma-separated integers, got {args.max_loras!r}")
    if not args.max_loras_values or min(args.max_loras_values) < 1:
        p.error(f"--max-loras must name values >= 1, got {args.max_loras!r}")
    return args


def engine_args(pairs: list[str]) -> dict[str, Any]:
    """Every run's engine options: prefix caching off (so that the base, whose prompts could
    share blocks the adapters' cannot, is not favoured), then ``--engine-arg`` KEY=VALUE."""
    import json

    out: dict[str, Any] = {"enable_prefix_caching": False}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg must be KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def model_of(engine: str, model: str | None) -> str:
    """``--model``, else ``default`` for an engine built from the packaged model."""
    from kvflow.bench.quality_llamacpp import packaged_model

    if model:
        return model
    if packaged_model(engine):
        return "default"
    raise SystemExit(f"--model: {engine} was not built from the packaged model; name its "
                     "checkpoint")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    hf_dir = hf_folder(model_of(args.engine, args.model), out / "adapters")
    adapters = prepare_adapters(hf_dir, out / "adapters", args.adapters, rank=args.rank,
                                alpha=args.alpha, seed=args.seed)
    names = list(adapters)
    specs = [RequestSpec(0.0, args.prompt_tokens, args.output_tokens)
             for _ in range(args.num_prompts)]
    prompts = make_prompts(specs, args.engine, args.seed)
    common = engine_args(args.engine_arg)
    step = None
    if args.step_repeats > 0:
        from kvflow.bench.lora_step import step_costs

        step = step_costs(args.engine, adapters, max_lora_rank=args.rank,
                          batch=args.concurrency, context=args.prompt_tokens + 32,
                          prompt=args.prompt_tokens, repeats=args.step_repeats)
    plan = standard_runs(names, args.max_loras_values)
    rounds: list[list[dict[str, Any]]] = []
    for i in range(args.rounds):
        results: dict[int, dict[str, Any]] = {}
        # NOTE: rotated, so that no run is always served first (or last) in a round.
        for j in [(i + k) % len(plan) for k in range(len(plan))]:
            run = plan[j]
            print(f"[bench lora] round {i + 1}/{args.rounds}: {run.name} ...", flush=True)
            t0 = time.monotonic()
            results[j] = served_run(args.engine, run, adapters, specs, prompts,
                                    args.concurrency, max_lora_rank=args.rank,
                                    engine_args=common, seed=args.seed + i,
                                    log_path=out / f"server-{i}-{j}.log")
            print(f"[bench lora] round {i + 1}: {run.name}: "
                  f"{results[j].get('error') or 'done'} ({time.monotonic() - t0:.0f} s)",
                  flush=True)
        rounds.append([results[j] for j in range(len(plan))])
    runs = combine_rounds(rounds) if rounds else []
    from kvflow.lora import LORA_MODULES

    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": shlex.join(["python", "benchmarks/lora.py", *(argv or sys.argv[1:])]),
        "config": {"engine": args.engine, "hf_weights": str(hf_dir), "adapters": len(names),
                   "rank": args.rank, "alpha": args.alpha, "targets": list(LORA_MODULES),
                   "adapter_bytes": adapter_bytes(adapters[names[0]]),
                   "num_prompts": args.num_prompts, "prompt_tokens": args.prompt_tokens,
                   "output_tokens": args.output_tokens, "concurrency": args.concurrency,
                   "rounds": args.rounds, "seed": args.seed, "engine_args": common,
                   "smoke": args.smoke},
        "machine": cpu_isa(), "machine_note": args.machine_note, "runs": runs, "step": step}
    report = write_lora_report(out, report)
    return 1 if report["missing"] else 0


if __name__ == "__main__":
    sys.exit(main())
