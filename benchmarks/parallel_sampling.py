"""Parallel sampling: one request with n sequences against n separate requests.

The same prompt and seeds three ways: ``n`` forked sequences (one prefill, shared blocks), ``n``
requests with prefix caching (shared full blocks once cached), and ``n`` requests without it.
Reported: prompt tokens computed, the most KV blocks in use, wall time, output tokens/s.

    python benchmarks/parallel_sampling.py [--engine engines/smollm2-135m] [--n 8]

Writes reports/parallel_sampling/{report.json,summary.md,parallel_sampling.png} and prints the
table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvflow import LLM, SamplingParams
from kvflow.reports.writers import pyplot, save_figure, write_report

PROMPT = ("You are a helpful assistant. Read the following notes and write a short, friendly "
          "summary of them for a colleague who missed the meeting. ") * 6


def run(engine_dir: str, n: int, max_tokens: int, mode: str) -> dict[str, float]:
    caching = mode != "separate, no prefix caching"
    with LLM(engine_dir, enable_prefix_caching=caching) as llm:
        engine = llm.engine
        llm.generate(["warm up"], SamplingParams(max_tokens=2))
        engine.step_stats.clear()
        base = engine.counters.prompt_tokens
        t0 = time.perf_counter()
        if mode == "forked (n > 1)":
            outs = llm.generate([PROMPT], SamplingParams(n=n, max_tokens=max_tokens,
                                                         temperature=1.0, seed=1,
                                                         ignore_eos=True))
            tokens = sum(len(c.token_ids) for c in outs[0].outputs)
        else:
            outs = llm.generate([PROMPT] * n, [SamplingParams(max_tokens=max_tokens,
                                                              temperature=1.0, seed=1 + j,
                                                              ignore_eos=True)
                                               for j in range(n)])
            tokens = sum(len(o.token_ids) for o in outs)
        wall = time.perf_counter() - t0
        peak = max(s.kv_blocks_used for s in engine.step_stats)
        return {"prompt_tokens_computed": engine.counters.prompt_tokens - base,
                "peak_kv_blocks": peak, "wall_s": round(wall, 3),
                "output_tok_s": round(tokens / wall, 1),
                "prompt_tokens": outs[0].num_prompt_tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="engines/smollm2-135m")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default="reports/parallel_sampling")
    args = p.parse_args()
    modes = ("forked (n > 1)", "separate, prefix caching", "separate, no prefix caching")
    rows = {m: run(args.engine, args.n, args.max_tokens, m) for m in modes}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({"n": args.n, "max_tokens": args.max_tokens,
                                                 "engine": args.engine, "rows": rows},
                                                indent=2))
    prompt = next(iter(rows.values()))["prompt_tokens"]
    lines = [f"# n = {args.n} samples of one {prompt}-token prompt, {args.max_tokens} tokens "
             "each", "", "| how | prompt tokens computed | peak KV blocks | wall s | "
             "output tok/s |", "|---|---|---|---|---|"]
    lines += [f"| {m} | {r['prompt_tokens_computed']} | {r['peak_kv_blocks']} | {r['wall_s']} "
              f"| {r['output_tok_s']} |" for m, r in rows.items()]
    write_report(out / "summary.md", lines)
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    names = [m.replace(", ", ",\n") for m in modes]
    for ax, key, title in zip(axes, ("prompt_tokens_computed", "peak_kv_blocks",
                                     "output_tok_s"),
                              ("prompt tokens computed", "peak KV blocks", "output tok/s"),
                              strict=True):
        ax.bar(names, [rows[m][key] for m in modes], color=["C2", "C0", "C1"])
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"n = {args.n} samples of one {prompt}-token prompt, {args.max_tokens} tokens "
                 "each")
    save_figure(fig, out / "parallel_sampling.png")


if __name__ == "__main__":
    main()
