"""``kvflow bench quality``: what kvflow's arithmetic costs in quality, measured as the field does.

    kvflow bench quality --engine engines/smollm2-135m --max-tokens 100000

Sliding-window perplexity over a text (default: tinyshakespeare), the usual HF recipe: windows
of ``--context`` tokens moving by ``--stride``, each scoring only its tokens not scored before
(every token after the first exactly once, each seeing at least ``context - stride`` tokens
before it once the first window is past). Per engine and per ``quantized_matmul`` mode:

* the perplexity from prompt logprobs (``kvflow.LLM``, ``max_tokens=1``, ``prompt_logprobs=0``);
* the mean KL divergence of its next-token distributions from the reference's (the first
  engine on ``quantized_matmul=fp32``), and the rate at which its top-1 token agrees, over the
  full vocabulary: the runner's logits for every scored position (``SeqChunk.prompt_rows``), as
  ``llama-perplexity --kl-divergence`` computes them (prompt logprobs hold only the top k);

and side by side: HF transformers on the same weights (the same windows, full vocabulary), and
``llama-perplexity`` on the engine's GGUF (Q4_1) and its F32 dequantization, with llama.cpp's
own KL of the Q4_1 against the F32. Writes ``summary.md``, ``report.json`` and ``quality.png``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.bench.quality_llamacpp import llama_cpp_rows, packaged_model
from kvflow.workloads.data import shared_data_file

REFERENCE_MODE = "fp32"
MODES = ("int8", "fp32", "auto")
LLM_BATCH = 8  # windows per LLM.generate call: a progress line each


def default_text() -> Path:
    """tinyshakespeare, among the shared data files."""
    return shared_data_file("tinyshakespeare.txt")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", action="append", required=True, metavar="DIR",
                   help="engine folder (repeat for several); the first one's fp32 path is the "
                        "KL reference")
    p.add_argument("--text", default=str(default_text()), help="plain-text file to score")
    p.add_argument("--context", type=int, default=512, help="tokens per window")
    p.add_argument("--stride", type=int, default=256, help="tokens a window moves by")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="score the text's first N tokens (default: all)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="quantized_matmul modes of a quantized engine")
    p.add_argument("--kv-cache-dtypes", default="fp32",
                   help="KV cache dtypes to run each engine and mode with (comma-separated, "
                        "e.g. fp32,fp16); the reference is always fp32")
    p.add_argument("--hf", default=None, help="HF transformers on these weights (default: the "
                                              "first engine's own checkpoint; 'none': skip)")
    p.add_argument("--llama-cpp", default=None, metavar="BIN_DIR",
                   help="llama.cpp's bin folder with llama-perplexity (default: build it under "
                        "reports/peers/llama.cpp as benchmarks/peers.py does; 'none': skip)")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the first "
                                                "engine's, when it is the packaged model)")
    p.add_argument("--f32-gguf", default="reports/peers/SmolLM2-135M-Instruct.F32.gguf",
                   help="its F32 dequantization (made with llama-quantize when missing)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument("--lora", default=None, metavar="NAME=PATH",
                   help="score a LoRA adapter (PEFT folder or GGUF LoRA) instead: kvflow with "
                        "it against HF transformers + PEFT on the same weights "
                        "(kvflow/bench/quality_lora.py)")
    p.add_argument("--out", default="reports/quality")


@dataclass(frozen=True)
class Window:
    """Tokens ``begin .. end-1`` run; positions ``first .. end-1`` are scored, each from the
    logits of the position before it."""

    begin: int
    end: int
    first: int


def sliding_windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    """HF's sliding-window recipe: every position ``1 .. num_tokens-1`` in exactly one window."""
    if context < 2:
        raise ValueError(f"--context must be at least 2, got {context}")
    if not 1 <= stride < context:  # stride == context would leave each window's first token
        raise ValueError(f"--stride must be between 1 and --context - 1 ({context - 1}), got "
                         f"{stride}")
    if num_tokens < 2:
        raise ValueError(f"the text must have at least 2 tokens, got {num_tokens}")
    windows, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + context, num_tokens)
        first = max(prev_end, begin + 1)
        if first < end:
            windows.append(Window(begin, end, first))
        prev_end = end
        if end == num_tokens:
            break
    return windows


@dataclass
class Tally:
    """Running sums over scored tokens: negative log-likelihood, and against the reference,
    KL divergence and top-1 agreement."""

    nll: float = 0.0
    tokens: int = 0
    kl: float = 0.0
    top1_same: int = 0
    kl_tokens: int = 0
    seconds: float = 0.0

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"perplexity": self.perplexity, "tokens": self.tokens,
                               "seconds": round(self.seconds, 2)}
        if self.kl_tokens:
            out.update(mean_kl=self.kl / self.kl_tokens,
                       top1_agreement=self.top1_same / self.kl_tokens)
        return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_and_top1(reference: np.ndarray, candidate: np.ndarray) -> tuple[float, int]:
    """Sum over rows of KL(reference || candidate) (log-probability rows, full vocabulary) and
    the number of rows whose argmax agrees."""
    kl = float((np.exp(reference) * (reference - candidate)).sum())
    same = int((reference.argmax(axis=-1) == candidate.argmax(axis=-1)).sum())
    return kl, same


# --- scorers: full-vocabulary logits of a window's scored positions ----------------------------

Scorer = Callable[[Sequence[int], int], np.ndarray]


def runner_scorer(engine_dir: str | Path, mode: str, context: int,
                  kv_cache_dtype: str = "fp32") -> tuple[Scorer, Callable]:
    """The engine's runner on ``mode`` and ``kv_cache_dtype``: ``score(ids, skip)`` gives the
    logits predicting ``ids[skip+1:]`` (rows for positions ``skip .. len-2``); and its
    ``close``."""
    from kvflow.build.engine_config import EngineConfig
    from kvflow.kv_manager import KVCacheManager
    from kvflow.runtime import create_runner
    from kvflow.runtime.step_builder import SeqChunk, build_step

    block = EngineConfig.load(engine_dir).limits.block_size
    num_blocks = -(-context // block) + 1
    runner = create_runner(None, engine_dir, num_blocks, quantized_matmul=mode,
                           kv_cache_dtype=kv_cache_dtype)

    def score(ids: Sequence[int], skip: int) -> np.ndarray:
        kv = KVCacheManager(num_blocks, block)
        n = len(ids)
        kv.allocate_slots("w", n)
        step = build_step(kv, [SeqChunk("w", list(ids), 0, n, True, range(skip, n - 1))])
        return np.asarray(runner.execute(step))[:-1]  # the sampled (last) row predicts nothing

    return score, runner.close


def hf_scorer(model: str) -> Scorer:
    """HF transformers' fp32 model (``kvflow.model.hf_reference``) on a window."""
    import torch

    from kvflow.model.hf_reference import load_hf_reference

    hf = load_hf_reference(model)

    def score(ids: Sequence[int], skip: int) -> np.ndarray:
        with torch.inference_mode():
            return hf(torch.tensor([list(ids)])).logits[0, skip:-1].float().numpy()

    return score


@dataclass
class System:
    """One row of the report: how it ran, and its tallies from the full-vocabulary pass
    (``logits``) and, for kvflow, from prompt logprobs through ``kvflow.LLM`` (``llm``)."""

    name: str
    engine: str | None
    mode: str | None
    kv_cache_dtype: str | None = None
    logits: Tally = field(default_factory=Tally)
    llm: Tally | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "engine": self.engine, "quantized_matmul": self.mode,
                "kv_cache_dtype": self.kv_cache_dtype,
                "full_vocabulary": self.logits.as_dict(),
                "prompt_logprobs": self.llm.as_dict() if self.llm else None, "note": self.note}


def logits_pass(ids: Sequence[int], windows: Sequence[Window], scorers: dict[str, Scorer],
                systems: dict[str, System], reference: str,
                log: Callable[[str], None] = print) -> None:
    """Every window through every scorer; tallies NLL, and KL and top-1 against ``reference``
    (the first scorer), into ``systems``."""
    t_log = time.monotonic()
    for i, w in enumerate(windows):
        window, skip = ids[w.begin:w.end], w.first - w.begin - 1
        targets = np.asarray(ids[w.first:w.end])
        ref: np.ndarray | None = None
        for name, score in scorers.items():
            t0 = time.perf_counter()
            lp = log_softmax(score(window, skip))
            tally = systems[name].logits
            tally.seconds += time.perf_counter() - t0
            tally.nll -= float(lp[np.arange(len(targets)), targets].sum())
            tally.tokens += len(targets)
            ref = lp if name == reference else ref
            if ref is not None:
                kl, same = kl_and_top1(ref, lp)
                tally.kl += kl
                tally.top1_same += same
                tally.kl_tokens += len(targets)
        if time.monotonic() - t_log > 30 or i + 1 == len(windows):
            t_log = time.monotonic()
            log(f"[bench quality] full-vocabulary pass: window {i + 1}/{len(windows)}")


def llm_pass(engine_dir: str, mode: str, ids: Sequence[int], windows: Sequence[Window],
             log: Callable[[str], None] = print, kv_cache_dtype: str = "fp32") -> Tally:
    """Perplexity from prompt logprobs: each window a prompt to ``kvflow.LLM`` on ``mode``
    and ``kv_cache_dtype``."""
    from kvflow import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    tally = Tally()
    t0 = time.perf_counter()
    with LLM(engine_dir, quantized_matmul=mode, kv_cache_dtype=kv_cache_dtype,
             enable_prefix_caching=False) as llm:
        for at in range(0, len(windows), LLM_BATCH):
            batch = windows[at:at + LLM_BATCH]
            outs = llm.generate([list(ids[w.begin:w.end]) for w in batch], params)
            for w, out in zip(batch, outs, strict=True):
                entries = out.prompt_logprobs
                if out.error or entries is None:
                    raise RuntimeError(f"{engine_dir} ({mode}): no prompt logprobs: {out.error}")
                for p in range(w.first, w.end):
                    entry = entries[p - w.begin]
                    assert entry is not None
                    tally.nll -= entry[ids[p]]
                    tally.tokens += 1
            log(f"[bench quality] {Path(engine_dir).name} {mode} kv {kv_cache_dtype} prompt "
                f"logprobs: window "
                f"{at + len(batch)}/{len(windows)}")
    tally.seconds = time.perf_counter() - t0
    return tally


def read_tokens(engine_dir: str, path: Path, max_tokens: int | None) -> tuple[list[int], str]:
    """The text's first ``max_tokens`` tokens (all without it; no special tokens added) by the
    engine's tokenizer, and their text (for llama.cpp)."""
    from kvflow.text.tokenizer import EngineTokenizer

    if not path.is_file():
        raise FileNotFoundError(f"--text {path} is missing")
    tok = EngineTokenizer(engine_dir)
    text = path.read_text(encoding="utf-8")
    if max_tokens is None:
        return tok.encode(text, add_special_tokens=False), text
    chars = max_tokens * 8  # tokenize a prefix only, longer than needed
    while True:
        ids = tok.encode(text[:chars], add_special_tokens=False)
        if len(ids) > max_tokens or chars >= len(text):
            break
        chars *= 2
    ids = ids[:max_tokens]
    return ids, tok.decode(ids, skip_special_tokens=False)


def hf_model_for(engine_dir: str, hf: str | None) -> str | None:
    """``--hf``, else the engine's own checkpoint when it is the packaged model."""
    if hf == "none":
        return None
    if hf:
        return hf
    if packaged_model(engine_dir):
        return "default"
    raise ValueError(f"--hf: {engine_dir} was not built from the packaged model; name its "
                     "checkpoint with --hf (or --hf none)")


def main(args: argparse.Namespace) -> int:
    from kvflow.build.engine_config import EngineConfig
    from kvflow.reports.quality_report import write_quality_report
    from kvflow.runtime.base import check_kv_cache_dtype

    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--modes must be a subset of {','.join(MODES)}, got {args.modes!r}")
    kv_dtypes = [d for d in args.kv_cache_dtypes.split(",") if d]
    for d in kv_dtypes:
        check_kv_cache_dtype(d)
    if not kv_dtypes or "auto" in kv_dtypes:
        raise ValueError(f"--kv-cache-dtypes must name dtypes (fp32, fp16), got "
                         f"{args.kv_cache_dtypes!r}")
    configs = {e: EngineConfig.load(e) for e in args.engine}
    for e, cfg in configs.items():
        if args.context + 1 > cfg.limits.max_model_len:
            raise ValueError(f"--context {args.context} + 1 generated token exceeds {e}'s "
                             f"max_model_len of {cfg.limits.max_model_len}")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    first = args.engine[0]
    ids, text = read_tokens(first, Path(args.text), args.max_tokens)
    windows = sliding_windows(len(ids), args.context, args.stride)
    print(f"[bench quality] {len(ids)} tokens of {args.text}: {len(windows)} windows of "
          f"{args.context} (stride {args.stride})", flush=True)

    systems: dict[str, System] = {}
    scorers: dict[str, Scorer] = {}
    closers = []
    reference = f"{Path(first).name} {REFERENCE_MODE}"
    try:
        for e, cfg in configs.items():
            quantized = cfg.quantization is not None and cfg.backend == "onnxruntime"
            for mode in (modes if quantized else [REFERENCE_MODE]):
                for kv in kv_dtypes:
                    name = f"{Path(e).name} {mode}" + ("" if kv == "fp32" else f" kv {kv}")
                    note = "" if quantized else ("not quantized: every quantized_matmul mode "
                                                 "is this fp32 path")
                    systems[name] = System(name, e, mode, kv, note=note)
                    scorers[name], close = runner_scorer(e, mode, args.context, kv)
                    closers.append(close)
        if reference not in scorers:  # the first engine's fp32 path leads: the reference
            systems[reference] = System(reference, first, REFERENCE_MODE, "fp32")
            scorers[reference], close = runner_scorer(first, REFERENCE_MODE, args.context)
            closers.append(close)
        scorers = {reference: scorers[reference],
                   **{k: v for k, v in scorers.items() if k != reference}}
        hf = hf_model_for(first, args.hf)
        if hf is not None:
            print(f"[bench quality] HF transformers on {hf}", flush=True)
            systems["hf-transformers fp32"] = System("hf-transformers fp32", None, None, note=hf)
            scorers["hf-transformers fp32"] = hf_scorer(hf)
        logits_pass(ids, windows, scorers, systems, reference)
    finally:
        for close in closers:
            close()
    for s in systems.values():
        if s.engine is not None and s.mode is not None:
            s.llm = llm_pass(s.engine, s.mode, ids, windows,
                             kv_cache_dtype=s.kv_cache_dtype or "fp32")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peers = llama_cpp_rows(args, first, text, out)
    write_quality_report(out, args, len(ids), len(windows), reference,
                         [s.as_dict() for s in systems.values()], peers)
    return 0
