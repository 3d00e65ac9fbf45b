"""One script for one NVIDIA GPU: kernels, bandwidth, the CUDA runner, TensorRT.

    python benchmarks/gpu_check.py --out reports/gpu_check.json   # ~5 minutes on an H100

1. **Kernels**: the Triton paged-attention kernel against the PyTorch reference on fresh
   random steps of varied lengths (prefill chunks and decodes mixed), fp16 and bf16. The output
   buffer starts as NaN, so an element the kernel never writes fails the check.
2. **Bandwidth**: decode attention at batch 64, context 2,048 (Llama-3-8B's 8 KV heads of 128,
   32 query heads, bf16): bytes of K/V read per second, against the device's measured
   device-to-device copy bandwidth. Target: at least 60%. Then batch 1 and 4 at context
   32,768, with split KV (the default split count) and without.
3. **CUDA runner**: the Triton runner end to end, with random weights, on the default model's
   shape (SmolLM2-135M) and on a 1B-parameter Llama: decode step times at batch 1-64 and 512
   tokens of context, replayed from CUDA graphs and launched eagerly (and the two steps'
   logits compared), and decode throughput at batch 64 next to HF transformers' ``generate``
   on the same GPU when transformers is installed. Target: at least 5x for the 1B model.
4. **TensorRT** (``--parts tensorrt``, which benchmarks/gpu_session.sh runs first): when
   TensorRT is importable, a float16 engine of the default model's shape (random weights) is
   built with Polygraphy; ``kvflow check-engine`` compares it with ONNX Runtime on its
   recorded steps (plots beside ``--out``); the cuda-python runner's prefill and decode steps
   are timed, and its logits compared with the Triton runner's; otherwise it says why not.

It writes every figure to ``--out`` (JSON) and prints a table last. ``--dry-run`` runs every
part at toy sizes on the CPU (kernels in Triton's interpreter, wall-clock timing) to check the
script itself where there is no GPU; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS: dict[str, Any] = {}
DEVICE = "cuda"
DRY = False  # --dry-run: toy sizes on the CPU
CONTEXT = 512  # tokens of context of every sequence in the timed decode steps


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def cuda_time_ms(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` on the GPU, timed with CUDA events."""
    if DRY:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def random_step(seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int,
                block_size: int, dtype: torch.dtype, gen: torch.Generator) -> dict[str, Any]:
    """A packed step on the device under check (see ``paged_attention_ref.random_step``)."""
    from kvflow.plugins.paged_attention_ref import random_step as make

    return make(seqs, heads, kv_heads, head_dim, block_size, dtype, gen, DEVICE)


def check_kernels(trials: int) -> None:
    from kvflow.plugins.paged_attention_ref import paged_attention_ref
    from kvflow.plugins.paged_attention_triton import paged_attention_triton

    gen = torch.Generator().manual_seed(0)
    worst: dict[str, float] = {}
    # NOTE: Triton's interpreter mishandles bfloat16 (a plain load/store changes the values),
    # so a dry run checks fp16 only; on a GPU bf16 is compiled like any other type.
    for dtype in (torch.float16,) if DRY else (torch.float16, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        worst[name] = 0.0
        for trial in range(trials):
            n = int(torch.randint(1, 4 if DRY else 24, (1,), generator=gen))
            seqs = [(int(torch.randint(0, 60 if DRY else 1500, (1,), generator=gen)),
                     1 if torch.rand(1, generator=gen) < 0.7
                     else int(torch.randint(2, 20 if DRY else 300, (1,), generator=gen)))
                    for _ in range(n)]
            heads, kv_heads = [(32, 8), (9, 3), (16, 16)][trial % 3]
            step = random_step(seqs, heads, kv_heads, 128 if trial % 2 else 64, 16, dtype, gen)
            ref_in = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in step.items()}
            ref = paged_attention_ref(**{k: (v.cpu() if torch.is_tensor(v) else v)
                                         for k, v in ref_in.items()})
            out = torch.full_like(step["q"], float("nan"))
            # Every fourth trial splits the keys (flash decoding), prefill tiles included.
            paged_attention_triton(**step, out=out, num_splits=4 if trial % 4 == 3 else None)
            sync()
            out = out.cpu().float()
            if torch.isnan(out).any():
                raise AssertionError(f"{name} trial {trial}: output elements left unwritten")
            err = ((out - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))
            worst[name] = max(worst[name], float(err))
        bound = 2 ** -7 if dtype is torch.bfloat16 else 2 ** -10
        RESULTS[f"kernel {name} max rel error"] = worst[name]
        RESULTS[f"kernel {name} bound"] = 4 * bound
        if worst[name] > 4 * bound:
            raise AssertionError(f"{name}: max relative error {worst[name]:.2e} > {4 * bound:.2e}")


def copy_bandwidth_gbs() -> float:
    a = torch.empty(1 << (20 if DRY else 30), dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    ms = cuda_time_ms(lambda: b.copy_(a), repeats=10)
    return 2 * a.numel() / (ms / 1e3) / 1e9  # read + write


def check_bandwidth() -> None:
    from kvflow.plugins.paged_attention_triton import paged_attention_triton

    gen = torch.Generator().manual_seed(1)
    batch, context, heads, kv_heads, head_dim = (2, 64, 4, 2, 32) if DRY else (64, 2048, 32, 8,
                                                                                128)
    step = random_step([(context - 1, 1)] * batch, heads, kv_heads, head_dim, 16,
                       torch.bfloat16, gen)
    best = math.inf
    for block_n, warps in ((64, 4),) if DRY else ((32, 4), (64, 4), (128, 4), (64, 8),
                                                   (128, 8)):
        key = f"decode attention ms (block_n={block_n}, num_warps={warps})"
        try:  # a setting may not fit the GPU's shared memory: note it, try the next
            ms = cuda_time_ms(lambda bn=block_n, w=warps: paged_attention_triton(
                **step, max_query_len=1, block_n=bn, num_warps=w))
        except Exception as e:  # noqa: BLE001
            RESULTS[key] = f"FAILED: {str(e)[:200]}"
            continue
        RESULTS[key] = ms
        best = min(best, ms)
    if best == math.inf:
        raise RuntimeError("no block_n/num_warps setting ran")
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2  # K and V, 2 bytes each
    achieved = kv_bytes / (best / 1e3) / 1e9
    copy = copy_bandwidth_gbs()
    RESULTS.update({"decode attention GB/s": achieved, "copy GB/s": copy,
                    "decode attention / copy bandwidth": achieved / copy})
    # Few long sequences: too few (sequence, KV head) programs for the GPU unless the keys
    # are split (flash decoding). The default split count against none.
    from kvflow.plugins.paged_attention_triton import decode_splits

    long_context = 256 if DRY else 32768
    for batch in (1, 4):
        long = random_step([(long_context - 1, 1)] * batch, heads, kv_heads, head_dim, 16,
                           torch.bfloat16, gen)
        auto = 4 if DRY else decode_splits(batch * kv_heads, torch.device(DEVICE))
        for splits in sorted({1, auto}):
            ms = cuda_time_ms(lambda sp=splits, st=long: paged_attention_triton(
                **st, max_query_len=1, num_splits=sp))
            gbs = 2 * batch * long_context * kv_heads * head_dim * 2 / (ms / 1e3) / 1e9
            RESULTS[f"decode b={batch} ctx={long_context} GB/s (splits={splits})"] = gbs
        del long


def pool_blocks() -> int:
    """KV blocks for 64 sequences of ``CONTEXT`` tokens (and room to grow), plus the null
    block: the pool of the runner timings."""
    return 64 * (-(-(CONTEXT + 130) // 16)) + 2


def model_configs() -> dict[str, Any]:
    """The models the runner is timed on: the default model's shape and a 1B Llama, both with
    random weights (timing depends on the shape only; the default model's 98 MB GGUF cannot
    be carried to the device, and its numerics are checked against HF on the CPU in CI)."""
    from kvflow.model.config import ModelConfig

    if DRY:
        tiny = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64,
                           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, eos_token_ids=(2,))
        return {"1B": tiny}
    smollm2 = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576,
                          intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                          tie_word_embeddings=True, eos_token_ids=(2,),
                          max_position_embeddings=8192)
    llama_1b = ModelConfig(architecture="llama", vocab_size=32000, hidden_size=2048,
                           intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, head_dim=64, eos_token_ids=(2,),
                           max_position_embeddings=4096)
    return {"SmolLM2-135M": smollm2, "1B": llama_1b}


def check_runner() -> None:
    failed = []
    for label, cfg in model_configs().items():
        for part, fn in (("runner", time_runner), ("HF baseline", hf_baseline)):
            try:  # a failure is recorded and the other parts still run
                fn(label, cfg)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                RESULTS[f"{label} {part}"] = f"FAILED: {e}"
                failed.append(f"{label} {part}")
    if failed:
        raise RuntimeError(f"failed: {', '.join(failed)}")


def time_runner(label: str, cfg: Any) -> None:
    """Decode step times of the Triton runner, from CUDA graphs and launched eagerly."""
    import numpy as np

    from kvflow.build.engine_config import BuildLimits, EngineConfig
    from kvflow.kv_manager import KVCacheManager
    from kvflow.model.llama import LlamaForCausalLM
    from kvflow.runtime.step_builder import SeqChunk, build_step
    from kvflow.runtime.triton_runner import TritonRunner

    limits = BuildLimits(2048, 4096, 64, 16)
    engine = EngineConfig(cfg, "torch", "bfloat16", limits, {"name": "random weights"}, {})
    model = LlamaForCausalLM(cfg, 16, 2048)
    # A dry run (the OpenAI Triton interpreter on the CPU) only checks that every path runs.
    batches = (1, 8) if DRY else (1, 8, 32, 64)
    num_blocks = pool_blocks()
    RESULTS[f"{label} params (M)"] = cfg.num_parameters / 1e6
    t0 = time.perf_counter()
    try:
        runner = TritonRunner.from_model(engine, model, num_blocks, device=DEVICE,
                                         cuda_graphs=True)
        RESULTS[f"{label} runner setup s (incl. graph capture)"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001  still time the eager runner
        traceback.print_exc()
        RESULTS[f"{label} decode graphs"] = f"capture FAILED: {e}"
        runner = TritonRunner.from_model(engine, model, num_blocks, device=DEVICE,
                                         cuda_graphs=False)
    modes = [("eager", runner.execute_eager)]
    if runner.graphs is not None:
        modes.insert(0, ("graphs", runner.execute))
    try:
        for b in batches:
            kv = KVCacheManager(num_blocks, 16)
            chunks = []
            for i in range(b):
                kv.allocate_slots(i, CONTEXT)
                chunks.append(SeqChunk(i, [5] * CONTEXT, CONTEXT - 1, 1, True))
            step = build_step(kv, chunks)
            for mode, fn in modes:
                RESULTS[f"{label} decode step ms b={b} ({mode})"] = cuda_time_ms(
                    lambda s=step, f=fn: f(s), repeats=10)
            if b == batches[-1] and runner.graphs is not None:
                # What the logits' trip to the host costs: the graph alone, logits left on
                # the device (sampling on the GPU would save the difference).
                graphs, bucket = runner.graphs, runner.graphs.bucket(step)
                assert graphs is not None and bucket is not None
                RESULTS[f"{label} decode step ms b={b} (graphs, logits on device)"] = (
                    cuda_time_ms(lambda s=step, g=graphs, k=bucket: g.run(s, k), repeats=10))
                # Same step, same KV writes: the captured graphs must give the eager logits.
                graphed, eager = runner.execute(step), runner.execute_eager(step)
                diff = float(np.abs(graphed - eager).max() / np.abs(eager).max())
                RESULTS[f"{label} graphs vs eager max rel logit diff"] = diff
                if diff > 1e-2:
                    raise AssertionError(f"{label}: decode graphs differ from eager by {diff}")
        ms = RESULTS[f"{label} decode step ms b={batches[-1]} ({modes[0][0]})"]
        RESULTS[f"{label} decode tok/s b={batches[-1]}"] = batches[-1] / (ms / 1e3)
    finally:
        runner.close()
        del runner, model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def hf_baseline(label: str, cfg: Any) -> None:
    """HF transformers ``generate`` decode throughput at the same batch and context."""
    try:
        from transformers import LlamaConfig
        from transformers import LlamaForCausalLM as HFLlama
    except ImportError:
        RESULTS[f"{label} HF generate"] = "transformers not installed: no baseline"
        return
    batch = 64
    hf = HFLlama(LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                             intermediate_size=cfg.intermediate_size,
                             num_hidden_layers=cfg.num_hidden_layers,
                             num_attention_heads=cfg.num_attention_heads,
                             num_key_value_heads=cfg.num_key_value_heads,
                             head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                             tie_word_embeddings=cfg.tie_word_embeddings)).to(DEVICE,
                                                                              torch.bfloat16)
    ids = torch.randint(3, cfg.vocab_size, (batch, CONTEXT), device=DEVICE)
    mask = torch.ones_like(ids)
    new = 4 if DRY else 64

    def generate_s(tokens: int) -> float:
        sync()
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                    do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - t0

    with torch.inference_mode():
        hf.generate(ids[:, :16], attention_mask=mask[:, :16], max_new_tokens=2,
                    min_new_tokens=2, do_sample=False, pad_token_id=0)
        # Decode alone: generating 1 + new tokens minus generating 1 (the prefill).
        decode_s = generate_s(1 + new) - generate_s(1)
    hf_tps = batch * new / decode_s
    RESULTS[f"{label} HF generate decode tok/s b={batch}"] = hf_tps
    ours = RESULTS.get(f"{label} decode tok/s b={batch}")
    if isinstance(ours, float):
        RESULTS[f"{label} CUDA runner / HF decode throughput"] = ours / hf_tps


def check_tensorrt() -> None:
    """TensorRT through the toolchain the design card names: a float16 engine of the default
    model's shape (random weights) built with Polygraphy, ``kvflow check-engine`` against ONNX
    Runtime on its recorded steps, then the cuda-python runner's step times, and its logits
    against the Triton runner's on the same steps."""
    from kvflow.build.builder import tensorrt_available

    reason = tensorrt_available()
    if reason:
        RESULTS["TensorRT"] = f"not run: {reason}"
        return
    import tempfile

    import numpy as np

    from kvflow.build.builder import write_graph_artifacts
    from kvflow.build.check_engine import check_engine
    from kvflow.build.engine_config import BuildLimits, EngineConfig
    from kvflow.kv_manager import KVCacheManager
    from kvflow.model.llama import LlamaForCausalLM
    from kvflow.runtime.step_builder import SeqChunk, build_step
    from kvflow.runtime.tensorrt_runner import TensorRTRunner
    from kvflow.runtime.triton_runner import TritonRunner

    cfg = model_configs()["SmolLM2-135M"]
    limits = BuildLimits(2048, 4096, 64, 16)
    net = LlamaForCausalLM(cfg, 16, 2048)
    num_blocks = pool_blocks()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        engine = EngineConfig(cfg, "tensorrt", "float16", limits, {"name": "random weights"}, {})
        t0 = time.perf_counter()
        engine.files.update(write_graph_artifacts(net, engine, folder))
        engine.save(folder)
        RESULTS["TensorRT export + Polygraphy build s"] = time.perf_counter() - t0
        report = json.loads((folder / "build_report.json").read_text())["tensorrt"]
        RESULTS["TensorRT network layers"] = report["num_layers"]
        RESULTS["TensorRT plugin layers"] = report["num_plugins"]
        # 1. What a user runs first when an engine looks wrong.
        checked = check_engine(folder, reference="onnxruntime",
                               plot_dir=OUT_DIR / "check_engine" if OUT_DIR else None)
        for r in checked.results:
            RESULTS[f"check-engine {r.step} max abs / mean abs"] = (
                f"{r.max_abs:.4g} / {r.mean_abs:.4g} (top-1 {r.top1_agree}/{r.rows}, "
                f"{'ok' if r.passed else 'DIFFERS'} at atol {checked.tolerance.atol:g}, "
                f"rtol {checked.tolerance.rtol:g})")
        # 2. The cuda-python runner's step times, and its logits against the Triton runner's.
        trt_runner = TensorRTRunner(folder, engine, num_blocks)
        ref = TritonRunner.from_model(engine, net, num_blocks, device=DEVICE,
                                      cuda_graphs=False)
        try:
            kv = KVCacheManager(num_blocks, 16)
            prompt = [int(t) for t in torch.randint(3, cfg.vocab_size, (CONTEXT,))]
            batch = 64
            for i in range(batch):
                kv.allocate_slots(i, CONTEXT)
            worst = 0.0
            prefills = [build_step(kv, [SeqChunk(i, prompt, 0, CONTEXT - 1, True)
                                        for i in range(first, first + 4)])
                        for first in range(0, batch, 4)]
            for step in prefills:
                a, b = trt_runner.execute(step), ref.execute(step)
                worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
            RESULTS[f"TensorRT prefill step ms (4 x {CONTEXT - 1} tokens)"] = cuda_time_ms(
                lambda: trt_runner.execute(prefills[0]), repeats=10)
            for b_size in (1, 16, 64):
                decode = build_step(kv, [SeqChunk(i, prompt, CONTEXT - 1, 1, True)
                                         for i in range(b_size)])
                if b_size == batch:
                    a, b = trt_runner.execute(decode), ref.execute(decode)
                    worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
                RESULTS[f"TensorRT decode step ms b={b_size}"] = cuda_time_ms(
                    lambda decode=decode: trt_runner.execute(decode), repeats=10)
            RESULTS["TensorRT vs Triton runner max rel logit diff"] = worst
            if worst > 5e-2:
                raise AssertionError(f"TensorRT logits differ from the Triton runner's by {worst}")
            if not checked.passed:
                raise AssertionError(f"check-engine: {checked.first_failure()}")
        finally:
            trt_runner.close()
            ref.close()


PARTS = ("tensorrt", "kernels", "bandwidth", "runner")
OUT_DIR: Path | None = None  # where check-engine's plots go (beside --out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="reports/gpu_check.json")
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--dry-run", action="store_true",
                   help="toy sizes on the CPU, kernels in Triton's interpreter")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated parts to run, of {','.join(PARTS)}")
    args = p.parse_args()
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not parts or any(x not in PARTS for x in parts):
        p.error(f"--parts must name some of {','.join(PARTS)}, got {args.parts!r}")
    global DEVICE, DRY, CONTEXT, OUT_DIR
    OUT_DIR = Path(args.out).parent
    if args.dry_run:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        DEVICE, DRY, CONTEXT = "cpu", True, 32
        RESULTS["device"] = "cpu (dry run: the figures mean nothing)"
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check here (--dry-run checks the script)")
        return 2
    else:
        RESULTS["device"] = torch.cuda.get_device_name()
    status = 0
    checks = {"tensorrt": check_tensorrt,
              "kernels": lambda: check_kernels(4 if DRY else args.trials),
              "bandwidth": check_bandwidth, "runner": check_runner}
    for name in parts:
        fn = checks[name]
        t0 = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            fn()
            RESULTS[f"{name} check"] = f"ok ({time.perf_counter() - t0:.0f} s)"
        except Exception as e:  # noqa: BLE001  report every part, then fail
            traceback.print_exc()
            RESULTS[f"{name} check"] = f"FAILED: {e}"
            status = 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(RESULTS, indent=1, default=str))
    width = max(len(k) for k in RESULTS)
    print("\n".join(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}"
                    for k, v in RESULTS.items()))
    return status


if __name__ == "__main__":
    sys.exit(main())
