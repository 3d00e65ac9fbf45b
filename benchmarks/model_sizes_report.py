"""report.md and model_sizes.png of benchmarks/model_sizes.py, from its report.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GIB = 2**30


def _get(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _gib(x: Any) -> str:
    return f"{x / GIB:.2f}" if isinstance(x, (int, float)) else "-"


def _num(x: Any, fmt: str = "{:.1f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


def _ratio(a: Any, b: Any) -> str:
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b
    return f"{a / b:.2f}x" if ok else "-"


def _errors(name: str, m: dict[str, Any]) -> list[str]:
    """One line per failed stage: which, and why (the first line of the reason)."""
    out = []
    for stage in ("checkpoint", "load", "llamacpp", "served"):
        err = _get(m, stage, "error")
        if err:
            out.append(f"- {name} {stage}: {str(err).strip().splitlines()[0][:300]}")
    for b, r in (_get(m, "build") or {}).items():
        if isinstance(r, dict) and r.get("error"):
            out.append(f"- {name} build {b}: {r['error']}; log tail: "
                       f"`{' '.join(str(r.get('tail', '')).split()[-40:])[:300]}`")
    for sys_name, r in (_get(m, "served") or {}).items():
        if isinstance(r, dict) and r.get("error"):
            out.append(f"- {name} served {sys_name}: {str(r['error']).splitlines()[0][:300]}")
    if m.get("kvflow_run_error"):
        out.append(f"- {name} kvflow decode/prefill: {m['kvflow_run_error'].splitlines()[0]}")
    return out


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The markdown report: machine, one table of memory, one of speed, the failures."""
    mach = report.get("machine", {})
    lines = ["# kvflow and llama.cpp on 1B-8B shapes (benchmarks/model_sizes.py)", "",
             f"CPU: {mach.get('cpu')}, {mach.get('cpus')} cores, "
             f"{_gib(mach.get('mem_total_bytes'))} GiB; kvflow native ISA: "
             f"{mach.get('native_isa')}; CPU flags: {', '.join(mach.get('cpu_flags', []))}; "
             f"llama.cpp: {mach.get('llama_cpp')}.", "",
             "Random weights (normal x 0.02, norms 1), Q4_1 GGUF by llama-quantize (embedding "
             "and output Q8_0). 2 threads each, best of the rounds. RSS in GiB (process tree, "
             "polled every 50 ms; mapped file pages count while resident).", "",
             "## Memory and build", "",
             "| model | params | Q4_1 GGUF | build from GGUF: s / peak | build from bf16 (int4): "
             "s / peak | load s | peak RSS loading | RSS after load | llama.cpp peak RSS |",
             "|---|---|---|---|---|---|---|---|---|"]
    models = report.get("models", {})
    for name, m in models.items():
        b = m.get("build") or {}

        def bcell(key: str, b: dict[str, Any] = b) -> str:
            r = b.get(key)
            if not r:
                return "-"
            cell = f"{r['wall_s']:.0f} / {_gib(r['peak_rss_bytes'])}"
            return cell + " (**failed**)" if r.get("error") else cell

        lines.append(
            f"| {name} | {_num(_get(m, 'checkpoint', 'params'), '{:,}')} | "
            f"{_gib(_get(m, 'checkpoint', 'q4_1_gguf_bytes'))} | {bcell('q4_1_gguf')} | "
            f"{bcell('hf_bf16_int4')} | {_num(_get(m, 'load', 'load_s'))} | "
            f"{_gib(_get(m, 'load', 'peak_rss_loading_bytes'))} | "
            f"{_gib(_get(m, 'load', 'rss_after_load_bytes'))} | "
            f"{_gib(_get(m, 'llamacpp', 'peak_rss_bytes'))} |")
    lines += ["", "## Speed", "",
              "| model | decode tok/s kvflow | llama.cpp S_TG | ratio | 1,024-token prefill s "
              "kvflow | llama.cpp T_PP | ratio | served c=8 tok/s kvflow | llama-server | "
              "ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in models.items():
        kd, ld = _get(m, "decode", "tok_s"), _get(m, "llamacpp", "decode_tok_s")
        kp, lp = _get(m, "prefill", "s"), _get(m, "llamacpp", "prefill_s")
        ks, ls = _get(m, "served", "kvflow", "tok_s"), _get(m, "served", "llama.cpp", "tok_s")
        lines.append(f"| {name} | {_num(kd)} | {_num(ld)} | {_ratio(kd, ld)} | "
                     f"{_num(kp, '{:.2f}')} | {_num(lp, '{:.2f}')} | {_ratio(kp, lp)} | "
                     f"{_num(ks)} | {_num(ls)} | {_ratio(ks, ls)} |")
    errors = [e for name, m in models.items() for e in _errors(name, m)]
    if errors:
        lines += ["", "## Failures", "", *errors]
    lines += ["", "Measured (stage: UTC, commit):"]
    for name, m in models.items():
        when = m.get("measured", {})
        if isinstance(when, dict) and "utc" not in when:  # per stage
            lines.append(f"- {name}: " + "; ".join(
                f"{stage} {r.get('utc')} {r.get('commit')}" for stage, r in when.items()))
    return lines


def plot(report: dict[str, Any], path: Path) -> str | None:
    """Memory (GiB) and speed (tok/s) against parameters, kvflow and llama.cpp."""
    from kvflow.reports.writers import pyplot, save_figure

    models = sorted(((m["checkpoint"]["params"], m) for m in report.get("models", {}).values()
                     if isinstance(_get(m, "checkpoint", "params"), int)), key=lambda x: x[0])
    if not models:
        return None
    plt = pyplot()
    fig, (mem, speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    series_mem = {"kvflow build peak (GGUF)": ("build", "q4_1_gguf", "peak_rss_bytes"),
                  "kvflow RSS after load": ("load", "rss_after_load_bytes"),
                  "kvflow peak RSS loading": ("load", "peak_rss_loading_bytes"),
                  "llama.cpp peak RSS": ("llamacpp", "peak_rss_bytes")}
    series_speed = {"kvflow decode": ("decode", "tok_s"),
                    "llama.cpp decode (S_TG)": ("llamacpp", "decode_tok_s"),
                    "kvflow served c=8": ("served", "kvflow", "tok_s"),
                    "llama-server c=8": ("served", "llama.cpp", "tok_s")}
    for ax, series, scale in ((mem, series_mem, GIB), (speed, series_speed, 1.0)):
        for label, keys in series.items():
            pts = [(n / 1e9, v / scale) for n, m in models
                   if isinstance(v := _get(m, *keys), (int, float))]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=label)
        if models[-1][0] > 3 * models[0][0]:
            ax.set_xscale("log")
        ax.set_xlabel("parameters (billions)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    mem.set_ylabel("GiB")
    mem.set_title("memory")
    speed.set_ylabel("output tok/s")
    speed.set_title("speed (2 threads)")
    return save_figure(fig, path)


def write_outputs(report: dict[str, Any], out: Path) -> None:
    """report.md and model_sizes.png in ``out``."""
    from kvflow.reports.writers import write_report

    png = plot(report, out / "model_sizes.png")
    lines = summary_lines(report)
    if png:
        lines += ["", f"![memory and speed against model size]({Path(png).name})"]
    write_report(out / "report.md", lines)
