"""The host KV pool: per-layer K and V arrays, laid out as the engine I/O contract says."""

from __future__ import annotations

import numpy as np

from kvflow.plugins import kv_registry


class HostKVPool:
    """KV pool in host memory: for each layer, K and V of shape
    ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    The arrays are registered by address so that PagedAttention implementations reach them
    through ``kv_cache_ptrs`` (int64 ``[num_layers, 2]``), never as graph tensors.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: np.dtype | type = np.float32) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [np.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [np.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.ptrs = np.array(
            [[kv_registry.register(k), kv_registry.register(v)]
             for k, v in zip(self.k, self.v, strict=True)],
            dtype=np.int64,
        ).reshape(num_layers, 2)
        self.nbytes = sum(a.nbytes for a in self.k) * 2

    def close(self) -> None:
        for a in (*self.k, *self.v):
            kv_registry.unregister(a)
        self.k, self.v = [], []
