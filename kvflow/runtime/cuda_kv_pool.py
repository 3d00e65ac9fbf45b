"""The TensorRT runner's KV pool: device memory it allocates with cuda-python and owns.

Per layer, K and V are ``[num_blocks, block_size, num_kv_heads, head_dim]`` of the pool's
element type (the engine I/O contract's layout), each one ``cudaMalloc``; the swap space is
pinned host memory of the same layout. The plugin reaches the pool by address
(``kv_cache_ptrs``): every K and V is registered in :mod:`kvflow.plugins.kv_registry` as a
:class:`~kvflow.plugins.kv_registry.DeviceArray`. Swaps and block copies are queued on the
runner's stream, the one its steps run on, so they are ordered with the steps without a wait;
runs of consecutive blocks move in one copy. The KV tiers' block copies (``read_blocks``,
``write_blocks``) go through a pinned staging area on the same stream, and wait for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvflow.plugins import kv_registry
from kvflow.runtime.base import KV_CACHE_DTYPE_BYTES, check_payloads
from kvflow.runtime.cuda_runtime import DeviceBuffer, PinnedBuffer, Stream, close_all


def block_runs(pairs: list[tuple[int, int]], same_pool: bool = True
               ) -> list[tuple[int, int, int]]:
    """``(src, dst)`` block pairs as ``(src, dst, count)`` runs of consecutive blocks, in the
    pairs' order: each run is one copy. Within one pool (``same_pool``) a run never has its
    source and destination ranges overlap (the copy could read what it wrote)."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs:
            s, d, n = runs[-1]
            apart = not same_pool or d >= s + n + 1 or s >= d + n + 1
            if src == s + n and dst == d + n and apart:
                runs[-1] = (s, d, n + 1)
                continue
        runs.append((int(src), int(dst), 1))
    return runs


def copies_in_order_are_safe(pairs: list[tuple[int, int]]) -> bool:
    """Whether copying ``pairs`` one after another gives what reading every source first
    gives (the host pool's semantics): no destination is also a source. Copy on write asks
    for such copies; the pool stages any others through host memory."""
    return not {d for _, d in pairs} & {s for s, _ in pairs}


class CudaKVPool:
    """KV pool in device memory (see the module doc); ``ptrs`` is the int64
    ``[num_layers, 2]`` address table the engine's ``kv_cache_ptrs`` holds."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, kv_cache_dtype: str, stream: Stream,
                 num_host_blocks: int = 0) -> None:
        if kv_cache_dtype not in kv_registry.CUDA_TYPESTRS:
            raise ValueError(f"a device KV pool holds one of {tuple(kv_registry.CUDA_TYPESTRS)}, "
                             f"got {kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype
        self.stream = stream
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_nbytes = block_size * num_kv_heads * head_dim * KV_CACHE_DTYPE_BYTES[
            kv_cache_dtype]
        self.device: list[tuple[DeviceBuffer, DeviceBuffer]] = []
        self.host: list[tuple[PinnedBuffer, PinnedBuffer]] = []
        self.arrays: list[kv_registry.DeviceArray] = []
        self._staging: PinnedBuffer | None = None  # the KV tiers' (read_blocks, write_blocks)
        try:
            for _ in range(num_layers):
                kv = (DeviceBuffer(num_blocks * self.block_nbytes),
                      DeviceBuffer(num_blocks * self.block_nbytes))
                self.device.append(kv)
                for buf in kv:
                    stream.zero(buf.ptr, buf.nbytes)
                    self.arrays.append(kv_registry.DeviceArray(buf.ptr, shape, kv_cache_dtype))
                    kv_registry.register_device(self.arrays[-1])
                if num_host_blocks:  # block 0 unused, as in the device pool
                    self.host.append((PinnedBuffer((num_host_blocks + 1) * self.block_nbytes),
                                      PinnedBuffer((num_host_blocks + 1) * self.block_nbytes)))
        except BaseException:
            self.close()
            raise
        self.ptrs = np.array([[k.ptr, v.ptr] for k, v in self.device],
                             dtype=np.int64).reshape(num_layers, 2)
        self.nbytes = 2 * num_layers * num_blocks * self.block_nbytes

    def _swap_space(self) -> None:
        if not self.host:
            raise RuntimeError("this KV pool has no swap space (num_host_blocks=0)" if self.device
                               else "this KV pool is closed")

    def _copy_runs(self, pairs: list[tuple[int, int]], copy: Callable[[int, int, int], None],
                   srcs: Sequence[Sequence[DeviceBuffer | PinnedBuffer]],
                   dsts: Sequence[Sequence[DeviceBuffer | PinnedBuffer]]) -> None:
        """Queue ``copy(dst, src, nbytes)`` for each run of ``pairs``, from each layer's K and
        V in ``srcs`` to its K and V in ``dsts`` (the same list: a copy within one pool)."""
        bn = self.block_nbytes
        runs = block_runs(pairs, same_pool=srcs is dsts)
        for src_kv, dst_kv in zip(srcs, dsts, strict=True):
            for s, d in zip(src_kv, dst_kv, strict=True):
                for src, dst, n in runs:
                    copy(d.ptr + dst * bn, s.ptr + src * bn, n * bn)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """``(device_block, host_block)`` copies, every layer, K and V."""
        self._swap_space()
        self._copy_runs(pairs, self.stream.copy_to_host, self.device, self.host)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """``(host_block, device_block)`` copies, every layer, K and V."""
        self._swap_space()
        self._copy_runs(pairs, self.stream.copy_to_device, self.host, self.device)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """``(src, dst)`` device-block copies, every layer, K and V, with the host pool's
        meaning: every source is read before any destination is written."""
        if not self.device:
            raise RuntimeError("this KV pool is closed")
        if copies_in_order_are_safe(pairs):
            self._copy_runs(pairs, self.stream.copy_on_device, self.device, self.device)
            return
        bn = self.block_nbytes
        # A destination is also a source: stage every source through host memory first (the
        # stream runs the copies in order, so each buffer's reads finish before its writes).
        staging = PinnedBuffer(len(pairs) * bn)
        try:
            for buf in (b for pair in self.device for b in pair):
                for i, (src, _) in enumerate(pairs):
                    self.stream.copy_to_host(staging.ptr + i * bn, buf.ptr + src * bn, bn)
                for i, (_, dst) in enumerate(pairs):
                    self.stream.copy_to_device(buf.ptr + dst * bn, staging.ptr + i * bn, bn)
            self.stream.synchronize()
        finally:
            staging.close()

    def _staging_for(self, nbytes: int) -> PinnedBuffer:
        # One pinned staging area for the tiers' copies, grown as needed: a cudaMallocHost per
        # evicted block would cost more than the copy.
        if self._staging is None or self._staging.nbytes < nbytes:
            if self._staging is not None:
                self._staging.close()
                self._staging = None
            self._staging = PinnedBuffer(nbytes)
        return self._staging

    def _tier_runs(self, block_ids: list[int]) -> list[tuple[int, int, int]]:
        """``(pool block, staging slot, count)`` runs of ``block_ids``, checked."""
        if not self.device:
            raise RuntimeError("this KV pool is closed")
        num_blocks = self.device[0][0].nbytes // self.block_nbytes
        for b in block_ids:  # NOTE: an address past the pool would be a silent bad copy
            if not 0 <= b < num_blocks:
                raise ValueError(f"block {b} is not in the pool's {num_blocks} blocks")
        return block_runs([(b, i) for i, b in enumerate(block_ids)], same_pool=False)

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Each block's KV as bytes, in the pool's type: layer 0's K, layer 0's V, layer 1's
        K, ... (the host pool's payload). Copies every layer's K and V runs into pinned
        staging on the steps' stream and waits for them, so the block may be overwritten as
        soon as this returns."""
        if not block_ids:
            return []
        runs = self._tier_runs(block_ids)
        n, bn = len(block_ids), self.block_nbytes
        buffers = [buf for pair in self.device for buf in pair]
        staging = self._staging_for(len(buffers) * n * bn)
        for j, buf in enumerate(buffers):  # staging: [K/V of each layer, block, bytes]
            for src, slot, count in runs:
                self.stream.copy_to_host(staging.ptr + (j * n + slot) * bn,
                                         buf.ptr + src * bn, count * bn)
        self.stream.synchronize()
        per_buffer = staging.array[: len(buffers) * n * bn].reshape(len(buffers), n, bn)
        return [per_buffer[:, i].tobytes() for i in range(n)]

    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Write :meth:`read_blocks` payloads into ``block_ids`` (every layer, K and V),
        through pinned staging, queued on the steps' stream so the next step reads them."""
        # NOTE: the payload's size from ptrs (every layer's K and V), which outlives close():
        # a closed pool is then refused as closed, by _tier_runs.
        check_payloads(block_ids, payloads, self.ptrs.size * self.block_nbytes)
        if not block_ids:
            return
        runs = self._tier_runs(block_ids)
        buffers = [buf for pair in self.device for buf in pair]
        n, bn = len(block_ids), self.block_nbytes
        staging = self._staging_for(len(buffers) * n * bn)
        per_buffer = staging.array[: len(buffers) * n * bn].reshape(len(buffers), n, bn)
        for i, payload in enumerate(payloads):
            per_buffer[:, i] = np.frombuffer(payload, dtype=np.uint8).reshape(len(buffers), bn)
        for j, buf in enumerate(buffers):
            for dst, slot, count in runs:
                self.stream.copy_to_device(buf.ptr + dst * bn,
                                           staging.ptr + (j * n + slot) * bn, count * bn)
        # NOTE: the staging area is reused by the next call: the copies must have read it.
        self.stream.synchronize()

    def close(self) -> None:
        """Wait for queued copies, then unregister and free everything (idempotent). Frees
        all it can even after a CUDA error, then raises the first."""
        for array in self.arrays:
            kv_registry.unregister_device(array)
        steps: list[Callable[[], None]] = [self.stream.synchronize] if (
            self.stream.handle is not None and (self.device or self.host)) else []
        steps += [buf.close for pair in self.device for buf in pair]
        steps += [buf.close for pinned in self.host for buf in pinned]
        if self._staging is not None:
            steps.append(self._staging.close)
        self.arrays, self.device, self.host, self._staging = [], [], [], None
        close_all(steps)
