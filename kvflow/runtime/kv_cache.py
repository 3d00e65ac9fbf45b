"""The host KV pool: per-layer K and V arrays, laid out as the engine I/O contract says."""

from __future__ import annotations

import numpy as np

from kvflow.plugins import kv_registry
from kvflow.runtime.base import KV_CACHE_NUMPY_DTYPES, check_payloads


class HostKVPool:
    """KV pool in host memory: for each layer, K and V of shape
    ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    The arrays are registered by address so that PagedAttention implementations reach them
    through ``kv_cache_ptrs`` (int64 ``[num_layers, 2]``), never as graph tensors. ``dtype``:
    float32 or float16 (:data:`~kvflow.runtime.base.KV_CACHE_NUMPY_DTYPES`); the swap space
    has the same, so swaps and block copies move the stored bits unchanged.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: np.dtype | type = np.float32,
                 num_host_blocks: int = 0) -> None:
        names = {v: k for k, v in KV_CACHE_NUMPY_DTYPES.items()}
        if np.dtype(dtype) not in names:
            raise ValueError(f"a host KV pool holds one of "
                             f"{tuple(str(d) for d in names)}, got {np.dtype(dtype)}")
        self.kv_cache_dtype = names[np.dtype(dtype)]
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [np.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [np.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.ptrs = np.array(
            [[kv_registry.register(k), kv_registry.register(v)]
             for k, v in zip(self.k, self.v, strict=True)],
            dtype=np.int64,
        ).reshape(num_layers, 2)
        self.nbytes = sum(a.nbytes for a in self.k) * 2
        # The swap space: same layout, its own block ids (block 0 unused, as in the device pool).
        host_shape = (num_host_blocks + 1, *shape[1:]) if num_host_blocks else (0, *shape[1:])
        self.host_k = [np.zeros(host_shape, dtype=dtype) for _ in range(num_layers)]
        self.host_v = [np.zeros(host_shape, dtype=dtype) for _ in range(num_layers)]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """``(device_block, host_block)`` copies, every layer, K and V."""
        src, dst = (np.array(x, dtype=np.int64) for x in zip(*pairs, strict=True))
        for k, v, hk, hv in zip(self.k, self.v, self.host_k, self.host_v, strict=True):
            hk[dst] = k[src]
            hv[dst] = v[src]

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """``(host_block, device_block)`` copies, every layer, K and V."""
        src, dst = (np.array(x, dtype=np.int64) for x in zip(*pairs, strict=True))
        for k, v, hk, hv in zip(self.k, self.v, self.host_k, self.host_v, strict=True):
            k[dst] = hk[src]
            v[dst] = hv[src]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """``(src, dst)`` device-block copies, every layer, K and V (destinations distinct)."""
        src, dst = (np.array(x, dtype=np.int64) for x in zip(*pairs, strict=True))
        for k, v in zip(self.k, self.v, strict=True):
            k[dst] = k[src]
            v[dst] = v[src]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's payload: every layer's K and V (:meth:`read_blocks`)."""
        return 2 * sum(k[0].nbytes for k in self.k)

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Each block's KV as bytes, in the pool's dtype: layer 0's K, layer 0's V, layer 1's
        K, ... (each ``[block_size, num_kv_heads, head_dim]``, C order)."""
        return [b"".join(a[b].tobytes() for k, v in zip(self.k, self.v, strict=True)
                         for a in (k, v)) for b in block_ids]

    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Write :meth:`read_blocks` payloads into ``block_ids`` (every layer, K and V)."""
        check_payloads(block_ids, payloads, self.block_nbytes)
        for b, payload in zip(block_ids, payloads, strict=True):
            per_layer = np.frombuffer(payload, dtype=self.k[0].dtype).reshape(
                2 * len(self.k), *self.k[0].shape[1:])
            for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
                k[b] = per_layer[2 * i]
                v[b] = per_layer[2 * i + 1]

    def close(self) -> None:
        for a in (*self.k, *self.v):
            kv_registry.unregister(a)
        self.k, self.v, self.host_k, self.host_v = [], [], [], []
