"""A workload's unit: one request's arrival time, prompt and output lengths, and whom it is
accounted to."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: when it is sent and how long its prompt and output are.

    ``prefix_group`` names the shared prefix a request starts with (None: no shared prefix);
    requests with the same group share their first tokens. ``tenant`` names whom it is
    accounted to (the ``fair`` policy's unit) and ``priority`` its priority (lower first), or
    None for the defaults.
    """

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: int | None = None
    tenant: str | None = None
    priority: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"arrival_s must be finite and >= 0, got {self.arrival_s}")
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens}")
        if self.prefix_group is not None and self.prefix_group < 0:
            raise ValueError(f"prefix_group must be None or >= 0, got {self.prefix_group}")
