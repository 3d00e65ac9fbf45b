"""The batching modes that ``bench compare`` serves and ``simulate`` simulates: each a preset
of :class:`~kvflow.orchestrator.options.EngineOptions` (policy, chunked prefill), with the
label reports give it.

- ``static``: the ``static`` policy, a batch runs to completion before the next is formed;
- ``continuous``: in-flight batching (``fcfs``), each prompt prefilled whole in one step;
- ``chunked``: in-flight batching with chunked prefill under a token budget per step;
- ``priority``, ``sjf``, ``fair``: the queue policies of that name, with chunked prefill.
"""

from __future__ import annotations

from typing import Any

MODES: dict[str, dict[str, Any]] = {
    "static": {"policy": "static", "enable_chunked_prefill": False},
    "continuous": {"policy": "fcfs", "enable_chunked_prefill": False},
    "chunked": {"policy": "fcfs", "enable_chunked_prefill": True},
    "priority": {"policy": "priority", "enable_chunked_prefill": True},
    "sjf": {"policy": "sjf", "enable_chunked_prefill": True},
    "fair": {"policy": "fair", "enable_chunked_prefill": True},
}
MODE_LABELS = {"static": "static batching", "continuous": "continuous batching",
               "chunked": "continuous + chunked prefill",
               "priority": "priority + chunked prefill",
               "sjf": "shortest job first + chunked prefill",
               "fair": "fair share (VTC) + chunked prefill"}


def mode_scheduler_options(mode: str, max_num_seqs: int, max_model_len: int,
                           chunk_tokens: int, prefix_caching: bool = False) -> dict[str, Any]:
    """The :class:`EngineOptions` options of a batching mode (the served engine's and the
    simulator's alike): whole prompts need a token budget of ``max_model_len``; chunked modes
    get ``chunk_tokens`` per step."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    chunked = MODES[mode]["enable_chunked_prefill"]
    return {**MODES[mode], "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
            "enable_prefix_caching": prefix_caching,
            "max_num_batched_tokens": chunk_tokens if chunked else max_model_len}


def parse_modes(text: str) -> list[str]:
    """``static,chunked`` -> ["static", "chunked"]; each a known mode."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"--modes: unknown mode(s) {unknown}; known: {list(MODES)}")
    return modes
