"""``kvflow trace summarize``: a step timeline file read back into per-phase totals and the
longest steps. Pure Python."""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from kvflow.observability.chrome_trace import PHASES, REQUEST_PHASES
from kvflow.utils.args import int_arg


def load(path: str | Path) -> dict[str, Any]:
    """A trace file, checked to be a Trace Event JSON object."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Trace Event file (no traceEvents list)")
    return doc


def summarize(path: str | Path, top: int = 10) -> str:
    """Per-phase totals (engine phases, request phases) and the ``top`` longest steps."""
    doc = load(path)
    if doc.get("otherData", {}).get("producer") != "kvflow":
        raise ValueError(f"{path}: not a kvflow step timeline (written by --trace-steps)")
    if top < 0:
        raise ValueError(f"--top must be >= 0, got {top}")
    events = doc["traceEvents"]
    steps = [e for e in events if e.get("cat") == "step"]
    phases: dict[str, float] = defaultdict(float)
    request_time: dict[str, float] = defaultdict(float)
    request_count: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for e in events:
        if e.get("cat") == "phase":
            phases[e["name"]] += e["dur"]
        elif e.get("cat") == "request" and e["ph"] == "X":
            request_time[e["name"]] += e["dur"]
            request_count[e["name"]] += 1
        elif e.get("cat") == "request" and e["name"] == "finished":
            reasons[e["args"]["reason"]] += 1
    for e in steps:
        kinds[e["name"]] += 1
    total = sum(e["dur"] for e in steps)
    other = doc.get("otherData", {})
    lines = [f"{path}: {len(steps)} steps from the {other.get('source', '?')}"
             f" ({other.get('dropped_steps', 0)} older steps dropped from the ring), "
             f"{total / 1e3:.1f} ms inside steps"]
    if steps:
        span = steps[-1]["ts"] + steps[-1]["dur"] - steps[0]["ts"]
        lines[0] += f" over {span / 1e3:.1f} ms"
    lines += ["", "Steps by kind: " + ", ".join(
        f"{k} {kinds[k]}" for k in ("prefill", "mixed", "decode") if kinds[k]),
        f"Tokens: {sum(e['args']['prefill_tokens'] for e in steps)} prefill, "
        f"{sum(e['args']['decode_tokens'] for e in steps)} decode; "
        f"{sum(len(e['args']['preempted']) for e in steps)} preemptions", "",
        "| engine phase | total (ms) | share of step time |", "|---|---:|---:|"]
    for phase in PHASES:
        share = phases[phase] / total if total else 0.0
        lines.append(f"| {phase} | {phases[phase] / 1e3:.1f} | {share:.1%} |")
    lines += ["", "| request phase | slices | total (ms) | mean (ms) |", "|---|---:|---:|---:|"]
    for phase in REQUEST_PHASES:
        n = request_count[phase]
        if n:
            lines.append(f"| {phase} | {n} | {request_time[phase] / 1e3:.1f} | "
                         f"{request_time[phase] / n / 1e3:.2f} |")
    if reasons:
        lines += ["", "Finished: " + ", ".join(f"{r} {n}" for r, n in reasons.most_common())]
    lines += ["", f"The {min(top, len(steps))} longest steps:", "",
              "| step | kind | ms | prefill tokens | decode tokens | seqs | preempted | "
              "KV usage |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for e in sorted(steps, key=lambda e: -e["dur"])[:top]:
        a = e["args"]
        lines.append(f"| {a['step']} | {e['name']} | {e['dur'] / 1e3:.2f} | "
                     f"{a['prefill_tokens']} | {a['decode_tokens']} | {a['seqs']} | "
                     f"{len(a['preempted'])} | {a['kv_usage']:.0%} |")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    """``kvflow trace summarize``'s arguments."""
    p.add_argument("file", help="a --trace-steps file (Chrome Trace Event JSON)")
    p.add_argument("--top", type=int_arg, default=10, help="how many of the longest steps")


def main(args: argparse.Namespace) -> int:
    """``kvflow trace summarize``: print the summary."""
    print(summarize(args.file, args.top))
    return 0
