"""The CUDA runtime through cuda-python (``cuda.bindings.runtime``): what the TensorRT runner
needs of it, and nothing of torch.

cuda-python returns every call's error as the first item of a tuple; :func:`check` turns a
failure into a :class:`CudaError` that names the call and the error (``cudaErrorMemoryAllocation``,
...). A machine without a usable GPU (no device, no driver, a driver too old for the runtime)
raises :class:`NoCudaDevice` at the first call that needs one, so a user reads "no CUDA device",
never an import error or a crash.

The objects here own what they allocate and free it in ``close()`` (idempotent): device buffers,
pinned host buffers, a stream and an event.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

# NOTE: cuda-python's runtime module loads the CUDA driver lazily, at the first call: importing
# it works on any machine, which is what lets CI import and exercise this module.
try:
    from cuda.bindings import runtime as cudart
except ImportError:  # cuda-python older than 12.6, or not installed
    cudart = None

# Errors that mean "this machine has no GPU kvflow can use", whatever call met them first.
_NO_DEVICE_ERRORS = ("cudaErrorNoDevice", "cudaErrorInsufficientDriver",
                     "cudaErrorInitializationError", "cudaErrorCompatNotSupportedOnDevice",
                     "cudaErrorSystemDriverMismatch", "cudaErrorStubLibrary",
                     "cudaErrorDevicesUnavailable")


class CudaError(RuntimeError):
    """A CUDA runtime call failed; ``name`` is the error's name (``cudaErrorInvalidValue``)."""

    def __init__(self, call: str, name: str, text: str) -> None:
        super().__init__(f"{call} failed: {name} ({text})")
        self.call = call
        self.name = name


class NoCudaDevice(CudaError):
    """No usable CUDA device: none present, no driver, or a driver too old for the runtime."""

    def __init__(self, call: str, name: str, text: str) -> None:
        RuntimeError.__init__(self, f"no CUDA device: {call} returned {name} ({text})")
        self.call = call
        self.name = name


def require_cuda_python() -> Any:
    """The ``cuda.bindings.runtime`` module, or a clear error saying how to install it."""
    if cudart is None:
        raise ImportError("the TensorRT runner needs cuda-python >= 12.6 (cuda.bindings): "
                          "pip install 'kvflow[tensorrt]'")
    return cudart


def check(call: str, result: tuple[Any, ...]) -> Any:
    """The value(s) of a cuda-python call's ``(error, *values)`` result; raises on an error."""
    err, *values = result
    if int(err) != 0:
        name = getattr(err, "name", str(err))
        _, text = cudart.cudaGetErrorString(err)
        raise (NoCudaDevice if name in _NO_DEVICE_ERRORS else CudaError)(
            call, name, text.decode() if isinstance(text, bytes) else str(text))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def close_all(closers: list[Callable[[], None]]) -> None:
    """Call every closer, even after one fails (a sticky CUDA error fails them all); then
    raise the first error."""
    first: BaseException | None = None
    for close in closers:
        try:
            close()
        except Exception as e:  # noqa: BLE001  free the rest, then report
            first = first or e
    if first is not None:
        raise first


def device_count() -> int:
    """CUDA devices visible to this process; raises :class:`NoCudaDevice` when there are none."""
    rt = require_cuda_python()
    n = check("cudaGetDeviceCount", rt.cudaGetDeviceCount())
    if n < 1:
        raise NoCudaDevice("cudaGetDeviceCount", "cudaErrorNoDevice", "it reports 0 devices")
    return int(n)


def use_device(device: int = 0) -> None:
    """Make ``device`` current for this thread (after checking there is one)."""
    count = device_count()
    if not 0 <= device < count:
        raise ValueError(f"CUDA device {device} does not exist: {count} visible")
    check("cudaSetDevice", cudart.cudaSetDevice(device))


class DeviceBuffer:
    """``nbytes`` of device memory (``cudaMalloc``); ``ptr`` is its address."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = int(nbytes)
        self.ptr = int(check("cudaMalloc", cudart.cudaMalloc(max(self.nbytes, 1))))

    def close(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            check("cudaFree", cudart.cudaFree(ptr))


class PinnedBuffer:
    """``nbytes`` of page-locked host memory (``cudaMallocHost``), also seen as a NumPy byte
    array (:attr:`array`), so that copies to and from the device can be asynchronous."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = int(nbytes)
        self.ptr = int(check("cudaMallocHost", cudart.cudaMallocHost(max(self.nbytes, 1))))
        try:
            self.array = np.ctypeslib.as_array(
                (ctypes.c_uint8 * max(self.nbytes, 1)).from_address(self.ptr))
        except BaseException:
            self.close()
            raise

    def view(self, dtype: np.dtype | type, shape: tuple[int, ...]) -> np.ndarray:
        """The first ``prod(shape)`` elements of ``dtype``, as an array over this memory.
        NOTE: the array does not keep the memory alive: copy what must outlive ``close()``."""
        count = int(np.prod(shape))
        return self.array[: count * np.dtype(dtype).itemsize].view(dtype).reshape(shape)

    def close(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            self.array = np.empty(0, np.uint8)
            check("cudaFreeHost", cudart.cudaFreeHost(ptr))


class Stream:
    """One non-blocking CUDA stream, with an event to wait for what was queued on it."""

    def __init__(self) -> None:
        self.handle = check("cudaStreamCreateWithFlags",
                            cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking))
        try:
            self._event = check("cudaEventCreateWithFlags",
                                cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming))
        except CudaError:
            cudart.cudaStreamDestroy(self.handle)
            raise

    def __int__(self) -> int:
        return int(self.handle)

    def copy_to_device(self, dst: int, src: int, nbytes: int) -> None:
        """Queue a host-to-device copy (``src``: pinned memory, for it to be asynchronous)."""
        if nbytes:
            check("cudaMemcpyAsync", cudart.cudaMemcpyAsync(
                dst, src, nbytes, cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.handle))

    def copy_to_host(self, dst: int, src: int, nbytes: int) -> None:
        """Queue a device-to-host copy (``dst``: pinned memory)."""
        if nbytes:
            check("cudaMemcpyAsync", cudart.cudaMemcpyAsync(
                dst, src, nbytes, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.handle))

    def copy_on_device(self, dst: int, src: int, nbytes: int) -> None:
        """Queue a device-to-device copy."""
        if nbytes:
            check("cudaMemcpyAsync", cudart.cudaMemcpyAsync(
                dst, src, nbytes, cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.handle))

    def zero(self, ptr: int, nbytes: int) -> None:
        """Queue a memset of ``nbytes`` at ``ptr`` to zero."""
        if nbytes:
            check("cudaMemsetAsync", cudart.cudaMemsetAsync(ptr, 0, nbytes, self.handle))

    def synchronize(self) -> None:
        """Record the event after all queued work and wait for it."""
        check("cudaEventRecord", cudart.cudaEventRecord(self._event, self.handle))
        check("cudaEventSynchronize", cudart.cudaEventSynchronize(self._event))

    def close(self) -> None:
        if self.handle is not None:
            handle, event, self.handle, self._event = self.handle, self._event, None, None
            close_all([lambda: check("cudaEventDestroy", cudart.cudaEventDestroy(event)),
                       lambda: check("cudaStreamDestroy", cudart.cudaStreamDestroy(handle))])
