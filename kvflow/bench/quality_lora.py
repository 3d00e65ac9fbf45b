"""``kvflow bench quality --lora NAME=PATH``: what kvflow's arithmetic costs an adapter.

The same sliding windows as the base model's quality run (:mod:`kvflow.bench.quality`), scored
over the full vocabulary by:

* the reference, HF transformers + PEFT in fp32: the engine's checkpoint (for the default GGUF,
  transformers' own dequantization of it) with the adapter applied by ``peft``;
* kvflow's runner with the adapter in LoRA slot 0 (every token of the step on it), per
  ``quantized_matmul`` mode, and its perplexity from prompt logprobs through ``kvflow.LLM``
  (``lora_modules``, ``generate(..., lora=NAME)``): the engine's whole path;
* kvflow's runner without the adapter (fp32): how far the adapter moves the model, the scale
  that the adapter rows' KL is small against.

Writes ``summary.md``, ``report.json`` and ``quality.png`` (the base run's report writer) into
``--out``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.bench import quality as q

LORA_NOTE = (
    "LoRA (`--lora`): adapter `{name}`, rank {rank}, alpha {alpha:g}, on {modules} module kinds. "
    "The reference is HF transformers with the adapter applied by `peft` (fp32); kvflow's "
    "adapter rows run it from LoRA slot 0 of the runner's slot pool (full vocabulary) and "
    "through `kvflow.LLM(lora_modules=...)` with `generate(..., lora=...)` (prompt logprobs). "
    "The `no adapter` row is the base model against the same reference: the adapter's own "
    "effect, against which the adapter rows' KL is to be read. There are no llama.cpp rows.")


def parse_lora(text: str) -> tuple[str, Path]:
    """``--lora NAME=PATH`` -> (name, path); the path must exist."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora must be NAME=PATH, got {text!r}")
    if not Path(path).exists():
        raise FileNotFoundError(f"--lora {name}: {path} does not exist")
    return name, Path(path)


def lora_runner_scorer(engine_dir: str | Path, mode: str, context: int,
                       adapter: Any) -> tuple[q.Scorer, Callable[[], None]]:
    """The engine's runner on ``mode`` with ``adapter`` (a :class:`kvflow.lora.LoraAdapter`) in
    slot 0 and every token on it: ``score(ids, skip)`` as :func:`kvflow.bench.quality.
    runner_scorer`'s; and its ``close``."""
    from kvflow.build.engine_config import EngineConfig
    from kvflow.kv_manager import KVCacheManager
    from kvflow.runtime import create_runner
    from kvflow.runtime.step_builder import SeqChunk, build_step

    block = EngineConfig.load(engine_dir).limits.block_size
    num_blocks = -(-context // block) + 1
    # A pool of one slot, sized with the runner (the ORT graph's LoRA nodes are made with it).
    runner = create_runner(None, engine_dir, num_blocks, quantized_matmul=mode,
                           kv_cache_dtype="fp32", max_loras=1, max_lora_rank=adapter.rank)
    runner.load_lora(0, adapter)

    def score(ids: Sequence[int], skip: int) -> np.ndarray:
        kv = KVCacheManager(num_blocks, block)
        n = len(ids)
        kv.allocate_slots("w", n)
        step = build_step(kv, [SeqChunk("w", list(ids), 0, n, True, range(skip, n - 1))])
        step.lora_slots = np.zeros(step.num_tokens, dtype=np.int32)
        return np.asarray(runner.execute(step))[:-1]  # the sampled (last) row predicts nothing

    return score, runner.close


def peft_scorer(model: str, adapter_path: Path) -> q.Scorer:
    """HF transformers' fp32 model with the adapter applied by ``peft``, on a window."""
    import torch
    from peft import PeftModel

    from kvflow.model.hf_reference import load_hf_reference

    hf = PeftModel.from_pretrained(load_hf_reference(model), str(adapter_path)).eval()

    def score(ids: Sequence[int], skip: int) -> np.ndarray:
        with torch.inference_mode():
            return hf(torch.tensor([list(ids)])).logits[0, skip:-1].float().numpy()

    return score


def llm_lora_pass(engine_dir: str, mode: str, ids: Sequence[int],
                  windows: Sequence[q.Window], name: str, path: Path, max_rank: int,
                  log: Callable[[str], None] = print) -> q.Tally:
    """Perplexity from prompt logprobs through ``kvflow.LLM`` with the adapter loaded
    (``lora_modules``) and every window a request on it (``lora=name``)."""
    import time

    from kvflow import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    tally = q.Tally()
    t0 = time.perf_counter()
    with LLM(engine_dir, quantized_matmul=mode, kv_cache_dtype="fp32",
             enable_prefix_caching=False, lora_modules={name: str(path)},
             max_lora_rank=max_rank) as llm:
        for at in range(0, len(windows), q.LLM_BATCH):
            batch = windows[at:at + q.LLM_BATCH]
            outs = llm.generate([list(ids[w.begin:w.end]) for w in batch], params, lora=name)
            for w, out in zip(batch, outs, strict=True):
                entries = out.prompt_logprobs
                if out.error or entries is None:
                    raise RuntimeError(f"{engine_dir} ({mode}, lora {name}): no prompt "
                                       f"logprobs: {out.error}")
                for p in range(w.first, w.end):
                    entry = entries[p - w.begin]
                    assert entry is not None
                    tally.nll -= entry[ids[p]]
                    tally.tokens += 1
            log(f"[bench quality] lora {name} {mode} prompt logprobs: window "
                f"{at + len(batch)}/{len(windows)}")
    tally.seconds = time.perf_counter() - t0
    return tally


def main(args: argparse.Namespace) -> int:
    """The adapter's quality run (``--lora``): one engine, the modes of ``--modes``."""
    from kvflow.build.engine_config import EngineConfig
    from kvflow.lora import load_lora_adapter
    from kvflow.reports.quality_report import write_quality_report

    if len(args.engine) != 1:
        raise ValueError(f"--lora scores one engine, got {len(args.engine)} --engine")
    if args.kv_cache_dtypes not in ("fp32", ""):
        raise ValueError("--lora runs on the fp32 KV cache only (--kv-cache-dtypes fp32)")
    engine = args.engine[0]
    name, path = parse_lora(args.lora)
    cfg = EngineConfig.load(engine)
    if args.context + 1 > cfg.limits.max_model_len:
        raise ValueError(f"--context {args.context} + 1 generated token exceeds {engine}'s "
                         f"max_model_len of {cfg.limits.max_model_len}")
    hf = q.hf_model_for(engine, args.hf)
    if hf is None:
        raise ValueError("--lora needs the HF reference (HF + PEFT): --hf none is refused")
    adapter = load_lora_adapter(name, path, cfg.model, max_rank=1 << 16)
    quantized = cfg.quantization is not None and cfg.backend == "onnxruntime"
    modes = [m for m in args.modes.split(",") if m] if quantized else [q.REFERENCE_MODE]
    bad = [m for m in modes if m not in q.MODES]
    if bad or not modes:
        raise ValueError(f"--modes must be a subset of {','.join(q.MODES)}, got {args.modes!r}")
    ids, _text = q.read_tokens(engine, Path(args.text), args.max_tokens)
    windows = q.sliding_windows(len(ids), args.context, args.stride)
    print(f"[bench quality] lora {name} (rank {adapter.rank}): {len(ids)} tokens, "
          f"{len(windows)} windows of {args.context} (stride {args.stride})", flush=True)

    reference = f"hf-transformers + peft fp32, {name}"
    systems = {reference: q.System(reference, None, None, note=f"{hf}, adapter {path}")}
    scorers: dict[str, q.Scorer] = {reference: peft_scorer(hf, path)}
    closers = []
    short = Path(engine).name
    try:
        for mode in modes:
            row = f"{short} {mode} + {name}"
            systems[row] = q.System(row, engine, mode, "fp32", note=f"LoRA slot 0, {path}")
            scorers[row], close = lora_runner_scorer(engine, mode, args.context, adapter)
            closers.append(close)
        base = f"{short} fp32, no adapter"
        systems[base] = q.System(base, None, None, "fp32",
                                 note="the base model: how far the adapter moves it")
        scorers[base], close = q.runner_scorer(engine, q.REFERENCE_MODE, args.context)
        closers.append(close)
        q.logits_pass(ids, windows, scorers, systems, reference)
    finally:
        for close in closers:
            close()
    for mode in modes:
        systems[f"{short} {mode} + {name}"].llm = llm_lora_pass(
            engine, mode, ids, windows, name, path, max_rank=adapter.rank)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_quality_report(out, args, len(ids), len(windows), reference,
                         [s.as_dict() for s in systems.values()], [])
    with (out / "summary.md").open("a") as f:
        f.write("\n" + LORA_NOTE.format(name=name, rank=adapter.rank, alpha=adapter.alpha,
                                        modules=len({m for _, m in adapter.weights})) + "\n")
    return 0
