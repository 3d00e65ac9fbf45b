"""Paged KV-cache block management (pure Python: block ids are integers)."""

from kvflow.kv_manager.block_pool import BlockPool, NoFreeBlocksError
from kvflow.kv_manager.kv_cache_manager import KVCacheManager
from kvflow.kv_manager.spec import KVCacheSpec

__all__ = ["BlockPool", "KVCacheManager", "KVCacheSpec", "NoFreeBlocksError"]
