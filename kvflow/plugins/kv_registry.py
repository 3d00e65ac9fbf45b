"""KV pools by address: how a PagedAttention kernel finds the pool it was handed.

The engine graph never holds the KV pool as a tensor: it receives the pool's base addresses
(``kv_cache_ptrs``, int64 ``[num_layers, 2]``), as TensorRT-LLM passes its pool pointers. A GPU
kernel dereferences them directly. A host (CPU) implementation cannot safely turn an arbitrary
integer into memory, so the owner of a host pool registers every K and V array here under its
address, and the kernels look them up. An address that was never registered is an error, not a
crash. Device pools are registered apart: torch tensors (the Triton runner's, on a GPU or, for
the Triton interpreter, on the host) or :class:`DeviceArray` descriptions of raw device memory
(the TensorRT runner's, allocated with cuda-python); an implementation that finds the address
there launches the Triton kernels on that memory.

The runner also leaves here what it knows on the host about the step it is running
(:func:`step_hints`): the most new tokens of any sequence sizes the attention grid, and a
kernel that had to read it from ``query_start_loc`` would copy it off the device once per layer,
a synchronisation that CUDA graphs cannot even contain.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

_lock = threading.Lock()
_arrays: dict[int, np.ndarray] = {}
_device: dict[int, Any] = {}


def address_of(array: np.ndarray) -> int:
    """Base address of an array's data, as written into ``kv_cache_ptrs``."""
    return int(array.__array_interface__["data"][0])


def register(array: np.ndarray) -> int:
    """Register a contiguous cache array; returns its address."""
    if not array.flags.c_contiguous:
        raise ValueError("a KV cache array must be C-contiguous")
    addr = address_of(array)
    with _lock:
        _arrays[addr] = array
    return addr


def unregister(array: np.ndarray) -> None:
    with _lock:
        _arrays.pop(address_of(array), None)


def lookup(addr: int) -> np.ndarray:
    """The array registered at ``addr``."""
    try:
        return _arrays[int(addr)]
    except KeyError:
        raise KeyError(
            f"kv_cache_ptrs holds address {int(addr):#x}, which is no registered KV pool "
            "(was the pool freed, or built by another process?)"
        ) from None


# __cuda_array_interface__ type strings of the device pools' element types. NOTE: the interface
# has no bfloat16; a bf16 pool is described as int16, and its reader views it as bfloat16.
CUDA_TYPESTRS = {"fp32": "<f4", "fp16": "<f2", "bf16": "<i2"}


@dataclass(frozen=True)
class DeviceArray:
    """C-contiguous device memory of ``shape`` and ``kv_cache_dtype`` at address ``ptr``: a
    device pool's K or V that no framework owns. It offers ``__cuda_array_interface__``, so a
    framework (the plugin's torch) can view it without copying."""

    ptr: int
    shape: tuple[int, ...]
    kv_cache_dtype: str

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.shape, "typestr": CUDA_TYPESTRS[self.kv_cache_dtype],
                "data": (self.ptr, False), "strides": None, "version": 3}

    def data_ptr(self) -> int:
        return self.ptr


def register_device(pool: Any) -> int:
    """Register a device pool's K or V (a contiguous torch tensor or a :class:`DeviceArray`);
    returns its address."""
    if not isinstance(pool, DeviceArray) and not pool.is_contiguous():
        raise ValueError("a KV cache tensor must be contiguous")
    addr = int(pool.data_ptr())
    with _lock:
        _device[addr] = pool
    return addr


def unregister_device(pool: Any) -> None:
    with _lock:
        _device.pop(int(pool.data_ptr()), None)


def lookup_device(addr: int) -> Any | None:
    """The torch tensor or :class:`DeviceArray` registered at ``addr`` as a device pool, or
    None."""
    return _device.get(int(addr))


_hints = threading.local()


@contextmanager
def step_hints(max_query_len: int) -> Iterator[None]:
    """Within the block, PagedAttention implementations of this thread may take
    ``max_query_len`` (the most new tokens of any sequence in the step) as given."""
    before = getattr(_hints, "max_query_len", None)
    _hints.max_query_len = int(max_query_len)
    try:
        yield
    finally:
        _hints.max_query_len = before


def max_query_len_hint() -> int | None:
    """The ``max_query_len`` of the step this thread is running, when its runner said."""
    return getattr(_hints, "max_query_len", None)
