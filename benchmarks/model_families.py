"""kvflow and llama.cpp on the model families people serve, at about 1B (issue 45).

    python benchmarks/model_families.py                     # every family
    python benchmarks/model_families.py --families gemma3,qwen3 --only kv
    python benchmarks/model_families.py --smoke             # 2-layer shapes, a few minutes

Per family (:mod:`family_checkpoints`: random weights of the family's real shape, no
downloads): a HF folder, llama.cpp's own converter's F16 GGUF, ``llama-quantize`` Q4_1 (token
embedding and output Q8_0). Then, stage by stage (``--only``; a failed stage is recorded with
its reason and the run goes on):

* build: ``kvflow build-engine`` from the Q4_1 GGUF (wall time, peak RSS);
* decode / prefill: kvflow single-stream decode tok/s (32-token prompt, 128 greedy tokens) and
  a 1,024-token prompt's time to first token, alternated round by round with
  ``llama-batched-bench`` on the same GGUF (S_TG, T_PP), as benchmarks/model_sizes.py measures;
* kv: KV bytes held per token of context, full attention against the family's windows, for
  contexts of 4k, 8k and 32k tokens: what attention needs (each layer keeps
  min(context, its window) tokens), and what kvflow's KV manager holds, driven through a long
  sequence chunk by chunk as the scheduler drives it.

Results merge into ``--out``/report.json (a later run with other families or stages adds to it),
report.md and model_families.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from family_checkpoints import FAMILIES, SMOKE, Family, convert, write_hf  # noqa: E402
from model_families_report import write_outputs  # noqa: E402
from model_sizes import build_stage, isa, runtime_stages  # noqa: E402
from model_sizes_stages import run_measured  # noqa: E402
from random_checkpoints import write_hf_tokenizer  # noqa: E402

STAGES = ("build", "decode", "prefill", "llamacpp", "kv")
KV_CONTEXTS = (4096, 8192, 32768)


def ensure_gguf(fam: Family, work: Path, build: Any, src: Path, log: Any) -> dict[str, Any]:
    """The family's Q4_1 GGUF (HF folder and F16 GGUF on the way), made unless already there."""
    from kvflow.model.loader import default_model_path

    work.mkdir(parents=True, exist_ok=True)
    tok = work.parent / "tokenizer"
    if not (tok / "tokenizer.json").is_file():
        write_hf_tokenizer(default_model_path(), tok)
    hf, f16, q4 = work / "hf", work / "model-F16.gguf", work / "model-Q4_1.gguf"
    info: dict[str, Any] = {}
    if not q4.is_file():
        t0 = time.perf_counter()
        if not (hf / "config.json").is_file():
            log(f"[{fam.name}] random HF checkpoint")
            write_hf(fam, tok, hf)
        log(f"[{fam.name}] convert_hf_to_gguf")
        convert(src, hf, f16, work / "convert.log")
        part = q4.with_suffix(".part")
        cmd = [str(build.tool("llama-quantize")), "--token-embedding-type", "q8_0",
               "--output-tensor-type", "q8_0", str(f16), str(part), "Q4_1", "2"]
        out = run_measured(cmd, work / "quantize.log", None, 3600.0)
        if "error" in out:
            raise RuntimeError(f"llama-quantize: {out['error']}: {out['tail'][-400:]}")
        part.rename(q4)
        f16.unlink()
        info["write_s"] = time.perf_counter() - t0
    from gguf import GGUFReader

    params = sum(int(t.n_elements) for t in GGUFReader(str(q4)).tensors)
    info.update({"q4_1_gguf_bytes": q4.stat().st_size, "params": params,
                 "files": {"q4_1": str(q4), "tokenizer": str(tok)}})
    return info


def kv_stage(fam: Family, block_size: int = 16) -> dict[str, Any]:
    """KV bytes per token of context: needed by attention (per-layer windows) and held by the
    KV manager, full attention for comparison. From the family's HF config: a GGUF may not
    carry the window (llama.cpp's converter writes none for Mistral, whose GGUF llama.cpp
    runs with full attention)."""
    from kvflow.kv_manager.kv_cache_manager import KVCacheManager
    from kvflow.model.config import ModelConfig

    cfg = ModelConfig.from_hf_config(fam.hf_config(1, 2))
    windows = cfg.layer_sliding_windows()
    per_layer_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 2  # f16 K and V
    uniform = cfg.uniform_sliding_window
    out: dict[str, Any] = {"layer_windows": sorted(set(windows)), "uniform_window": uniform,
                           "contexts": {}}
    for ctx in KV_CONTEXTS:
        need = sum(min(ctx, w) if w else ctx for w in windows) * per_layer_token
        blocks = -(-ctx // block_size) + 1
        kv = KVCacheManager(blocks, block_size, sliding_window=uniform)
        done, chunk = 0, 512
        while done < ctx:  # chunked prefill, 512 tokens a step, as the scheduler runs it
            n = min(chunk, ctx - done)
            kv.allocate_slots("seq", done + n, num_computed_tokens=done)
            done += n
        held = sum(1 for b in kv.get_block_table("seq") if b) * block_size
        out["contexts"][str(ctx)] = {
            "full_bytes_per_token": cfg.num_hidden_layers * per_layer_token,
            "needed_bytes_per_token": need / ctx,
            "held_bytes_per_token": held * cfg.num_hidden_layers * per_layer_token / ctx}
    return out


class _Shape:
    """What runtime_stages reads of a shape (llama.cpp's f16 KV cache size)."""

    def __init__(self, fam: Family) -> None:
        self.layers, self.kv_heads, self.head_dim = fam.layers, fam.kv_heads, fam.head_dim


def run_family(fam: Family, args: argparse.Namespace, stages: set[str], build: Any,
               save: Any) -> dict[str, Any]:
    work = Path(args.workdir) / fam.name
    res: dict[str, Any] = {"what": fam.what, "architecture": fam.config["architectures"][0]}
    try:
        res["checkpoint"] = ensure_gguf(fam, work, build, Path(args.llamacpp_dir) / "src", print)
    except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
        res["checkpoint"] = {"error": f"{type(e).__name__}: {e}"[-1500:]}
        return res
    files = res["checkpoint"]["files"]
    if "build" in stages:
        res["build"] = build_stage(work, {"q4_1": files["q4_1"]}, args, None)
        save(res)
    if "kv" in stages:
        try:
            res["kv"] = kv_stage(fam)
        except Exception as e:  # noqa: BLE001
            res["kv"] = {"error": f"{type(e).__name__}: {e}"[-1500:]}
        save(res)
    run = stages & {"decode", "prefill", "llamacpp"}
    if run:
        if "decode" in run or "prefill" in run:
            run.add("load")
        res.update(runtime_stages(_Shape(fam), work, Path(files["q4_1"]), run, build, args,
                                  None))
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES), help=f"of {sorted(FAMILIES)}")
    p.add_argument("--only", default=",".join(STAGES), help=f"stages, of {','.join(STAGES)}")
    p.add_argument("--smoke", action="store_true", help="2-layer shapes, one round")
    p.add_argument("--workdir", default="reports/model_families/work")
    p.add_argument("--out", default="reports/model_families")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--build-timeout-s", type=float, default=3600.0)
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--llamacpp-dir", default="reports/peers/llama.cpp")
    args = p.parse_args()
    from kvflow.bench.peers import ensure_build

    args.kvflow_options = {}
    table = SMOKE if args.smoke else FAMILIES
    names, stages = args.families.split(","), set(args.only.split(","))
    for flag, allowed, given in (("--families", table, names), ("--only", STAGES, stages)):
        bad = [x for x in given if x not in allowed]
        if bad:
            raise SystemExit(f"{flag}: unknown {bad}; choose from {sorted(allowed)}")
    if args.smoke:
        args.out, args.workdir, args.rounds = (str(Path(args.out) / "smoke"),
                                               str(Path(args.workdir) / "smoke"), 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    build = ensure_build(args.llamacpp_dir, jobs=2, require=("llama-batched-bench",
                                                              "llama-quantize"))
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {"families": {}}
    report["machine"] = {**isa(), "llama_cpp": build.version()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    for name in names:
        prev = dict(report["families"].get(name, {}))

        def save(res: dict[str, Any], name: str = name, prev: dict[str, Any] = prev) -> None:
            stamp = {"utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": commit,
                     "threads": args.threads, "rounds": args.rounds}
            res = {**res, "measured": {**prev.get("measured", {}),
                                       **{s: stamp for s in sorted(stages)}}}
            report["families"][name] = {**prev, **res}
            report_path.write_text(json.dumps(report, indent=1))
            write_outputs(report, out)

        print(f"[model_families] {name}: {table[name].what}; stages {sorted(stages)}",
              flush=True)
        save(run_family(table[name], args, stages, build, save))
        if not args.keep_checkpoints:
            shutil.rmtree(Path(args.workdir) / name / "hf", ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
