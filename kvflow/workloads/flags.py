"""The workload options ``bench serve``, ``bench compare`` and ``simulate`` share, and the
workload they name."""

from __future__ import annotations

import argparse
from typing import Any

from kvflow.workloads.arrivals import retime
from kvflow.workloads.azure import DEFAULT_TRACE, load_azure_trace
from kvflow.workloads.specs import RequestSpec
from kvflow.workloads.synthetic import random_workload, shared_prefix_workload, tenants_workload


def add_workload_args(p: argparse.ArgumentParser,
                      extra_workloads: dict[str, str] | None = None) -> None:
    """The workload options ``bench serve``, ``bench compare`` and ``simulate`` share;
    ``extra_workloads`` (name -> help) adds workloads of the caller's own."""
    extra = extra_workloads or {}
    p.add_argument("--engine", default="engines/smollm2-135m",
                   help="engine folder whose tokenizer cuts prompts to exact lengths")
    p.add_argument("--workload", choices=["random", "trace", "prefix", "tenants", *extra],
                   default="random",
                   help="; ".join(["tenants: one heavy tenant (long prompts, a high rate) and "
                                   "several light ones (short chats), on the trace's lengths",
                                   *(f"{k}: {v}" for k, v in extra.items())]))
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Azure LLM trace CSV")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="trace: arrival times divided by this (2 = twice as fast)")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="trace: prompt and output lengths multiplied by this before clipping")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=512, help="prefix workload: shared tokens")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="trace: prompts clipped to 3/4 of this and outputs to 1/4, so every "
                        "request fits (the report says how many were clipped)")
    p.add_argument("--num-light-tenants", type=int, default=4,
                   help="tenants workload: light tenants")
    p.add_argument("--heavy-share", type=float, default=0.5,
                   help="tenants workload: the heavy tenant's share of the requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", default=None, help="e.g. ttft_ms=2000,tpot_ms=200")
    p.add_argument("--no-progress", action="store_true")


def parse_rate(text: str | None) -> float:
    """``--request-rate``: a number of requests/s > 0, or inf (the default, for None)."""
    try:
        rate = float("inf" if text is None else text)
    except ValueError:
        raise ValueError(f"--request-rate must be a number or inf, got {text!r}") from None
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {text!r}")
    return rate


def parse_rates(text: str) -> list[float]:
    """``0.5,1,inf`` -> [0.5, 1.0, inf], sorted ascending; each rate > 0."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--rates: {part!r} is not a number or inf") from None
        if not rate > 0:
            raise ValueError(f"--rates: each rate must be > 0, got {part!r}")
        rates.append(rate)
    if not rates:
        raise ValueError("--rates: give at least one rate")
    return sorted(set(rates))




def build_workload(args: argparse.Namespace) -> tuple[list[RequestSpec], dict[str, Any]]:
    """The workload the options name: its requests, and how a report describes it."""
    rate = parse_rate(args.request_rate)
    info: dict[str, Any] = {"workload": args.workload, "request_rate": rate, "seed": args.seed}
    if args.workload == "tenants":
        if args.request_rate is None:
            raise ValueError("--request-rate is required for the tenants workload")
        budget = args.max_model_len
        max_prompt = budget * 3 // 4
        lengths, clip = load_azure_trace(args.trace, max_prompt_tokens=max_prompt,
                                         max_output_tokens=budget - max_prompt,
                                         length_scale=args.length_scale)
        specs = tenants_workload(lengths, args.num_prompts, rate, args.seed,
                                 args.num_light_tenants, args.heavy_share)
        info.update(trace=str(args.trace), length_scale=args.length_scale,
                    num_light_tenants=args.num_light_tenants, heavy_share=args.heavy_share,
                    note=f"lengths from the whole trace, multiplied by {args.length_scale:g}, "
                         f"prompts clipped to {max_prompt} and outputs to "
                         f"{budget - max_prompt} tokens; the heavy tenant's prompts from its "
                         "longest quarter, the light tenants' from its shortest half")
    elif args.workload == "trace":
        budget = args.max_model_len
        max_prompt = budget * 3 // 4
        specs, clip = load_azure_trace(args.trace, limit=args.num_prompts,
                                       time_scale=args.time_scale,
                                       max_prompt_tokens=max_prompt,
                                       max_output_tokens=budget - max_prompt,
                                       length_scale=args.length_scale)
        if args.request_rate is not None:
            specs = retime(specs, rate)
        info.update(trace=str(args.trace), time_scale=args.time_scale, clipping=clip,
                    length_scale=args.length_scale,
                    note=f"the first {len(specs)} rows; lengths multiplied by "
                         f"{args.length_scale:g}, then prompts clipped to {max_prompt} and "
                         f"outputs to {budget - max_prompt} tokens so that every request fits "
                         f"max_model_len {budget} ({clip['prompt_clipped']} prompts and "
                         f"{clip['output_clipped']} outputs clipped)")
        if args.request_rate is None:
            info["request_rate"] = (len(specs) - 1) / max(specs[-1].arrival_s, 1e-9)
    elif args.workload == "prefix":
        specs = shared_prefix_workload(args.num_prompts, args.prefix_len, 16, args.output_len,
                                       rate, args.seed)
        info.update(prefix_len=args.prefix_len)
    else:
        specs = random_workload(args.num_prompts, args.input_len, args.output_len, rate,
                                args.burstiness, args.seed, args.range_ratio)
        info.update(input_len=args.input_len, output_len=args.output_len,
                    burstiness=args.burstiness, range_ratio=args.range_ratio)
    return specs, info
