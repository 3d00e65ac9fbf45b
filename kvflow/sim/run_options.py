"""What ``kvflow simulate``'s flags make of a run, one engine or a cluster alike: the engine
options of a batching mode, each request's priority, and the series a report keeps."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.workloads.modes import mode_scheduler_options
from kvflow.workloads.specs import RequestSpec


def mode_options(mode: str, args: argparse.Namespace,
                 trace_steps: Path | None = None) -> dict[str, Any]:
    """The :class:`~kvflow.orchestrator.options.EngineOptions` fields of ``mode`` under the
    flags (SLO admission and deadlines included), with the step timeline to ``trace_steps``."""
    options = mode_scheduler_options(mode, args.max_num_seqs, args.max_model_len,
                                     args.chunk_tokens, args.prefix_caching)
    options.update(max_queue_delay_ms=getattr(args, "max_queue_delay_ms", None),
                   request_timeout_s=getattr(args, "request_timeout_s", None))
    if getattr(args, "speculative_acceptance", None) is not None or getattr(
            args, "speculative_replay", None) is not None:
        options.update(num_speculative_tokens=args.num_speculative_tokens,
                       speculative_draft_length=args.speculative_draft_length)
    if trace_steps is not None:
        options.update(trace_steps=str(trace_steps),
                       trace_max_steps=getattr(args, "trace_max_steps", 10_000))
    return options


def priorities_for(n: int, num_priorities: int, seed: int) -> list[int]:
    """``n`` priorities drawn uniformly from ``0..num_priorities-1``."""
    if num_priorities < 1:
        raise ValueError(f"--num-priorities must be >= 1, got {num_priorities}")
    return np.random.default_rng([seed, 3]).integers(0, num_priorities, size=n).tolist()


def request_priorities(specs: Sequence[RequestSpec], policy: str,
                       args: argparse.Namespace) -> list[int] | None:
    """Each request's priority under the ``priority`` policy when the workload has none of
    its own: random levels (``--num-priorities``, ``--seed``). None otherwise: each spec's
    own (tenants: light before heavy), else 0."""
    if policy != "priority" or any(s.priority is not None for s in specs):
        return None
    return priorities_for(len(specs), args.num_priorities, args.seed)


def thin(series: list[dict[str, float]], limit: int = 1000) -> list[dict[str, float]]:
    """At most ``limit`` rows of ``series``, evenly spaced, the first and last kept."""
    if len(series) <= limit:
        return series
    idx = np.linspace(0, len(series) - 1, limit).round().astype(int)
    return [series[i] for i in idx]
