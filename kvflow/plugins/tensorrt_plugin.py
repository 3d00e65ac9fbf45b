"""``kvflow::PagedAttention`` as a TensorRT Python plugin (``tensorrt.plugin``, TensorRT >= 10.10).

Importing this module registers the plugin under the ONNX node's domain and op type (the
domain is the plugin namespace, which is why it has no dot), so TensorRT's ONNX parser maps
every PagedAttention node of ``model.onnx`` onto it. The implementation launches kvflow's
OpenAI Triton kernels on TensorRT's stream.

The KV pool is passed as the engine I/O contract says: ``kv_cache_ptrs`` holds addresses, never
the pool as a tensor, so TensorRT never allocates, copies or aliases it. The runner that owns
the pool (cuda-python memory) registers its K and V in :mod:`kvflow.plugins.kv_registry` and
the host copy of the address table with :func:`bind_pool_addresses`, so that a step needs no
device-to-host read. The implementation alone uses torch: OpenAI Triton's CUDA driver imports
it to launch kernels, so the kernels get torch views of the pool's memory.

Every attribute of the node is a plugin field, ``sliding_window`` and ``logit_softcap`` too:
TensorRT's Python plugins take no attribute defaults, so the ONNX export always writes both
(0 = off), and a plan built before they existed must be rebuilt.

At build time TensorRT may run plugins on inputs filled with arbitrary data; block tables and
addresses of arbitrary data would send the kernels reading anywhere. Builds therefore run
inside :func:`building`, during which the implementation only zeroes its output.

NOTE: no ``from __future__ import annotations`` here. ``tensorrt.plugin`` validates the
registered functions from ``inspect.signature`` without evaluating string annotations
(``issubclass(annotation, TensorDesc)``), so the annotations must be real classes, and
``outputs`` must be ``tuple[trtp.Tensor]``: the ``...`` of ``tuple[trtp.Tensor, ...]`` fails
the same check.
"""

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorrt as trt
import tensorrt.plugin as trtp  # type: ignore[import-not-found, import-untyped, unused-ignore]
import torch

from kvflow.plugins import kv_registry
from kvflow.plugins.torch_op import ONNX_DOMAIN, ONNX_OP_TYPE

PLUGIN_ID = f"{ONNX_DOMAIN}::{ONNX_OP_TYPE}"

_state = threading.local()
_host_addresses: dict[int, np.ndarray] = {}


@contextlib.contextmanager
def building() -> Iterator[None]:
    """While TensorRT builds (and may time the plugin on arbitrary data), launch nothing."""
    _state.building = True
    try:
        yield
    finally:
        _state.building = False


def bind_pool_addresses(device_address: int, host: np.ndarray) -> None:
    """Record ``host``, the host copy of the ``kv_cache_ptrs`` table at ``device_address``."""
    _host_addresses[int(device_address)] = np.array(host, dtype=np.int64)


def unbind_pool_addresses(device_address: int) -> None:
    _host_addresses.pop(int(device_address), None)
    _pool_views.clear()


_TORCH_DTYPES = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
                 trt.DataType.BF16: torch.bfloat16, trt.DataType.INT32: torch.int32,
                 trt.DataType.INT64: torch.int64}


def as_torch(tensor: Any) -> torch.Tensor:
    """A torch view of a plugin ``Tensor``. NOTE: ``torch.as_tensor`` cannot wrap BF16 plugin
    tensors (their ``__cuda_array_interface__`` refuses BF16), so those are wrapped as int16
    and viewed as bfloat16."""
    dtype = _TORCH_DTYPES[tensor.dtype]
    if dtype is not torch.bfloat16:
        return torch.as_tensor(tensor, device="cuda")

    class _Int16View:
        __cuda_array_interface__ = {
            "shape": tuple(tensor.shape), "typestr": "<i2", "version": 3,
            "data": (tensor.data_ptr, False),
            "strides": tuple(2 * s for s in tensor.strides)}

    return torch.as_tensor(_Int16View(), device="cuda").view(torch.bfloat16)


# torch views of the TensorRT runner's pool (kv_registry.DeviceArray), made once per array.
_pool_views: dict[int, tuple[Any, torch.Tensor]] = {}


def pool_tensor(addr: int) -> torch.Tensor:
    """The device pool registered at ``addr`` as a torch tensor (the Triton kernels take
    those): a registered torch tensor itself, or a view of a ``DeviceArray``'s memory."""
    pool = kv_registry.lookup_device(addr)
    if pool is None:
        raise KeyError(f"kv_cache_ptrs holds address {addr:#x}, which is no registered device "
                       "KV pool")
    if isinstance(pool, torch.Tensor):
        return pool
    cached = _pool_views.get(addr)
    if cached is None or cached[0] is not pool:
        view = torch.as_tensor(pool)  # through __cuda_array_interface__, on its own device
        if pool.kv_cache_dtype == "bf16":
            view = view.view(torch.bfloat16)
        cached = _pool_views[addr] = (pool, view)
    return cached[1]


@trtp.register(PLUGIN_ID)
def paged_attention_desc(
    q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc,
    kv_cache_ptrs: trtp.TensorDesc, slot_mapping: trtp.TensorDesc,
    block_tables: trtp.TensorDesc, seq_lens: trtp.TensorDesc,
    query_start_loc: trtp.TensorDesc, layer_idx: int, num_heads: int, num_kv_heads: int,
    head_dim: int, block_size: int, scale: float, sliding_window: int, logit_softcap: float,
) -> trtp.TensorDesc:
    """The output has the queries' shape and type: ``[num_tokens, num_heads * head_dim]``."""
    return q.like()


@trtp.impl(PLUGIN_ID)
def paged_attention_impl(
    q: trtp.Tensor, k: trtp.Tensor, v: trtp.Tensor, kv_cache_ptrs: trtp.Tensor,
    slot_mapping: trtp.Tensor, block_tables: trtp.Tensor, seq_lens: trtp.Tensor,
    query_start_loc: trtp.Tensor, layer_idx: int, num_heads: int, num_kv_heads: int,
    head_dim: int, block_size: int, scale: float, sliding_window: int, logit_softcap: float,
    outputs: tuple[trtp.Tensor], stream: int,
) -> None:
    """Write this layer's new K/V into the pool and attend, on TensorRT's ``stream``
    (``sliding_window``, ``logit_softcap``: as the ONNX node's, 0 = off)."""
    from kvflow.plugins.paged_attention_triton import paged_attention_triton

    out = as_torch(outputs[0])
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        if getattr(_state, "building", False):
            out.zero_()
            return
        host = _host_addresses.get(int(kv_cache_ptrs.data_ptr))
        if host is None:  # unbound: read the table (one small synchronous copy)
            host = as_torch(kv_cache_ptrs).cpu().numpy()
        k_cache = pool_tensor(int(host[layer_idx, 0]))
        v_cache = pool_tensor(int(host[layer_idx, 1]))
        t = q.shape[0]
        paged_attention_triton(
            as_torch(q).view(t, num_heads, head_dim), as_torch(k).view(t, num_kv_heads, head_dim),
            as_torch(v).view(t, num_kv_heads, head_dim), k_cache, v_cache,
            as_torch(slot_mapping), as_torch(block_tables), as_torch(seq_lens),
            as_torch(query_start_loc), scale, out=out.view(t, num_heads, head_dim),
            max_query_len=kv_registry.max_query_len_hint(), sliding_window=sliding_window,
            logit_softcap=logit_softcap)
