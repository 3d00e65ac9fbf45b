"""report.md and model_families.png of benchmarks/model_families.py, from its report.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model_sizes_report import _get, _num, _ratio

KIB = 1024


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The markdown report: machine, the speed table, the KV table, the failures."""
    mach = report.get("machine", {})
    fams = report.get("families", {})
    lines = ["# kvflow and llama.cpp on the model families (benchmarks/model_families.py)", "",
             f"kvflow native ISA: {mach.get('native_isa')}; CPU flags: "
             f"{', '.join(mach.get('cpu_flags', []))}; llama.cpp: {mach.get('llama_cpp')}.", "",
             "Random weights of each family's real shape (transformers' initialisation), GGUF "
             "by llama.cpp's convert_hf_to_gguf.py, Q4_1 by llama-quantize (embedding and "
             "output Q8_0); kvflow's engine built from that GGUF. 2 threads each, best of the "
             "rounds. Decode: 32-token prompt, 128 tokens; prefill: 1,024 tokens.", "",
             "| family | shape | params | kvflow decode tok/s | llama.cpp decode tok/s | ratio "
             "| kvflow prefill s | llama.cpp prefill s | time ratio | build peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in fams.items():
        kd, ld = _get(m, "decode", "tok_s"), _get(m, "llamacpp", "decode_tok_s")
        kp, lp = _get(m, "prefill", "s"), _get(m, "llamacpp", "prefill_s")
        params = _get(m, "checkpoint", "params")
        peak = _get(m, "build", "q4_1_gguf", "peak_rss_bytes")
        lines.append(f"| {name} | {m.get('what', '')} | "
                     f"{_num(params / 1e9 if params else None, '{:.2f}')}B | {_num(kd)} | "
                     f"{_num(ld)} | {_ratio(kd, ld)} | {_num(kp, '{:.2f}')} | "
                     f"{_num(lp, '{:.2f}')} | {_ratio(kp, lp)} | "
                     f"{_num(peak / 2**30 if peak else None, '{:.2f}')} |")
    lines += ["", "KV bytes per token of context (f16 K and V), full attention against the "
              "family's windows: what attention needs (each layer keeps min(context, window) "
              "tokens) and what kvflow's KV manager holds after a chunked prefill of that "
              "context.", "",
              "| family | windows | context | full KiB/token | needed KiB/token | "
              "kvflow holds KiB/token |", "|---|---|---|---|---|---|"]
    for name, m in fams.items():
        kv = m.get("kv") or {}
        for ctx, r in (kv.get("contexts") or {}).items():
            lines.append(f"| {name} | {kv.get('layer_windows')} | {ctx} | "
                         f"{_num(r['full_bytes_per_token'] / KIB)} | "
                         f"{_num(r['needed_bytes_per_token'] / KIB)} | "
                         f"{_num(r['held_bytes_per_token'] / KIB)} |")
    errors = []
    for name, m in fams.items():
        for stage in ("checkpoint", "kv", "load", "llamacpp"):
            err = _get(m, stage, "error")
            if err:
                errors.append(f"- {name} {stage}: {str(err).strip().splitlines()[-1][:300]}")
        b = _get(m, "build", "q4_1_gguf") or {}
        if b.get("error"):
            errors.append(f"- {name} build: {b['error']}: "
                          f"`{' '.join(str(b.get('tail', '')).split()[-40:])[:300]}`")
        if m.get("kvflow_run_error"):
            errors.append(f"- {name} kvflow run: {m['kvflow_run_error'].splitlines()[-1]}")
    if errors:
        lines += ["", "Failures:", *errors]
    lines += ["", "Measured: " + "; ".join(
        f"{n} {next(iter((m.get('measured') or {'-': {}}).values())).get('utc', '-')}"
        for n, m in fams.items())]
    return lines


def plot(report: dict[str, Any], path: Path) -> str | None:
    """Decode and prefill against llama.cpp, and KV bytes per token at 32k, per family."""
    from kvflow.reports.writers import pyplot, save_figure

    fams = report.get("families", {})
    if not fams:
        return None
    plt = pyplot()
    fig, (speed, kv) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = list(fams)
    xs = range(len(names))
    for i, (label, keys) in enumerate((("kvflow decode", ("decode", "tok_s")),
                                       ("llama.cpp decode", ("llamacpp", "decode_tok_s")))):
        vals = [_get(fams[n], *keys) or 0 for n in names]
        speed.bar([x + 0.4 * i for x in xs], vals, width=0.4, label=label)
    speed.set_xticks([x + 0.2 for x in xs], names)
    speed.set_ylabel("decode tok/s (2 threads)")
    speed.legend(fontsize=8)
    speed.grid(alpha=0.3, axis="y")
    for i, key in enumerate(("full_bytes_per_token", "needed_bytes_per_token",
                             "held_bytes_per_token")):
        vals = [(_get(fams[n], "kv", "contexts", "32768", key) or 0) / KIB for n in names]
        kv.bar([x + 0.27 * i for x in xs], vals, width=0.27, label=key.split("_")[0])
    kv.set_xticks([x + 0.27 for x in xs], names)
    kv.set_ylabel("KiB per token at 32k context")
    kv.legend(fontsize=8)
    kv.grid(alpha=0.3, axis="y")
    return save_figure(fig, path)


def write_outputs(report: dict[str, Any], out: Path) -> None:
    """report.md and model_families.png in ``out``."""
    from kvflow.reports.writers import write_report

    png = plot(report, out / "model_families.png")
    lines = summary_lines(report)
    if png:
        lines += ["", f"![decode speed and KV per token by family]({Path(png).name})"]
    write_report(out / "report.md", lines)
