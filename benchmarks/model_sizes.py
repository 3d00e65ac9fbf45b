"""kvflow and llama.cpp on the model sizes people run: 1B, 3B and 8B Llama shapes (issue 44).

    python benchmarks/model_sizes.py --models 1b,3b,8b
    python benchmarks/model_sizes.py --smoke          # every stage on a tiny shape, 1-2 minutes

Per model (random weights, :mod:`random_checkpoints`, no downloads): an F16 GGUF and a bf16
safetensors folder written tensor by tensor, the GGUF quantized to Q4_1 by ``llama-quantize``
(token embedding and output in Q8_0, as the shipped SmolLM2 GGUF has them: llama-quantize's
default for them, Q6_K, is a type kvflow would dequantize). Then, stage by stage
(``--only``; a failure is recorded with its reason and the run goes on):

* build: ``kvflow build-engine`` from the Q4_1 GGUF, and from the bf16 folder with ``--quantize
  int4``: wall time and peak RSS of the process tree (polled; killed past ``--max-rss-gb``);
* load: ``LLM(engine)`` in a worker process: load time, peak RSS while loading, RSS after load,
  with a KV pool the size of llama.cpp's ``-c 4096`` f16 cache and no swap space;
* decode: single-stream tok/s after the first token (32-token prompt, 128 greedy tokens);
* prefill: a 1,024-token prompt, wall time to its first token;
* llamacpp: ``llama-batched-bench -c 4096`` at B=1 on the same Q4_1 GGUF (S_TG of a 32-token
  prompt, T_PP of a 1,024-token one) and its peak RSS, alternated round by round with kvflow's;
* served: kvflow's server (tritonserver + OpenAI frontend, what ``kvflow serve`` starts) and
  ``llama-server -np 8`` (with ``llamacpp``), c=8, 128 in / 64 out, rounds alternated.

Every system runs ``--threads`` threads; each figure is the best of ``--rounds``. llama.cpp is
the build that benchmarks/peers.py makes (under ``--llamacpp-dir``, reused). Results are merged
into ``--out``/report.json (a later run with other models or stages adds to it), report.md and
model_sizes.png (memory and speed against model size).

Disk (``--workdir``), per model, while it runs: 1b about 8 GB (F16 GGUF 2.5 + bf16 2.5 + Q4_1
0.8 + engines), 3b about 19 GB, 8b about 45 GB (F16 GGUF 16 + bf16 16 + Q4_1 5 + engines). The F16
GGUF is deleted once quantized and the bf16 folder once built from, unless --keep-checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_sizes_report import write_outputs  # noqa: E402
from model_sizes_stages import (  # noqa: E402
    KvflowWorker,
    llama_bench,
    random_prompt,
    run_measured,
    served,
    worker_main,
)
from random_checkpoints import SHAPES, ModelShape, write_checkpoints, write_hf_tokenizer  # noqa: E402

STAGES = ("build", "load", "decode", "prefill", "served", "llamacpp")
DECODE_PROMPT, DECODE_TOKENS, PREFILL_TOKENS, LLAMA_CTX = 32, 128, 1024, 4096


def isa() -> dict[str, Any]:
    """Which kernels run: kvflow's native ISA (when the library says) and the CPU's flags."""
    flags = next((line.split(":", 1)[1].split() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx_vnni", "avx512_bf16", "amx_int8")
    out: dict[str, Any] = {"cpu_flags": [f for f in wanted if f in flags], "native_isa": None}
    try:
        from kvflow.plugins import ort_custom_ops

        fn = getattr(ort_custom_ops, "native_isa", None)
        out["native_isa"] = fn() if fn else "native_isa() not available in this kvflow"
    except Exception as e:  # noqa: BLE001 (reported, not fatal)
        out["native_isa"] = f"error: {e}"
    return out


def kv_bytes(shape: ModelShape, tokens: int) -> int:
    """llama.cpp's f16 KV cache for ``tokens`` tokens."""
    return tokens * shape.layers * 2 * shape.kv_heads * shape.head_dim * 2


def ensure_checkpoints(key: str, shape: ModelShape, work: Path, build: Any, need_hf: bool,
                       keep: bool, log: Any) -> dict[str, Any]:
    """The Q4_1 GGUF (and the bf16 folder when ``need_hf``), written unless already there."""
    from kvflow.model.loader import default_model_path

    work.mkdir(parents=True, exist_ok=True)
    files = {"f16": work / "model-F16.gguf", "q4_1": work / "model-Q4_1.gguf",
             "hf": work / "hf-bf16", "tokenizer": work.parent / "tokenizer"}
    if not files["tokenizer"].is_dir():
        write_hf_tokenizer(default_model_path(), files["tokenizer"])
    info: dict[str, Any] = {"params": shape.num_params()}
    want_gguf = not files["q4_1"].is_file() and not files["f16"].is_file()
    want_hf = need_hf and not files["hf"].is_dir()
    if want_gguf or want_hf:
        t0 = time.perf_counter()
        write_checkpoints(shape, default_model_path(), files["f16"] if want_gguf else None,
                          files["hf"] if want_hf else None, progress=log)
        info["write_s"] = time.perf_counter() - t0
    if not files["q4_1"].is_file():
        if build is None or not build.has("llama-quantize"):
            raise RuntimeError("no llama-quantize to make the Q4_1 GGUF")
        t0 = time.perf_counter()
        part = files["q4_1"].with_suffix(".part")
        cmd = [str(build.tool("llama-quantize")), "--token-embedding-type", "q8_0",
               "--output-tensor-type", "q8_0", str(files["f16"]), str(part), "Q4_1", "2"]
        out = run_measured(cmd, work / "quantize.log", None, 3600.0)
        if "error" in out:
            raise RuntimeError(f"llama-quantize: {out['error']}: {out['tail'][-400:]}")
        part.rename(files["q4_1"])
        info["quantize_s"] = time.perf_counter() - t0
    if files["f16"].is_file():
        info["f16_gguf_bytes"] = files["f16"].stat().st_size
        if not keep:
            files["f16"].unlink()
    info["q4_1_gguf_bytes"] = files["q4_1"].stat().st_size
    if files["hf"].is_dir():
        info["hf_bytes"] = sum(f.stat().st_size for f in files["hf"].glob("*.safetensors"))
    info["files"] = {k: str(v) for k, v in files.items() if v.exists()}
    return info


def build_stage(work: Path, files: dict[str, str], args: argparse.Namespace,
                limit: int | None) -> dict[str, Any]:
    """``kvflow build-engine`` from the Q4_1 GGUF and from the bf16 folder (int4)."""
    kvflow = str(Path(sys.executable).with_name("kvflow"))
    out: dict[str, Any] = {}
    jobs: dict[str, tuple[str, list[str]]] = {"q4_1_gguf": (files["q4_1"], [])}
    if "hf" in files:
        jobs["hf_bf16_int4"] = (files["hf"], ["--quantize", "int4"])
    for name, (model, extra) in jobs.items():
        engine = work / f"engine-{name}"
        shutil.rmtree(engine, ignore_errors=True)
        cmd = [kvflow, "build-engine", "--model", model, "--output", str(engine),
               "--backend", "onnxruntime", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        r = run_measured(cmd, work / f"build_{name}.log", limit, args.build_timeout_s, env)
        if "error" not in r:
            r["engine_bytes"] = sum(f.stat().st_size for f in engine.rglob("*") if f.is_file())
            r.pop("tail")
        out[name] = r
        print(f"[build {name}] {r.get('error') or 'ok'}: {r['wall_s']:.0f} s, peak RSS "
              f"{r['peak_rss_bytes'] / 2**30:.2f} GiB", flush=True)
    if "hf" in files and not args.keep_checkpoints:
        shutil.rmtree(files["hf"], ignore_errors=True)
    return out


def runtime_stages(shape: ModelShape, work: Path, gguf: Path, stages: set[str], build: Any,
                   args: argparse.Namespace, limit: int | None) -> dict[str, Any]:
    """load / decode / prefill on kvflow and llama-batched-bench, alternated round by round."""
    res: dict[str, Any] = {}
    engine = work / "engine-q4_1_gguf"
    worker = None
    kvflow_wanted = stages & {"load", "decode", "prefill"}
    options = {"enable_prefix_caching": False, "kv_cache_bytes": kv_bytes(shape, LLAMA_CTX),
               "swap_space_bytes": 0, **args.kvflow_options}
    if kvflow_wanted:
        try:
            if not (engine / "engine_config.json").is_file():
                raise RuntimeError(f"no engine at {engine} (run the build stage)")
            worker = KvflowWorker(Path(__file__), engine, options, args.threads,
                                  work / "kvflow_worker.log", limit)
            res["load"] = {**worker.load, "options": options}
            worker.run(random_prompt(8, 99), 2)  # warm-up
        except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
            res["load"] = {"error": str(e)[-1500:], "options": options}
            worker = None
    dec: list[float] = []
    pre: list[float] = []
    peaks: list[int] = []
    lc: list[dict[str, Any]] = []
    for r in range(args.rounds):
        if worker is not None:
            try:
                if "decode" in stages:
                    dec.append(worker.run(random_prompt(DECODE_PROMPT, r), DECODE_TOKENS)
                               ["decode_tok_s"])
                if "prefill" in stages:
                    pre.append(worker.run(random_prompt(PREFILL_TOKENS, 10 + r), 1)["wall_s"])
                peaks.append(worker.poller.peak)
            except Exception as e:  # noqa: BLE001
                res["kvflow_run_error"] = str(e)[-1500:]
                worker = None
        if "llamacpp" in stages:
            lc.append(llama_bench(build, gguf, args.threads, PREFILL_TOKENS, DECODE_PROMPT,
                                  DECODE_TOKENS, LLAMA_CTX, work / f"batched_bench_{r}.log",
                                  limit))
        print(f"[round {r}] kvflow decode {dec[-1:]} prefill {pre[-1:]}; llama.cpp "
              f"{ {k: v for k, v in lc[-1].items() if k != 'rows'} if lc else '-'}", flush=True)
    if worker is not None:
        worker.close()
    if dec:
        res["decode"] = {"tok_s": max(dec), "rounds": dec, "prompt": DECODE_PROMPT,
                         "tokens": DECODE_TOKENS}
    if pre:
        res["prefill"] = {"s": min(pre), "rounds": pre, "tokens": PREFILL_TOKENS}
    if peaks:
        res["load"]["peak_rss_running_bytes"] = max(peaks)
    if lc:
        ok = [x for x in lc if "error" not in x]
        res["llamacpp"] = ({"decode_tok_s": max(x["decode_tok_s"] for x in ok),
                            "prefill_s": min(x["prefill_s"] for x in ok),
                            "peak_rss_bytes": max(x["peak_rss_bytes"] for x in ok),
                            "rounds": ok} if ok else {"error": lc[-1]["error"],
                                                      "tail": lc[-1].get("tail")})
    return res


def run_model(key: str, args: argparse.Namespace, stages: set[str], build: Any,
              limit: int | None, save: Any) -> dict[str, Any]:
    """Every selected stage of one model; ``save(res)`` after each, so that an interrupted run
    keeps what it measured."""
    shape = SHAPES[key]
    work = Path(args.workdir) / key
    res: dict[str, Any] = {"shape": {k: getattr(shape, k) for k in (
        "name", "hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "tied")}}
    try:
        res["checkpoint"] = ensure_checkpoints(key, shape, work, build, "build" in stages,
                                               args.keep_checkpoints, print)
    except Exception as e:  # noqa: BLE001
        res["checkpoint"] = {"error": str(e)[-1500:]}
        return res
    files = res["checkpoint"]["files"]
    if "build" in stages:
        res["build"] = build_stage(work, files, args, limit)
        save(res)
    res.update(runtime_stages(shape, work, Path(files["q4_1"]), stages, build, args, limit))
    save(res)
    if stages & {"served", "llamacpp"}:
        engine = work / "engine-q4_1_gguf"
        try:
            res["served"] = served(
                engine if "served" in stages and (engine / "engine_config.json").is_file()
                else None, build, Path(files["q4_1"]) if "llamacpp" in stages else None,
                Path(files["tokenizer"]), {"enable_prefix_caching": False,
                                           **args.kvflow_options},
                args.threads, 8, args.served_requests, 128, 64, args.rounds, work)
        except Exception as e:  # noqa: BLE001
            res["served"] = {"error": f"{type(e).__name__}: {e}"[-1500:]}
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="1b,3b,8b", help=f"of {sorted(SHAPES)}")
    p.add_argument("--only", default=",".join(STAGES), help=f"stages, of {','.join(STAGES)}")
    p.add_argument("--smoke", action="store_true",
                   help="the tiny shape (2 layers, hidden 256), one round, into --out/smoke")
    p.add_argument("--workdir", default="reports/model_sizes/work")
    p.add_argument("--out", default="reports/model_sizes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--served-requests", type=int, default=32)
    p.add_argument("--max-rss-gb", type=float, default=20.0,
                   help="kill a measured process tree past this RSS (0: never)")
    p.add_argument("--build-timeout-s", type=float, default=3600.0)
    p.add_argument("--kvflow-option", action="append", metavar="KEY=VALUE",
                   help="an engine option for kvflow's load/decode/prefill/served runs")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--llamacpp-dir", default="reports/peers/llama.cpp")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-options", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker_main(args.worker, json.loads(args.worker_options))

    from kvflow.bench.peers import ensure_build, parse_engine_options

    args.kvflow_options = parse_engine_options(args.kvflow_option, "--kvflow-option")
    models = ["smoke"] if args.smoke else args.models.split(",")
    stages = set(args.only.split(","))
    for name, allowed, given in (("--models", SHAPES, models), ("--only", STAGES, stages)):
        bad = [x for x in given if x not in allowed]
        if bad:
            raise SystemExit(f"{name}: unknown {bad}; choose from {sorted(allowed)}")
    if args.smoke:
        args.out, args.rounds = str(Path(args.out) / "smoke"), 1
        args.served_requests = 8
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    build = ensure_build(args.llamacpp_dir, jobs=2, require=("llama-batched-bench",
                                                              "llama-server", "llama-quantize"))
    limit = int(args.max_rss_gb * 2**30) or None
    machine = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
               "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
               **isa(), "llama_cpp": build.version()}
    print(f"[model_sizes] ISA: {machine['native_isa']}; CPU flags: {machine['cpu_flags']}",
          flush=True)
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {"models": {}}
    report["machine"] = machine
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    for key in models:
        print(f"[model_sizes] {key}: {SHAPES[key].name}, stages {sorted(stages)}", flush=True)
        prev = dict(report["models"].get(key, {}))

        def save(res: dict[str, Any], key: str = key, prev: dict[str, Any] = prev) -> None:
            run = {"utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": commit,
                   "threads": args.threads, "rounds": args.rounds}
            # when and at which commit each stage was last measured (runs may select stages)
            res = {**res, "measured": {**prev.get("measured", {}),
                                       **{stage: run for stage in sorted(stages)}}}
            for part in ("build", "served"):  # per system: a partial run keeps the others'
                if isinstance(prev.get(part), dict) and isinstance(res.get(part), dict):
                    res[part] = {**prev[part], **res[part]}
            report["models"][key] = {**prev, **res}
            report_path.write_text(json.dumps(report, indent=1))
            write_outputs(report, out)

        save(run_model(key, args, stages, build, limit, save))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
