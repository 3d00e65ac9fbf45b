"""``kvflow bench step``: median time of one engine step, kvflow's runners vs HF transformers.

Decode batches of 1, 8, 32 and 64 sequences at a context of 256 tokens, and one 512-token
prefill; for each kvflow runner and for HF transformers' ``forward`` on the same batch (its
DynamicCache holding the same context). Writes a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from kvflow.reports.writers import write_report

DECODE_BATCHES = (1, 8, 32, 64)
CONTEXT = 256
PREFILL = 512


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="checkpoint (default: SmolLM2-135M)")
    p.add_argument("--engine-root", default="engines/bench",
                   help="where the per-backend engines are built (reused when present)")
    p.add_argument("--runners", default="onnxruntime,torch")
    p.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES)))
    p.add_argument("--context", type=int, default=CONTEXT)
    p.add_argument("--prefill", type=int, default=PREFILL)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    p.add_argument("--out", default="reports/step_time.md")


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ensure_engine(model: str, root: Path, backend: str, max_len: int) -> Path:
    from kvflow.build.builder import build_engine
    from kvflow.build.engine_config import ENGINE_CONFIG_FILE

    path = root / backend
    if not (path / ENGINE_CONFIG_FILE).is_file():
        build_engine(model, path, backend=backend, max_model_len=max_len, max_num_tokens=1024,
                     max_batch_size=64, block_size=16)
    return path


def bench_runner(engine: Path, runner_name: str, batches, context: int, prefill: int,
                 repeats: int) -> dict[str, float]:
    from kvflow.kv_manager import KVCacheManager
    from kvflow.runtime import create_runner
    from kvflow.runtime.step_builder import SeqChunk, build_step

    block = 16
    need = max(max(batches) * (-(-(context + 1) // block)), -(-prefill // block)) + 2
    runner = create_runner(runner_name, engine, need)
    rng = np.random.default_rng(0)
    vocab = runner.vocab_size
    out: dict[str, float] = {}
    try:
        for b in batches:
            kv = KVCacheManager(need, block)
            chunks = []
            for i in range(b):
                ids = rng.integers(10, vocab, size=context).tolist()
                kv.allocate_slots(i, context)
                chunks.append(SeqChunk(i, ids, context - 1, 1, True))
            step = build_step(kv, chunks)
            out[f"decode b={b}"] = _median_s(lambda s=step: runner.execute(s), repeats)
        kv = KVCacheManager(need, block)
        ids = rng.integers(10, vocab, size=prefill).tolist()
        kv.allocate_slots("p", prefill)
        step = build_step(kv, [SeqChunk("p", ids, 0, prefill, True)])
        out[f"prefill {prefill}"] = _median_s(lambda: runner.execute(step), max(3, repeats // 3))
    finally:
        runner.close()
    return out


def bench_hf(model: str, batches, context: int, prefill: int, repeats: int) -> dict[str, float]:
    import torch
    from transformers import DynamicCache

    from kvflow.model.hf_reference import load_hf_reference

    hf = load_hf_reference(model)
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    with torch.inference_mode():
        for b in batches:
            ids = torch.randint(10, vocab, (b, context), generator=gen)
            cache = DynamicCache(config=hf.config)
            hf(ids[:, :-1], past_key_values=cache, use_cache=True)

            def step(ids=ids, cache=cache):
                hf(ids[:, -1:], past_key_values=cache, use_cache=True)
                cache.crop(-1)  # drop the token just appended: same context every call

            out[f"decode b={b}"] = _median_s(step, repeats)
        ids = torch.randint(10, vocab, (1, prefill), generator=gen)
        out[f"prefill {prefill}"] = _median_s(lambda: hf(ids, use_cache=False),
                                              max(3, repeats // 3))
    return out


def main(args: argparse.Namespace) -> int:
    batches = [int(x) for x in args.batches.split(",")]
    runners = [r for r in args.runners.split(",") if r]
    root = Path(args.engine_root)
    max_len = max(args.context + 16, args.prefill + 16)
    results: dict[str, dict[str, float]] = {}
    for r in runners:
        engine = _ensure_engine(args.model, root, r, max(max_len, 1024))
        print(f"[bench step] {r} ...", flush=True)
        results[r] = bench_runner(engine, r, batches, args.context, args.prefill, args.repeats)
    if not args.no_hf:
        print("[bench step] HF transformers ...", flush=True)
        results["hf-transformers"] = bench_hf(args.model, batches, args.context, args.prefill,
                                              args.repeats)
    rows = list(next(iter(results.values())))
    lines = [
        f"# Step time (median ms), model `{args.model}`, context {args.context}",
        "",
        "| step | " + " | ".join(results) + " | best kvflow / HF |",
        "|---|" + "---|" * (len(results) + 1),
    ]
    for row in rows:
        cells = [f"{results[r][row] * 1e3:.2f}" for r in results]
        ratio = ""
        if "hf-transformers" in results and runners:
            best = min(results[r][row] for r in runners)
            ratio = f"{best / results['hf-transformers'][row]:.2f}"
        lines.append(f"| {row} | " + " | ".join(cells) + f" | {ratio} |")
    import os
    import platform

    lines += ["", f"Machine: {platform.machine()}, {os.cpu_count()} CPUs. "
              "Reproduce: `kvflow bench step` (or `make bench-step`)."]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    raise SystemExit(main(parser.parse_args()))
