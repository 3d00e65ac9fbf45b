"""llama.cpp's side of ``kvflow bench quality``: llama-perplexity on the F32 GGUF (the KL base)
and on the engine's own GGUF, over the same text and window size."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any


def packaged_model(engine_dir: str) -> bool:
    """Whether the engine was built from the packaged default GGUF."""
    from kvflow.build.engine_config import EngineConfig
    from kvflow.model.loader import DEFAULT_MODEL_FILE

    return EngineConfig.load(engine_dir).source.get("name") == DEFAULT_MODEL_FILE


def llama_cpp_rows(args: argparse.Namespace, engine_dir: str, text: str,
                   out: Path) -> list[dict[str, Any]]:
    """llama-perplexity on the F32 GGUF (the KL base) and the engine's GGUF, on ``text``."""
    from kvflow.bench.peers import LlamaCppBuild, ensure_build, ensure_f32_gguf, llama_perplexity
    from kvflow.model.loader import default_model_path

    if args.llama_cpp == "none":
        return []
    gguf = args.gguf or (default_model_path() if packaged_model(engine_dir) else None)
    if gguf is None:
        print("[bench quality] llama.cpp skipped: no --gguf for this engine", flush=True)
        return []
    if args.llama_cpp:
        bin_dir = Path(args.llama_cpp).resolve()
        build = LlamaCppBuild(bin_dir.parent, bin_override=bin_dir)
        if build.missing(("llama-perplexity",)):
            raise FileNotFoundError(f"--llama-cpp {bin_dir} has no llama-perplexity")
    else:
        build = ensure_build("reports/peers/llama.cpp", require=("llama-perplexity",
                                                                  "llama-quantize"))
    f32 = ensure_f32_gguf(build, gguf, args.f32_gguf)
    text_file, kl_base = out / "text.txt", out / "llama-f32.kld"
    text_file.write_text(text)
    rows = []
    try:
        for name, model, compare in (("llama.cpp F32", f32, False),
                                     (f"llama.cpp {Path(gguf).stem.split('.')[-1]}", gguf, True)):
            print(f"[bench quality] {name}: llama-perplexity -c {args.context}", flush=True)
            t0 = time.perf_counter()
            res = llama_perplexity(build, model, text_file, args.context, args.threads, kl_base,
                                   compare, log_path=out / f"{name.replace(' ', '-')}.log")
            chunks = int(res.pop("chunks", 0))
            rows.append({"name": name, "gguf": str(model), **res,
                         "tokens": chunks * (args.context - 1 - args.context // 2),
                         "seconds": round(time.perf_counter() - t0, 2)})
    finally:
        kl_base.unlink(missing_ok=True)  # its logits: vocab x 2 bytes per scored token
    return rows
