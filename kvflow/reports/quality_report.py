"""``kvflow bench quality``'s report: ``summary.md`` (also printed), ``report.json`` and
``quality.png`` (perplexity and KL divergence per system, bars)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from kvflow.reports.writers import pyplot, save_figure, write_report

METHOD = (
    "Perplexity: exp of the mean negative log-likelihood of every token after the first, "
    "in windows of {context} tokens moving by {stride} (each window scores only its tokens not "
    "scored before: HF's sliding-window recipe). kvflow's column comes from prompt logprobs "
    "(`kvflow.LLM`, `prompt_logprobs=0`, `max_tokens=1`); the full-vocabulary column from the "
    "runner's logits on the same windows. KL: mean over the scored tokens of KL(reference || "
    "system) over the full vocabulary (49k-way softmax of both, no top-k truncation), the "
    "reference being `{reference}`; top-1: the rate at which the system's most likely next "
    "token is the reference's. llama.cpp: `llama-perplexity -c {context}` on the same text "
    "(its own tokenization; chunks of {context} tokens, each scoring its second half: the same "
    "context per scored token as stride {stride} when stride is half the context, on half as "
    "many tokens); its KL and top-1 (\"Same top p\") are those of its Q4_1 GGUF against its "
    "F32 GGUF, the Q4_1 weights dequantized, as kvflow's int8 mode is against its fp32 mode.")


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if spec == "kl" and 0 < abs(value) < 1e-4:
        return format(value, ".1e")  # HF against kvflow's fp32: rounding, not zero
    return format(value, ".6f" if spec == "kl" else spec)


def rows(systems: list[dict[str, Any]], peers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per system: name, perplexities, KL, top-1, tokens, note."""
    out = []
    for s in systems:
        full, llm = s["full_vocabulary"], s["prompt_logprobs"] or {}
        out.append({"name": s["name"], "ppl_prompt_logprobs": llm.get("perplexity"),
                    "ppl_full_vocabulary": full["perplexity"], "mean_kl": full.get("mean_kl"),
                    "top1_agreement": full.get("top1_agreement"), "tokens": full["tokens"],
                    "note": s["note"]})
    for p in peers:
        base = "vs llama.cpp F32" if "mean_kl" in p else "llama.cpp's KL base"
        out.append({"name": p["name"], "ppl_prompt_logprobs": None,
                    "ppl_full_vocabulary": p["perplexity"], "mean_kl": p.get("mean_kl"),
                    "top1_agreement": p.get("top1_agreement"), "tokens": p["tokens"],
                    "note": base})
    return out


def write_quality_report(out: Path, args: argparse.Namespace, num_tokens: int,
                         num_windows: int, reference: str, systems: list[dict[str, Any]],
                         peers: list[dict[str, Any]]) -> None:
    """Write the three files into ``out`` and print the table."""
    out.mkdir(parents=True, exist_ok=True)
    options = {k: v for k, v in vars(args).items() if k not in ("func", "command",
                                                                "bench_command")}
    table = rows(systems, peers)
    (out / "report.json").write_text(json.dumps(
        {"options": options, "tokens": num_tokens, "windows": num_windows,
         "reference": reference, "systems": systems, "llama_cpp": peers, "table": table},
        indent=2) + "\n")
    lines = [f"# Quality: perplexity and KL divergence, {num_tokens} tokens of "
             f"`{Path(args.text).name}`", "",
             f"Context {args.context}, stride {args.stride}, {num_windows} windows. "
             f"Reference for KL and top-1: `{reference}`.", "",
             "| system | perplexity (prompt logprobs) | perplexity (full vocabulary) | "
             "mean KL | top-1 agreement | tokens scored | note |",
             "|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['name']} | {_fmt(r['ppl_prompt_logprobs'], '.4f')} | "
                     f"{_fmt(r['ppl_full_vocabulary'], '.4f')} | {_fmt(r['mean_kl'], 'kl')} | "
                     f"{_fmt(r['top1_agreement'], '.4f')} | {r['tokens']} | {r['note']} |")
    lines += ["", METHOD.format(context=args.context, stride=args.stride, reference=reference),
              "", f"Plot: {_plot(out, table)}."]
    write_report(out / "summary.md", lines)


def _plot(out: Path, table: list[dict[str, Any]]) -> str:
    plt = pyplot()
    fig, (ax_ppl, ax_kl) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["name"] for r in table]
    ppl = [r["ppl_prompt_logprobs"] or r["ppl_full_vocabulary"] for r in table]
    ax_ppl.barh(names, ppl, color="tab:blue")
    ax_ppl.set_xlabel("perplexity (lower is better)")
    lo = min(ppl)
    ax_ppl.set_xlim(lo * 0.98, max(ppl) * 1.01)
    kl = [r["mean_kl"] or 0.0 for r in table]
    ax_kl.barh(names, kl, color="tab:orange")
    ax_kl.set_xlabel("mean KL divergence from its fp32 reference")
    for ax in (ax_ppl, ax_kl):
        ax.invert_yaxis()
    return save_figure(fig, out / "quality.png")
