"""Speculative decoding in simulated time: a proposer whose drafts are accepted at a given
rate, or as often as in a served run. Pure Python.

The simulated model always samples :data:`~kvflow.sim.runner.SIM_TOKEN`, so a draft is
accepted exactly when it is that token. :class:`AcceptanceProposer` drafts it with the
configured probability at each position (a geometric acceptance length, the usual model), or
replays the acceptance lengths a served run recorded (``--speculative-replay``: the step
timeline's decode slices). Everything else (the scheduler's drafts, verification, the
draft-length cost model, KV allocation and rollback) is the engine's own code.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvflow.orchestrator.request import Request
from kvflow.orchestrator.speculative.proposers import Proposer
from kvflow.sim.runner import SIM_TOKEN

REJECTED_TOKEN = SIM_TOKEN + 1


class AcceptanceProposer(Proposer):
    """Drafts that verification accepts position by position with probability
    ``acceptance`` (until the first rejection), or, with ``replay``, whose accepted count
    follows recorded acceptance lengths (tokens emitted per verification), in order and
    cycling: a verification that emitted ``L`` tokens accepted ``L - 1`` drafts."""

    name = "simulated"

    def __init__(self, acceptance: float = 0.7, replay: Sequence[int] = (), seed: int = 0) -> None:
        if not 0 <= acceptance <= 1:
            raise ValueError(f"speculative acceptance must be in [0, 1], got {acceptance}")
        if any(n < 1 for n in replay):
            raise ValueError("replayed acceptance lengths must be >= 1")
        self.acceptance = acceptance
        self.replay = list(replay)
        self._next = 0
        self._rng = np.random.default_rng([seed, 33])

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int],
                token_budget: int | None = None) -> list[list[int]]:
        return [self._draft(k) for k in max_tokens]

    def _draft(self, k: int) -> list[int]:
        if self.replay:
            accepted = self.replay[self._next % len(self.replay)] - 1
            self._next += 1
        else:  # geometric: each position accepted with the rate, until the first rejection
            draws = self._rng.random(k) < self.acceptance
            accepted = k if draws.all() else int(np.argmin(draws))
        return [SIM_TOKEN if j < accepted else REJECTED_TOKEN for j in range(k)]


def acceptance_lengths_of(trace_path: str | Path) -> list[int]:
    """The acceptance lengths a served run recorded in its step timeline (Chrome trace JSON,
    ``--trace-steps``): per decode slice of a request, its tokens over its verifications'
    count, spread back into one length per verification (the slices sum several steps)."""
    events = json.loads(Path(trace_path).read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    lengths: list[int] = []
    for e in events:
        args = e.get("args") or {}
        if e.get("name") != "decode" or e.get("cat") != "request" or not args.get("drafts"):
            continue
        # A slice covers several steps: `tokens` emitted, `accepted` of `drafts` drafts. Its
        # verifications are unknown apart; each step verified at most one: spread evenly.
        steps = max(int(args["tokens"]) - int(args["accepted"]), 1)
        per = (int(args["accepted"]) + steps) / steps
        lengths += [max(1, round(per))] * steps
    if not lengths:
        raise ValueError(f"{trace_path}: no decode slice with drafts (was the run speculating, "
                         "with --trace-steps?)")
    return lengths
