"""One engine's state as a bounded snapshot: what the live console draws, and what
``GET /v1/kvflow/state`` returns to scripts. Pure Python (no runtime): the real engine, the
Triton backend and the simulator all give it an :class:`~kvflow.orchestrator.engine.LLMEngine`.

Read it on the engine's own thread, between steps (the Triton backend uses
:meth:`~kvflow.orchestrator.engine_loop.EngineLoop.call`): it walks the scheduler's queues and
the KV manager's tables, which only that thread changes.

Bounded whatever the load: at most ``max_requests`` requests are listed (running first, then
waiting in queue order), the block grid has at most ``max_cells`` cells (a larger pool is
summarised, ``blocks_per_cell`` blocks a cell, each cell showing its busiest block), and the
last ``max_steps`` steps are listed.

The snapshot (JSON):

* ``time``: the engine clock; ``num_running``, ``num_waiting``: the queues' full lengths;
* ``requests``: per request ``id``, ``state`` (``prefill``, ``decode``, ``waiting``,
  ``preempted``, ``swapped``), ``prompt_tokens``, ``computed_tokens``, ``output_tokens``,
  ``max_tokens``, ``tenant``, ``priority``, ``ttft_s`` (so far, while it waits for its first
  token), ``cached_tokens``, ``blocks``, ``lora_name`` (its LoRA adapter; None: the base);
* ``kv``: ``num_blocks`` (usable), ``block_size``, ``free``, ``owned``, ``shared``, ``cached``
  (free but holding a prefix-cache entry: evictable), ``usage``, ``blocks_per_cell``,
  ``cells`` (one character a cell: ``.`` free, ``c`` cached, ``o`` owned by one request, ``s``
  shared), ``refs`` (the cell's highest reference count) and ``owner`` (the index in
  ``requests`` of the cell's first owner, -1 for none or one not listed);
* ``steps``: per recent step ``time``, ``prefill`` and ``decode`` tokens, ``spec`` (drafts
  scored), ``batch`` (sequences), ``step_ms``, ``preempted``;
* ``counters``: the engine's running totals (tokens, steps, preemptions, prefix-cache queries
  and hits, LoRA swaps and evictions);
* ``loras``: the LoRA adapters loaded (``name``, ``path``, ``rank``, ``lora_id``,
  ``resident``, ``slot``, ``running``); [] with LoRA off;
* ``tiers``: the KV tiers below the pool, top first (``medium`` cpu or disk,
  ``capacity_bytes``, ``bytes``, ``blocks``, ``hits``, ``loaded_bytes``, ``stored_blocks``,
  ``stored_bytes``, ``load_s``, ``store_s``, ``corrupt``, ``evictions``); [] with none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvflow.orchestrator.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvflow.orchestrator.engine import LLMEngine

MAX_REQUESTS = 64
MAX_CELLS = 2048
MAX_STEPS = 120
# A cell's character, by its busiest block's state, busiest last.
FREE, CACHED, OWNED, SHARED = ".", "c", "o", "s"


def engine_state(engine: LLMEngine, max_requests: int = MAX_REQUESTS,
                 max_cells: int = MAX_CELLS, max_steps: int = MAX_STEPS) -> dict[str, Any]:
    """The snapshot of ``engine`` now (module doc); call it on the engine's thread."""
    scheduler = engine.scheduler
    now = engine.clock()
    listed = [*scheduler.running, *scheduler.waiting][:max_requests]
    requests = [_request(r, now, engine) for r in listed]
    return {
        "time": now, "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting), "requests": requests,
        "kv": _kv(engine, {r.request_id: i for i, r in enumerate(listed)}, max_cells),
        "steps": [{"time": s.time, "prefill": s.num_prefill_tokens,
                   "decode": s.num_decode_tokens, "spec": s.num_spec_tokens,
                   "batch": s.num_scheduled_seqs,
                   "step_ms": round(1e3 * (s.schedule_time_s + s.model_time_s
                                           + s.sample_time_s + s.postprocess_time_s), 3),
                   "preempted": s.num_preempted}
                  for s in list(engine.step_stats)[-max_steps:]],
        "counters": {k: getattr(engine.counters, k) for k in (
            "prompt_tokens", "generation_tokens", "steps", "preemptions",
            "prefix_cache_queries", "prefix_cache_hits", "lora_swaps", "lora_evictions")},
        "loras": engine.list_loras(),
        "tiers": engine.kv.tiers.state() if engine.kv.tiers is not None else [],
    }


def _request(r: Request, now: float, engine: LLMEngine) -> dict[str, Any]:
    if r.status is RequestStatus.RUNNING:
        state = "prefill" if r.num_computed_tokens < r.num_prompt_tokens else "decode"
    elif r.status is RequestStatus.PREEMPTED:
        state = "swapped" if engine.kv.is_swapped(r.request_id) else "preempted"
    else:
        state = "waiting"
    ttft = r.metrics.ttft_s
    return {"id": r.request_id, "state": state, "prompt_tokens": r.num_prompt_tokens,
            "computed_tokens": min(r.num_computed_tokens, r.num_tokens),
            "output_tokens": r.num_output_tokens, "max_tokens": r.max_output_tokens,
            "tenant": r.tenant, "priority": r.priority,
            "ttft_s": round(ttft if ttft is not None else now - r.arrival_time, 6),
            "cached_tokens": r.metrics.cached_tokens, "lora_name": r.lora_name,
            # held blocks: a sliding window's released entries are the null block 0
            "blocks": sum(1 for b in engine.kv.block_tables.get(r.request_id, ()) if b)}


def _kv(engine: LLMEngine, listed: dict[str, int], max_cells: int) -> dict[str, Any]:
    kv = engine.kv
    pool = kv.pool
    refs = pool.ref_counts[1:]  # block b is refs[b - 1] (block 0 is the null block)
    # Ranks free, cached, owned, shared, in one pass each (C loops where it counts: a pool of 20,000
    # blocks is walked in a few milliseconds, on the engine thread, between steps).
    ranks = [3 if r > 1 else 2 if r else 0 for r in refs]
    for block in pool.cached.values():
        if not refs[block - 1]:
            ranks[block - 1] = 1
    owners: dict[int, int] = {}
    for request_id, table in kv.block_tables.items():
        index = listed.get(str(request_id), -1)
        for block in table:
            if owners.get(block, -1) == -1:
                owners[block] = index
    per_cell = max(1, -(-len(ranks) // max_cells))
    chars = (FREE, CACHED, OWNED, SHARED)
    cells, refs_out, owner_out = [], [], []
    for start in range(0, len(ranks), per_cell):
        end = min(start + per_cell, len(ranks))
        top = max(ranks[start:end]) if per_cell > 1 else ranks[start]
        busiest = ranks.index(top, start, end)
        cells.append(chars[top])
        refs_out.append(max(refs[start:end]) if per_cell > 1 else refs[start])
        owner_out.append(owners.get(busiest + 1, -1))
    counts = [ranks.count(k) for k in range(4)]
    return {"num_blocks": pool.num_usable_blocks, "block_size": kv.block_size,
            "free": counts[0], "cached": counts[1], "owned": counts[2], "shared": counts[3],
            "usage": round(pool.usage, 6), "blocks_per_cell": per_cell, "cells": "".join(cells),
            "refs": refs_out, "owner": owner_out}
