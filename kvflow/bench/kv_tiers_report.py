"""The KV tiers benchmark's report (``benchmarks/kv_tiers.py``): the multi-turn chat workload
with the tiers off and on, and a returning prefix across a restart, each configuration's peak
RSS beside its speed; written as ``report.json``, ``report.md`` and ``ttft.png``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from kvflow.reports.writers import pyplot, save_figure, write_report

MB = 1 << 20
MEDIA = (("cpu", "host"), ("disk", "disk"))  # a tier's medium, and its column's name


def sessions_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    """One row per configuration of the chat workload (``runs``: name -> the child's figures,
    :func:`~kvflow.bench.kv_tiers_sessions.summarize` plus ``peak_rss_bytes``)."""
    lines = ["| tiers | prefix hit rate | from the pool | from the host tier | from the disk tier "
             "| TTFT p50 s | TTFT p99 s | output tok/s | span s | peak RSS MB | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        load = "-" if "loadavg_1m" not in r else "{:.1f} -> {:.1f}".format(*r["loadavg_1m"])
        by_tier = [f"{r['hit_rate_tiers'][m]:.1%}" if m in r["hit_rate_tiers"] else "-"
                   for m, _ in MEDIA]
        lines.append(f"| {name} | {r['hit_rate']:.1%} | {r['hit_rate_pool']:.1%} | "
                     f"{' | '.join(by_tier)} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | "
                     f"{r['output_tok_s']:.1f} | {r['span_s']:.1f} | "
                     f"{r['peak_rss_bytes'] / MB:.0f} | {load} |")
    return lines


def same_work_line(runs: dict[str, dict[str, Any]]) -> str:
    """Whether every configuration served the same prompt and output tokens (the replies are
    the engine's, so a numerics difference could change the later prompts)."""
    totals = {(r["prompt_tokens"], r["output_tokens"]) for r in runs.values()}
    if len(totals) == 1:
        prompt, output = totals.pop()
        return (f"Every configuration served the same {prompt:,} prompt tokens and {output:,} "
                "output tokens.")
    return "The configurations served different token counts: " + "; ".join(
        f"{name} {r['prompt_tokens']:,} prompt, {r['output_tokens']:,} output"
        for name, r in runs.items()) + "."


def restart_ratio(rounds: list[dict[str, Any]]) -> float:
    """The median over rounds of restored TTFT / cold TTFT."""
    return statistics.median(r["restored"]["ttft_s"] / r["cold"]["ttft_s"] for r in rounds)


def restart_table(rounds: list[dict[str, Any]]) -> list[str]:
    """One row per round of the restart part: cold and restored TTFT, the tokens the restored
    engine took from the disk tier, the ratio, and each process's peak RSS."""
    lines = ["| round | prompt tokens | cold TTFT s | restored TTFT s | tokens from the disk tier "
             "| restored / cold | cold peak RSS MB | restored peak RSS MB |",
             "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rounds):
        cold, restored = r["cold"], r["restored"]
        lines.append(f"| {i} | {r['prompt_tokens']} | {cold['ttft_s']:.3f} | "
                     f"{restored['ttft_s']:.3f} | {restored['cached_tokens']} | "
                     f"{restored['ttft_s'] / cold['ttft_s']:.3f} | "
                     f"{cold['peak_rss_bytes'] / MB:.0f} | {restored['peak_rss_bytes'] / MB:.0f} |")
    return lines


def plot_ttft(runs: dict[str, dict[str, Any]], path: Path) -> str:
    """Two panels: each configuration's TTFT distribution (CDF over every turn) and its median
    TTFT per turn number."""
    plt = pyplot()
    fig, (cdf, per_turn) = plt.subplots(1, 2, figsize=(10, 4))
    for name, r in runs.items():
        ttfts = sorted(t[5] for t in r["turns_detail"])
        cdf.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=name)
        turns = sorted(r["ttft_by_turn_s"], key=int)
        per_turn.plot([int(t) for t in turns], [r["ttft_by_turn_s"][t] for t in turns],
                      marker="o", label=name)
    cdf.set(xlabel="TTFT s", ylabel="fraction of turns", title="TTFT distribution")
    per_turn.set(xlabel="turn", ylabel="median TTFT s", title="TTFT by turn (prompt grows)")
    per_turn.xaxis.get_major_locator().set_params(integer=True)
    for ax in (cdf, per_turn):
        ax.grid(alpha=0.3)
        ax.legend(title="tiers")
    return save_figure(fig, path)


def report_lines(report: dict[str, Any], plot_name: str | None) -> list[str]:
    """``report.md``: the machine, the workload, the two tables and the command."""
    cfg, machine = report["config"], report["machine"]
    lines = ["# KV tiers: a multi-turn chat over a small pool, and a prefix across a restart", "",
             f"Engine `{cfg['engine']}` (ONNX Runtime, KV dtype {cfg['kv_cache_dtype']}); CPU "
             f"{machine.get('model_name')} ({machine['widest']}, kvflow's native kernels: "
             f"{machine['native_isa']}), {machine['cpus']} cores. {report['busy_note']}", ""]
    runs = report.get("sessions") or {}
    if runs:
        lines += [
            "## Multi-turn chat, working set "
            f"{cfg['working_set_tokens'] / cfg['pool_tokens']:.1f}x the KV pool", "",
            f"{cfg['sessions']} sessions x {cfg['turns']} turns; a {cfg['system_tokens']}-token "
            "system prompt shared by all, each turn a new user message and a reply (lengths: "
            f"the Azure conversation trace's, x{cfg['length_scale']}, messages at most "
            f"{cfg['max_message_tokens']} tokens, replies at most {cfg['max_reply_tokens']}, "
            "greedy, EOS ignored). Each turn re-sends the whole conversation with the replies "
            f"the engine gave. KV pool {cfg['num_kv_blocks']} blocks ({cfg['pool_tokens']:,} "
            f"tokens); working set {cfg['working_set_tokens']:,} distinct prefix tokens; the "
            f"longest prompt {cfg['max_prompt_tokens']:,} tokens. {cfg['concurrency']} users in "
            "a closed loop take turns round-robin, so every session returns after all the "
            "others have sent a turn. TTFT is the engine's, from a turn's arrival. Each "
            "configuration ran in its own process (its own peak RSS, sampled every 0.2 s).", "",
            *sessions_table(runs), "", same_work_line(runs),
            "Hit rate: cached prompt tokens / prompt tokens; per tier: the blocks the tier "
            "restored x the block size, the pool's the rest. Load avg: the machine's 1-minute "
            "load average at the run's start and end (2 cores).", "",
            "Tiers: " + "; ".join(f"`{k}`: {v}" for k, v in cfg["tier_options"].items()) + ".",
            ""]
        if plot_name:
            lines += [f"![TTFT, tiers off and on]({plot_name})", ""]
    restart = report.get("restart")
    if restart:
        lines += [f"## A returning {restart['prefix_tokens']:,}-token prefix after a restart", "",
                  "A first process computes the prefix and shuts down, writing its blocks to the "
                  "disk tier; then, each round, a fresh process (a restarted server) serves the "
                  "prefix plus a question: cold (no tiers) and restored (the same "
                  "`kv_disk_dir`), one warm-up request each, one output token.", "",
                  *restart_table(restart["rounds"]), "",
                  f"Median restored / cold: {restart_ratio(restart['rounds']):.3f} "
                  "(target <= 0.2).", ""]
    lines += [f"Reproduce: `{report['command']}`."]
    return lines


def write_kv_tiers_report(out_dir: str | Path, report: dict[str, Any]) -> list[str]:
    """Write ``report.json``, ``ttft.png`` (when there is a chat workload) and ``report.md`` in
    ``out_dir``; returns the markdown's lines."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    runs = report.get("sessions") or {}
    plot_name = plot_ttft(runs, out / "ttft.png") if runs else None
    lines = report_lines(report, plot_name)
    write_report(out / "report.md", lines)
    return lines
