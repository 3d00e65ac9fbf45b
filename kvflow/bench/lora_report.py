"""The multi-LoRA benchmark's report: ``report.json`` (everything), ``report.md`` (also printed)
and ``lora.png`` (throughput, TPOT and TTFT per run), with the issue's targets judged: mixed
adapters keep >= 0.8x the base's output throughput and a median TPOT within 1.25x."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvflow.reports.writers import pyplot, save_figure, write_report

MIN_THROUGHPUT_RATIO = 0.8
MAX_TPOT_RATIO = 1.25
# Figures every run that served must have; a LoRA run also its adapters' counters.
RUN_FIGURES = ("output_tok_s", "ttft_ms.p50", "ttft_ms.p99", "tpot_ms.p50", "tpot_ms.p99",
               "peak_rss_bytes")
LORA_FIGURES = ("lora.swaps", "lora.evictions", "lora.resident")


def _get(run: dict[str, Any], dotted: str) -> Any:
    value: Any = run
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def missing_figures(report: dict[str, Any]) -> list[str]:
    """What the report lacks, ``run: figure`` each: a run that did not start or had failed
    requests, a figure that is None, the base run (unless the served runs were skipped,
    ``rounds`` 0, and the step ran), the machine's ISA. Empty: complete."""
    missing = [] if report.get("machine", {}).get("widest") else ["machine: widest ISA"]
    runs = report.get("runs", [])
    step_only = report.get("config", {}).get("rounds") == 0 and report.get("step")
    if not step_only and not any(r["name"] == "base" for r in runs):
        missing.append("base: no run")
    for r in runs:
        if r.get("error"):
            missing.append(f"{r['name']}: did not run (see Errors)")
            continue
        lost = sum(1 for x in r.get("rounds", []) if x.get("error"))
        if lost:
            missing.append(f"{r['name']}: {lost} of {len(r['rounds'])} rounds did not run")
        if r.get("failed"):
            missing.append(f"{r['name']}: {r['failed']} failed requests")
        for key in RUN_FIGURES + (LORA_FIGURES if r.get("loaded") else ()):
            if _get(r, key) is None:
                missing.append(f"{r['name']}: {key}")
    return missing


# A round's figures kept beside the medians, for the per-round table.
ROUND_FIGURES = ("output_tok_s", "ttft_ms.p50", "ttft_ms.p99", "tpot_ms.p50", "tpot_ms.p99",
                 "lora.swaps", "lora.evictions", "peak_rss_bytes")


def combine_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One result per run from several rounds of all runs (``rounds[i][j]``: run ``j`` in round
    ``i``): the median of each figure over the rounds it served in, requests and failures
    summed, the peak RSS the highest; ``rounds`` keeps each round's figures (a round that did
    not start: its ``error``), which :func:`judge_targets` pairs round by round."""
    out = []
    for j in range(len(rounds[0])):
        results = [r[j] for r in rounds]
        served = [r for r in results if not r.get("error")]
        if not served:
            out.append({**results[0], "rounds": [{"error": r["error"]} for r in results]})
            continue
        run = dict(served[0])
        for key in ("requests", "completed", "failed", "output_tokens"):
            run[key] = sum(r[key] for r in served)
        run["output_tok_s"] = _median([r["output_tok_s"] for r in served])
        run["duration_s"] = _median([r["duration_s"] for r in served])
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            run[key] = {p: _median([r[key][p] for r in served]) for p in ("p50", "p99", "mean")}
        if run.get("lora") is not None:
            run["lora"] = {k: _median([r["lora"][k] for r in served])
                           for k in ("swaps", "evictions", "resident")}
        run["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in served)
        run["errors"] = [e for r in served for e in r["errors"]][:5]
        run["rounds"] = [{"error": r["error"]} if r.get("error") else
                         {k: _get(r, k) for k in ROUND_FIGURES} for r in results]
        out.append(run)
    return out


def _median(values: list[Any]) -> float | None:
    present = sorted(v for v in values if v is not None)
    if not present:
        return None
    mid = len(present) // 2
    return present[mid] if len(present) % 2 else (present[mid - 1] + present[mid]) / 2


def _paired_ratio(run: dict[str, Any], base: dict[str, Any], key: str) -> float | None:
    """The median over rounds of ``run``'s ``key`` over the same round's base (the two served
    minutes apart, so a change in the machine's load cancels), else the plain ratio."""
    pairs = list(zip(run.get("rounds") or [], base.get("rounds") or [], strict=False))
    ratios = [_ratio(a.get(key), b.get(key)) for a, b in pairs]
    if pairs and any(r is not None for r in ratios):
        return _median(ratios)
    return _ratio(_get(run, key), _get(base, key))


def judge_targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each LoRA run against the base run: throughput ratio, TPOT p50 and p99 ratios (medians
    of the rounds' ratios when there are rounds), and for runs mixing several adapters (the
    target's case) whether both targets are met."""
    base = next((r for r in runs if r["name"] == "base" and not r.get("error")), None)
    out = []
    for r in runs:
        if not r.get("loaded") or r.get("error") or base is None:
            continue
        row: dict[str, Any] = {"name": r["name"], "mixed": len(r.get("mix", [])) > 1}
        row["throughput_ratio"] = _paired_ratio(r, base, "output_tok_s")
        for p in ("p50", "p99"):
            row[f"tpot_{p}_ratio"] = _paired_ratio(r, base, f"tpot_ms.{p}")
        if row["mixed"]:
            row["met"] = (row["throughput_ratio"] is not None
                          and row["throughput_ratio"] >= MIN_THROUGHPUT_RATIO
                          and row["tpot_p50_ratio"] is not None
                          and row["tpot_p50_ratio"] <= MAX_TPOT_RATIO)
        out.append(row)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _f(value: Any, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{format(value, spec)}{suffix}"


def _mb(value: int | None, spec: str = ",.0f") -> str:
    return "-" if value is None else f"{format(value / 2**20, spec)} MB"


def write_lora_report(out: str | Path, report: dict[str, Any], echo: bool = True) -> dict[str, Any]:
    """Judge the targets into ``report`` and write the three files into ``out``; returns the
    report (with ``targets`` and ``missing``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = report["runs"]
    report["targets"] = judge_targets(runs)
    report["missing"] = missing_figures(report)
    report["plot"] = _plot(out, runs, report["config"]["concurrency"])
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    write_report(out / "report.md", _markdown(report), echo=echo)
    return report


def _markdown(report: dict[str, Any]) -> list[str]:
    cfg, machine = report["config"], report["machine"]
    ratios = {t["name"]: t["throughput_ratio"] for t in report["targets"]}
    rounds = cfg.get("rounds", 1)
    lines = [
        "# Multi-LoRA serving: the base, one adapter, and mixed adapters", "",
        f"`{cfg['engine']}` served by `kvflow serve` (tritonserver), Triton gRPC streaming, a "
        f"closed loop of {cfg['concurrency']} streams, {cfg['num_prompts']} requests (per run "
        f"and round) of "
        f"{cfg['prompt_tokens']} prompt and {cfg['output_tokens']} output tokens (greedy, "
        "`ignore_eos`), prefix caching off (the same prompts under two adapters never share "
        "KV, so with it on the base would be favoured). Adapters: "
        f"{cfg['adapters']} random nonzero PEFT adapters of rank {cfg['rank']}, alpha "
        f"{cfg['alpha']:g}, on {', '.join(cfg['targets'])} "
        f"({_mb(cfg.get('adapter_bytes'), '.1f')} each on disk), made with "
        "`make_peft_adapter` on the model's HF weights; a mixed run spreads them over the "
        "requests in equal shares, in a seeded random order.", "",
        *([f"{rounds} rounds: each round serves every run once (a fresh server each), the "
           "order rotated from round to round; a figure is the median over the rounds, a "
           "ratio to the base the median of each round's ratio to that round's base (so that "
           "a change in the machine's load between rounds cancels).", ""] if rounds > 1
          else []),
        f"Machine: {machine.get('model_name') or '?'}, {machine.get('cpus')} CPUs, widest ISA "
        f"{machine['widest']}, kvflow's native kernels: {machine.get('native_isa')}. "
        f"{report.get('machine_note', '')}".rstrip(), "",
        "| run | loaded | max_loras | ok / failed | output tok/s | vs base | TTFT p50 / p99 ms "
        "| TPOT p50 / p99 ms | swaps | evictions | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        if r.get("error"):
            lines.append(f"| {r['name']} | {len(r['loaded'])} | {_f(r['max_loras'], 'd')} | "
                         "did not run | - | - | - | - | - | - | - |")
            continue
        lora = r.get("lora") or {}
        ratio = 1.0 if r["name"] == "base" else ratios.get(r["name"])
        lines.append(
            f"| {r['name']} | {len(r['loaded'])} | "
            f"{_f(r['max_loras'], 'd') if r['max_loras'] else '-'} | "
            f"{r['completed']} / {r['failed']} | {_f(r['output_tok_s'])} | "
            f"{_f(ratio, '.2f', 'x')} | {_f(_get(r, 'ttft_ms.p50'), '.0f')} / "
            f"{_f(_get(r, 'ttft_ms.p99'), '.0f')} | {_f(_get(r, 'tpot_ms.p50'), '.1f')} / "
            f"{_f(_get(r, 'tpot_ms.p99'), '.1f')} | {_f(lora.get('swaps'), '.0f')} | "
            f"{_f(lora.get('evictions'), '.0f')} | {_mb(r.get('peak_rss_bytes'))} |")
    lines += ["", "Swaps (adapters written into a slot) and evictions are the server's "
              "`kvflow_lora_swaps_total` and `kvflow_lora_evictions_total` over the load (after "
              "a warm-up of one request per adapter); peak RSS is tritonserver's process tree "
              "(its Python backend stub holds the model), sampled every 0.2 s.", "",
              f"## Targets (mixed adapters: >= {MIN_THROUGHPUT_RATIO}x the base's throughput, "
              f"median TPOT <= {MAX_TPOT_RATIO}x)", ""]
    for t in report["targets"]:
        verdict = ("" if not t["mixed"] else " **met**" if t["met"] else " **not met**")
        lines.append(f"- {t['name']}: throughput {_f(t['throughput_ratio'], '.2f', 'x')}, "
                     f"TPOT p50 {_f(t['tpot_p50_ratio'], '.2f', 'x')}, p99 "
                     f"{_f(t['tpot_p99_ratio'], '.2f', 'x')} of the base's.{verdict}")
    if not report["targets"]:
        lines.append("- not judged: no LoRA run completed beside the base")
    lines += _step_lines(report.get("step"))
    if rounds > 1:
        lines += ["", "Each round's output tok/s and TPOT p50 ms:", "",
                  "| run | " + " | ".join(f"round {i + 1}" for i in range(rounds)) + " |",
                  "|---|" + "---|" * rounds]
        for r in report["runs"]:
            cells = ["did not run" if x.get("error") else
                     f"{_f(x.get('output_tok_s'))}, {_f(x.get('tpot_ms.p50'))}"
                     for x in r.get("rounds", [])]
            lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    errors = [r for r in report["runs"] if r.get("error") or r.get("errors")]
    if errors:
        lines += ["", "## Errors", ""]
        for r in errors:
            first = r.get("error") or "; ".join(f"request {e['index']}: {e['error']}"
                                                for e in r["errors"][:3])
            lines.append(f"- {r['name']}: {first}")
    if report["missing"]:
        lines += ["", "Incomplete: " + "; ".join(report["missing"])]
    lines += ["", f"Command: `{report.get('command', '')}`", "", f"Plot: {report['plot']}."]
    return lines


def _step_lines(step: dict[str, Any] | None) -> list[str]:
    """The runner-alone table (:mod:`kvflow.bench.lora_step`), when it ran."""
    if not step:
        return []
    cases = step["cases"]
    base = cases.get("base graph", {})
    lines = ["", f"## One step on the runner alone ({step['batch']} sequences)", "",
             f"Decode: {step['batch']} sequences at {step['context']} tokens of context; "
             f"prefill: {step['batch']} prompts of {step['prompt']} tokens; "
             f"`quantized_matmul={step['quantized_matmul']}`; the cases interleaved, "
             f"{step['repeats']} repeats of the decode step and "
             f"{max(3, step['repeats'] // 4)} of the prefill; median ms (p10-p90).", "",
             "| case | decode ms | vs base graph | prefill ms | vs base graph |",
             "|---|---|---|---|---|"]
    for name, kinds in cases.items():
        cells = []
        for kind in ("decode", "prefill"):
            k = kinds.get(kind, {})
            cells += [f"{_f(k.get('p50_ms'))} ({_f(k.get('p10_ms'))}-{_f(k.get('p90_ms'))})",
                      _f(_ratio(k.get("p50_ms"), base.get(kind, {}).get("p50_ms")), ".2f",
                         "x")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _plot(out: Path, runs: list[dict[str, Any]], concurrency: int) -> str:
    plt = pyplot()
    served = [r for r in runs if not r.get("error")]
    names = [r["name"] for r in served]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax_tp, ax_tpot, ax_ttft = axes
    ax_tp.barh(names, [r.get("output_tok_s") or 0 for r in served], color="tab:blue")
    ax_tp.set_xlabel("output tok/s (higher is better)")
    for ax, key, label in ((ax_tpot, "tpot_ms", "TPOT ms"), (ax_ttft, "ttft_ms", "TTFT ms")):
        ys = range(len(served))
        ax.barh([y - 0.2 for y in ys], [_get(r, f"{key}.p50") or 0 for r in served], 0.4,
                label="p50", color="tab:green")
        ax.barh([y + 0.2 for y in ys], [_get(r, f"{key}.p99") or 0 for r in served], 0.4,
                label="p99", color="tab:orange")
        ax.set_yticks(list(ys), [""] * len(served))  # the names are on the first plot
        ax.set_xlabel(f"{label} (lower is better)")
        ax.legend(loc="best")
    for ax in axes:
        ax.invert_yaxis()
    fig.suptitle(f"kvflow multi-LoRA, served, {concurrency} concurrent streams")
    return save_figure(fig, out / "lora.png")
