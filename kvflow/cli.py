"""The ``kvflow`` command line: one subcommand per job.

    kvflow build-engine --model default --output engines/smollm2-135m
    kvflow check-engine engines/smollm2-135m
    kvflow serve --engine engines/smollm2-135m
    kvflow openai --triton-url 127.0.0.1:8001
    kvflow generate --prompt "Hello" --chat
    kvflow bench step
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from kvflow import client
from kvflow.bench import compare, quality, quality_lora, step
from kvflow.bench import serve as bench_serve
from kvflow.build import check_engine
from kvflow.build import command as build_command
from kvflow.dynamo import launcher as dynamo_launcher
from kvflow.dynamo.worker_args import add_worker_args
from kvflow.observability import trace_summary
from kvflow.openai_api import app as openai_app
from kvflow.orchestrator.options import add_engine_option_args
from kvflow.sim import calibrate, run, validate
from kvflow.triton_backend import serve

# NOTE: the dispatcher only names the commands. Each command's flags and entry point live
# with the command (``add_args`` and ``main``, or as named below).


def _command(sub: argparse._SubParsersAction, name: str, help: str,  # noqa: A002
             add_args: Callable[[argparse.ArgumentParser], None],
             main: Callable[[argparse.Namespace], int], description: str | None = None
             ) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=description)
    add_args(p)
    p.set_defaults(func=main)
    return p


def _module(sub: argparse._SubParsersAction, name: str, help: str,  # noqa: A002
            module: ModuleType) -> argparse.ArgumentParser:
    return _command(sub, name, help, module.add_args, module.main)


def _quality_main(args: argparse.Namespace) -> int:
    """``kvflow bench quality``: an adapter's run with ``--lora``, else the engines'."""
    return quality_lora.main(args) if args.lora else quality.main(args)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _module(sub, "build-engine", "build an engine folder from a checkpoint", build_command)
    _module(sub, "check-engine", "compare an engine's outputs with a reference (torch or "
                                 "onnxruntime) on the same steps, with Polygraphy",
            check_engine)
    _module(sub, "serve", "serve an engine with a real tritonserver", serve)
    _module(sub, "openai", "the OpenAI-compatible API in front of running tritonservers "
                           "(kvflow serve starts one itself)", openai_app)
    _module(sub, "generate", "stream a completion from a running server (gRPC)", client)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    _module(bench_sub, "step", "median step time of each runner and of HF transformers", step)
    _module(bench_sub, "serve", "drive a running server with a workload; report latency, "
                                "throughput and goodput with plots", bench_serve)
    _module(bench_sub, "compare", "serve one engine with static batching, continuous batching "
                                  "and chunked prefill; sweep request rates against each; HF "
                                  "generate as the baseline", compare)
    _command(bench_sub, "quality", "sliding-window perplexity, KL divergence and top-1 "
                                   "agreement per engine and quantized_matmul mode, beside HF "
                                   "transformers and llama.cpp (--lora: an adapter's, beside "
                                   "HF + PEFT)", quality.add_args, _quality_main)

    p = _command(sub, "dynamo-worker", "run an engine as an NVIDIA Dynamo worker (behind "
                                       "python -m dynamo.frontend)",
                 add_worker_args, run_dynamo_worker)
    add_engine_option_args(p)  # the same engine options as kvflow serve
    cluster = sub.add_parser("cluster", help="a local Dynamo cluster of kvflow workers")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    _command(cluster_sub, "up", "start etcd, NATS, N kvflow workers and Dynamo's frontend with "
                                "the KV router, on loopback; Ctrl-C stops them all",
             dynamo_launcher.add_cluster_args, dynamo_launcher.cluster_up)

    p = _command(sub, "simulate", "the real scheduler and KV manager in simulated time with a "
                                  "cost model; calibrate and validate the model",
                 run.add_args, run.simulate_main,
                 description="kvflow simulate [options]  |  kvflow simulate calibrate "
                             "--engine DIR  |  kvflow simulate validate --engine DIR")
    modes = p.add_subparsers(dest="simulate_command")
    _command(modes, "calibrate", "time a real engine over a grid of step shapes and fit the "
                                 "simulator's cost model",
             calibrate.add_args, calibrate.calibrate_main)
    _command(modes, "validate", "the real server and the calibrated simulator on the same "
                                "workload: relative errors",
             validate.add_args, validate.validate_main)

    trace = sub.add_parser("trace", help="read a step timeline (--trace-steps)")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    _module(trace_sub, "summarize", "per-phase totals and the longest steps of a step timeline "
                                    "file", trace_summary)
    return parser


def run_dynamo_worker(args: argparse.Namespace) -> int:
    # NOTE: imported here: the worker needs Dynamo's runtime, which `kvflow --help` does not.
    from kvflow.dynamo.worker import serve as serve_worker

    return serve_worker(args)


def _run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        # Bad input: one clear line naming the argument, no traceback.
        parser.exit(2, f"{parser.prog} {getattr(args, 'command', '')}: error: {e}\n")
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    return _run(make_parser(), argv)


def build_engine_main(argv: Sequence[str] | None = None) -> int:
    """``build-engine``: the same as ``kvflow build-engine``."""
    parser = argparse.ArgumentParser(prog="build-engine", description="Build an engine folder.")
    build_command.add_args(parser)
    parser.set_defaults(func=build_command.main, command="")
    return _run(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
