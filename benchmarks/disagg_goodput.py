"""Colocated (chunked prefill) against disaggregated prefill/decode at equal GPU count:
DistServe's goodput per GPU, from `kvflow simulate --goodput` runs.

    .venv/bin/python benchmarks/disagg_goodput.py            # ~20 min on this machine
    .venv/bin/python benchmarks/disagg_goodput.py --quick    # one length, for a smoke run

Each point is one `kvflow simulate` command (printed, and kept in the JSON) whose
`goodput.json` is read back: the highest rate at which 90% of the requests meet both the
TTFT and the TPOT SLO, over the GPUs. Disaggregated configurations try every P:D split of
the GPUs and keep the best, as DistServe's placement search does. Writes
`reports/disagg/study.json` and the plots `docs/img/sim_disagg_goodput.png` and
`docs/img/sim_disagg_link.png`.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from kvflow.cli import make_parser
from kvflow.reports.writers import pyplot, save_figure

OUT = Path("reports/disagg")
IMG = Path("docs/img")
# model: tp, GPUs, the P:D splits of them, SLOs (TTFT ms; TPOT ms tight and loose: tight is
# about 1.5x a lone request's decode step, loose about 5x), and a start rate per GPU.
SETUPS = {
    "llama-3-8b": {"tp": 1, "gpus": 2, "splits": ["1:1"], "ttft_ms": 1000,
                   "tpot_ms": {"tight": 16, "loose": 50}, "start": 8.0},
    "llama-3-70b": {"tp": 4, "gpus": 8, "splits": ["1:1"], "ttft_ms": 1500,
                    "tpot_ms": {"tight": 26}, "start": 0.5},
}
PROMPT_LENS = (256, 1024, 4096)
OUTPUT_LEN = 128
# NOTE: enough requests that a burst the cluster absorbs whole does not pass for goodput
# (300 did: 256-token prompts "sustained" any rate, the whole run fitting in one batch).
NUM_PROMPTS = 1000
LINK_GBPS = (10, 25, 100, 3600)  # 3600: NVLink 4 (450 GB/s); IB NDR and PCIe5: 400


def goodput(model: str, prompt_len: int, ttft_ms: float, tpot_ms: float, shape: list[str],
            name: str, start: float) -> dict:
    """One `kvflow simulate --goodput` run; its goodput.json, and the command."""
    setup = SETUPS[model]
    out = OUT / name
    argv = ["simulate", "--hardware", "H100", "--model", model, "--tp", str(setup["tp"]),
            "--workload", "random", "--input-len", str(prompt_len), "--output-len",
            str(OUTPUT_LEN), "--range-ratio", "0.25", "--num-prompts", str(NUM_PROMPTS),
            "--policy", "chunked", *shape, "--goodput", "--goodput-iterations", "4",
            "--request-rate", f"{start:.3g}",
            "--slo", f"ttft_ms={ttft_ms:g},tpot_ms={tpot_ms:g}", "--out", str(out),
            "--no-progress"]
    args = make_parser().parse_args(argv)
    args.func(args)
    result = json.loads((out / "goodput.json").read_text())
    result["command"] = "kvflow " + shlex.join(argv)
    print(f"{name}: {result['goodput_per_gpu']} req/s per GPU", flush=True)
    return result


def study(quick: bool) -> dict:
    lengths = (1024,) if quick else PROMPT_LENS
    rows = []
    for model, setup in SETUPS.items():
        for slo, tpot in setup["tpot_ms"].items():
            for length in lengths:
                tag = f"{model}_{slo}_{length}"
                # Rates scale about as 1/prompt length: start near the answer.
                start = setup["start"] * setup["gpus"] * 1024 / (length + 256)
                colo = goodput(model, length, setup["ttft_ms"], tpot,
                               ["--replicas", str(setup["gpus"] // setup["tp"])],
                               f"{tag}_colocated", start)
                splits = {s: goodput(model, length, setup["ttft_ms"], tpot,
                                     ["--disaggregate", s, "--link", "nvlink"],
                                     f"{tag}_pd{s.replace(':', '-')}", start)
                          for s in setup["splits"]}
                best = max(splits, key=lambda s: splits[s]["goodput_per_gpu"] or 0.0)
                rows.append({"model": model, "slo": slo, "prompt_len": length,
                             "ttft_ms": setup["ttft_ms"], "tpot_ms": tpot,
                             "colocated": colo["goodput_per_gpu"],
                             "disaggregated": splits[best]["goodput_per_gpu"],
                             "best_split": best,
                             "splits": {s: r["goodput_per_gpu"] for s, r in splits.items()},
                             "commands": [colo["command"], splits[best]["command"]]})
    links = []
    model, length = "llama-3-8b", 1024
    setup = SETUPS[model]
    for gbps in (25, 3600) if quick else LINK_GBPS:
        r = goodput(model, length, setup["ttft_ms"], setup["tpot_ms"]["loose"],
                    ["--disaggregate", "1:1", "--link-gbps", str(gbps)], f"link_{gbps}",
                    setup["start"] * setup["gpus"] * 1024 / (length + 256))
        links.append({"gbps": gbps, "disaggregated": r["goodput_per_gpu"],
                      "command": r["command"]})
    colo = next((r["colocated"] for r in rows if r["model"] == model and r["slo"] == "loose"
                 and r["prompt_len"] == length), None)
    return {"rows": rows, "links": links, "links_colocated": colo,
            "output_len": OUTPUT_LEN, "num_prompts": NUM_PROMPTS}


def plot(result: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    for ax, model in zip(axes, SETUPS, strict=True):
        disagg: dict[str, list] = {}
        for slo, style in (("tight", "-"), ("loose", "--")):
            rows = [r for r in result["rows"] if r["model"] == model and r["slo"] == slo]
            if not rows:
                continue
            lens = [r["prompt_len"] for r in rows]
            tpot = rows[0]["tpot_ms"]
            values = [r["disaggregated"] or 0 for r in rows]
            ax.plot(lens, [r["colocated"] or 0 for r in rows], style, marker="o",
                    color="tab:blue", label=f"colocated, TPOT <= {tpot} ms")
            same = any(v == values for v in disagg.values())
            label = (f"disaggregated {rows[0]['best_split']}, TPOT <= {tpot} ms"
                     + (" (the same: capacity-bound)" if same else ""))
            ax.plot(lens, values, style, marker="s", color="tab:red", label=label,
                    markerfacecolor="none" if same else "tab:red", markersize=9 if same else 6)
            disagg[slo] = values
        setup = SETUPS[model]
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("mean prompt length (tokens), outputs 128")
        ax.set_ylabel("goodput per GPU (req/s)")
        ax.set_title(f"{model}, tp={setup['tp']}, {setup['gpus']} H100s, "
                     f"TTFT <= {setup['ttft_ms']} ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, IMG / "sim_disagg_goodput.png")

    fig, ax = plt.subplots(figsize=(6.5, 4))
    links = result["links"]
    ax.plot([r["gbps"] for r in links], [r["disaggregated"] or 0 for r in links], marker="s",
            color="tab:red", label="disaggregated 1:1")
    if result["links_colocated"] is not None:
        ax.axhline(result["links_colocated"], color="tab:blue", label="colocated, 2 replicas")
    for gbps, name in ((25, "25GbE"), (400, "IB NDR, PCIe5"), (3600, "NVLink 4")):
        ax.axvline(gbps, color="grey", linewidth=0.6, linestyle=":")
        ax.text(gbps, 0.02, name, rotation=90, fontsize=7, transform=ax.get_xaxis_transform())
    ax.set_xscale("log")
    ax.set_xlabel("KV link bandwidth per GPU (Gb/s)")
    ax.set_ylabel("goodput per GPU (req/s)")
    ax.set_title("llama-3-8b, 1024-token prompts, TPOT <= 50 ms")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, IMG / "sim_disagg_link.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--replot", action="store_true",
                        help="no runs: redraw the plots from reports/disagg/study.json")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.replot:
        result = json.loads((OUT / "study.json").read_text())
    else:
        result = study(args.quick)
        (OUT / "study.json").write_text(json.dumps(result, indent=1))
    plot(result)
    for r in result["rows"]:
        print(f"| {r['model']} | {r['slo']} (TPOT <= {r['tpot_ms']} ms) | {r['prompt_len']} | "
              f"{r['colocated']} | {r['disaggregated']} ({r['best_split']}) |")


if __name__ == "__main__":
    main()
