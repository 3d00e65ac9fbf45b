"""The ``kvflow_kv_tier_*`` metrics: what the KV tiers below the pool hold and did, by
``medium`` (Dynamo's names: ``cpu`` for the host tier, ``disk``). Pure Python; the catalogue
(:data:`kvflow.observability.metrics.METRICS`) takes them from here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvflow.kv_manager.tier_store import TIER_MEDIA

if TYPE_CHECKING:
    from kvflow.kv_manager import KVCacheManager

__all__ = ["TIER_COUNTERS", "TIER_MEDIA", "TIER_USAGE", "tier_figures"]

# The gauge: (name, help).
TIER_USAGE = ("kvflow_kv_tier_usage_bytes", "Bytes held by each KV tier below the pool "
              "(cpu: kv_offload_bytes, disk: kv_disk_bytes)")
# The counters: (name, the KVTiers.state() figure it mirrors, help).
TIER_COUNTERS = (
    ("kvflow_kv_tier_hits_total", "hits",
     "Prefix cache blocks restored from each KV tier into the pool (each counted once)"),
    ("kvflow_kv_tier_loaded_bytes_total", "loaded_bytes",
     "Bytes read from each KV tier (prefetched blocks no request took included)"),
    ("kvflow_kv_tier_stored_bytes_total", "stored_bytes",
     "Bytes of blocks evicted from the pool (or a tier above) stored in each KV tier"),
    ("kvflow_kv_tier_load_seconds_total", "load_s",
     "Seconds reading blocks from each KV tier (on the loader thread when prefetched)"),
    ("kvflow_kv_tier_store_seconds_total", "store_s",
     "Seconds storing evicted blocks in each KV tier (on the writer thread)"),
    ("kvflow_kv_tier_corrupt_total", "corrupt",
     "Tier blocks that failed their check on load (dropped, then recomputed)"),
)


def tier_figures(kv: KVCacheManager) -> dict[str, dict[str, Any]]:
    """Each tier's :meth:`~kvflow.kv_manager.tiers.KVTiers.state` by medium ({} without)."""
    return {str(t["medium"]): t for t in kv.tiers.state()} if kv.tiers is not None else {}
