"""The Azure LLM inference trace (``TIMESTAMP,ContextTokens,GeneratedTokens``): where the team
keeps it, and its rows as requests."""

from __future__ import annotations

import csv
import math
from datetime import datetime
from pathlib import Path

import numpy as np

from kvflow.workloads.data import shared_data_file
from kvflow.workloads.specs import RequestSpec


def default_trace() -> Path:
    """The Azure conversation trace, among the shared data files."""
    return shared_data_file("AzureLLMInferenceTrace_conv.csv")


DEFAULT_TRACE = default_trace()


def _parse_timestamp(text: str) -> tuple[datetime, float]:
    """Split ``2023-11-16 18:15:46.6805900`` into (whole seconds, fraction of a second).

    ``datetime`` takes at most 6 fractional digits and the trace has 7, so the fraction is
    parsed separately, as a float.
    """
    text = text.strip()
    whole, _, frac = text.partition(".")
    try:
        dt = datetime.strptime(whole.replace("T", " "), "%Y-%m-%d %H:%M:%S")
        return dt, float("0." + frac) if frac else 0.0
    except ValueError as e:
        raise ValueError(f"TIMESTAMP {text!r} is not 'YYYY-MM-DD HH:MM:SS[.fffffff]'") from e


def load_azure_trace(
    path: str | Path,
    limit: int | None = None,
    time_scale: float = 1.0,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
    length_scale: float = 1.0,
) -> tuple[list[RequestSpec], dict]:
    """Read the Azure LLM inference trace (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Returns the requests (sorted by arrival, times relative to the earliest of the rows read,
    divided by ``time_scale``: 2.0 replays twice as fast) and a report of how the lengths
    were changed: ``prompt_clipped``/``output_clipped`` count rows cut to ``max_*_tokens``,
    ``prompt_raised``/``output_raised`` count lengths raised to the minimum of 1 token, and the
    ``*_mean_original``/``*_mean`` pairs give the mean before and after. ``length_scale``
    multiplies every prompt and output length first (rounded, at least 1 token), keeping the
    shape of the length distribution while shrinking it to what a small machine can serve;
    clipping applies after it. ``limit`` keeps the first ``limit`` rows of the file.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be None or >= 1, got {limit}")
    if not time_scale > 0 or math.isinf(time_scale):
        raise ValueError(f"time_scale must be finite and > 0, got {time_scale}")
    if not length_scale > 0 or math.isinf(length_scale):
        raise ValueError(f"length_scale must be finite and > 0, got {length_scale}")
    for name, value in (("max_prompt_tokens", max_prompt_tokens),
                        ("max_output_tokens", max_output_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be None or >= 1, got {value}")

    stamps: list[tuple[datetime, float]] = []
    prompts: list[int] = []
    outputs: list[int] = []
    # utf-8-sig: tolerate a BOM in front of the header.
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)}")
        for row in reader:
            if limit is not None and len(stamps) >= limit:
                break
            stamps.append(_parse_timestamp(row["TIMESTAMP"]))
            prompts.append(int(row["ContextTokens"]))
            outputs.append(int(row["GeneratedTokens"]))
    if not stamps:
        raise ValueError(f"{path}: no rows")

    t0_dt, t0_frac = min(stamps)
    # Whole seconds and fractions subtracted apart: absolute epoch floats would lose the 7th digit.
    arrivals = [((dt - t0_dt).total_seconds() + (fr - t0_frac)) / time_scale for dt, fr in stamps]

    p_orig = np.asarray(prompts, dtype=np.int64)
    o_orig = np.asarray(outputs, dtype=np.int64)
    p_scaled = np.rint(p_orig * length_scale).astype(np.int64)
    o_scaled = np.rint(o_orig * length_scale).astype(np.int64)
    p = np.maximum(p_scaled, 1)
    o = np.maximum(o_scaled, 1)
    if max_prompt_tokens is not None:
        p = np.minimum(p, max_prompt_tokens)
    if max_output_tokens is not None:
        o = np.minimum(o, max_output_tokens)

    order = sorted(range(len(arrivals)), key=arrivals.__getitem__)  # stable: ties keep file order
    specs = [RequestSpec(max(arrivals[i], 0.0), int(p[i]), int(o[i])) for i in order]
    report = {
        "rows": len(specs),
        "time_scale": time_scale,
        "length_scale": length_scale,
        "span_s": specs[-1].arrival_s - specs[0].arrival_s,
        "max_prompt_tokens": max_prompt_tokens,
        "max_output_tokens": max_output_tokens,
        "prompt_clipped": int(np.count_nonzero(p_scaled > p)),
        "output_clipped": int(np.count_nonzero(o_scaled > o)),
        "prompt_raised": int(np.count_nonzero(p_scaled < p)),
        "output_raised": int(np.count_nonzero(o_scaled < o)),
        "prompt_mean_original": float(p_orig.mean()),
        "prompt_mean": float(p.mean()),
        "output_mean_original": float(o_orig.mean()),
        "output_mean": float(o.mean()),
    }
    return specs, report
