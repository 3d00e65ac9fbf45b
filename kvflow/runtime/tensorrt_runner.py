"""The TensorRT runner: a built plan executed with ``execute_async_v3`` on buffers it owns,
through cuda-python (no torch on this path).

At load it plans its buffers from the optimization profile's maximum shapes
(:mod:`.tensorrt_buffers`) and allocates them once: a staging area for the step inputs (pinned
on the host, and on the device), the logits (on the device, and pinned on the host), the
``kv_cache_ptrs`` table, and the KV pool (:class:`~kvflow.runtime.cuda_kv_pool.CudaKVPool`).
Everything runs on one CUDA stream. A step is:

1. pack its inputs into the pinned staging area; one async host-to-device copy;
2. give the execution context each input's shape and address;
3. ``execute_async_v3`` (each layer's ``kvflow::PagedAttention`` plugin reads and writes the pool
   through ``kv_cache_ptrs``);
4. one async device-to-host copy of the logits rows asked for; an event to wait for them.

A machine without a GPU fails at the first CUDA call with :class:`~.cuda_runtime.NoCudaDevice`
("no CUDA device: ..."), before TensorRT is even imported.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvflow.build.engine_config import EngineConfig
from kvflow.plugins import kv_registry
from kvflow.runtime import cuda_runtime as cuda
from kvflow.runtime.base import PoolRunner, StepInput, engine_kv_cache_dtype
from kvflow.runtime.cuda_kv_pool import CudaKVPool
from kvflow.runtime.tensorrt_buffers import BufferPlan, TensorSlot, plan_buffers

if TYPE_CHECKING:
    import tensorrt as trt

PLAN_FILE = "model.plan"


class TensorRTRunner(PoolRunner):
    """Runs an engine folder's ``model.plan`` on CUDA device ``device`` (see the module doc)."""

    name = "tensorrt"
    # NOTE: no LoRA: the plan's linears are compiled in; enable_lora refuses, naming the runner.
    supports_lora = False
    pool: CudaKVPool

    def __init__(self, engine_dir: str | Path, engine: EngineConfig, num_blocks: int,
                 num_host_blocks: int = 0, kv_cache_dtype: str | None = None,
                 device: int = 0) -> None:
        super().__init__(engine, num_blocks, num_host_blocks)
        own = engine_kv_cache_dtype(engine)
        if kv_cache_dtype not in (None, own):
            # NOTE: the plugin's Triton kernels would read another pool type, but no plan has
            # been checked with one.
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: the tensorrt runner keeps the "
                             f"KV cache in the engine's dtype ({own}); use auto, or the triton "
                             "runner")
        self.plan: BufferPlan = plan_buffers(engine.limits, engine.model)
        self._owned: list[Any] = []  # what close() frees, in reverse order
        self._stream: cuda.Stream | None = None
        self._ptrs_bound = 0
        self._device = device
        cuda.use_device(device)  # without a GPU: NoCudaDevice, here
        plan_path = Path(engine_dir) / engine.files.get("plan", PLAN_FILE)
        if not plan_path.is_file():
            raise FileNotFoundError(f"{plan_path} is missing: build the engine with --backend "
                                    "tensorrt")
        import tensorrt as trt

        from kvflow.plugins import tensorrt_plugin  # the plan's PagedAttention plugin

        self._plugin = tensorrt_plugin
        try:
            self._load(plan_path, trt)
        except BaseException:
            self.close()
            raise

    def _load(self, plan_path: Path, trt: Any) -> None:
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self._engine = self._runtime.deserialize_cuda_engine(plan_path.read_bytes())
        if self._engine is None:
            raise RuntimeError(f"TensorRT could not load {plan_path} (built for another "
                               "TensorRT or GPU?)")
        check_engine_io(self._engine, self.plan, plan_path, trt)
        self._context = self._engine.create_execution_context()
        if self._context is None:
            raise RuntimeError(f"TensorRT could not create an execution context for "
                               f"{plan_path} (out of device memory?)")
        self._stream = self._own(cuda.Stream())
        plan = self.plan
        self._staging_host = self._own(cuda.PinnedBuffer(plan.staging_nbytes))
        self._staging = self._own(cuda.DeviceBuffer(plan.staging_nbytes))
        self._logits = self._own(cuda.DeviceBuffer(plan.logits.max_nbytes))
        self._logits_host = self._own(cuda.PinnedBuffer(plan.logits.max_nbytes))
        m = self.engine.model
        pool = self.pool = self._own(CudaKVPool(
            m.num_hidden_layers, self.num_blocks, self.engine.limits.block_size,
            m.num_key_value_heads, m.head_dim, self.kv_cache_dtype, self._stream,
            self.num_host_blocks))
        # kv_cache_ptrs: written once; its host copy goes to the plugin so that no step reads
        # an address back from the device.
        ptrs = self._own(cuda.DeviceBuffer(pool.ptrs.nbytes))
        ptrs_host = self._own(cuda.PinnedBuffer(pool.ptrs.nbytes))
        ptrs_host.view(np.int64, pool.ptrs.shape)[...] = pool.ptrs
        self._stream.copy_to_device(ptrs.ptr, ptrs_host.ptr, pool.ptrs.nbytes)
        self._stream.synchronize()
        self._bind("kv_cache_ptrs", ptrs.ptr, pool.ptrs.shape)
        self._plugin.bind_pool_addresses(ptrs.ptr, pool.ptrs)
        self._ptrs_bound = ptrs.ptr
        if not self._context.set_tensor_address("logits", self._logits.ptr):
            raise RuntimeError("TensorRT refused the address of logits")

    def _own(self, resource: Any) -> Any:
        self._owned.append(resource)
        return resource

    def _bind(self, name: str, address: int, shape: tuple[int, ...]) -> None:
        if not self._context.set_input_shape(name, tuple(shape)):
            raise ValueError(f"TensorRT refused {name} of shape {tuple(shape)}: outside the "
                             "engine's optimization profile (its build limits)")
        if not self._context.set_tensor_address(name, address):
            raise RuntimeError(f"TensorRT refused the address of {name}")

    def execute(self, step: StepInput) -> np.ndarray:
        most = self.plan.logits.max_shape[0]  # the profile's most logits_indices
        num_logits = len(step.logits_indices)
        if num_logits <= most:
            return self._execute(step)
        # More rows than the plan takes (prompt logprobs): a pass per slice of rows; each
        # pass writes the step's KV again, the same values.
        return np.concatenate([
            self._execute(replace(step, logits_indices=step.logits_indices[i:i + most]))
            for i in range(0, num_logits, most)])

    def _execute(self, step: StepInput) -> np.ndarray:
        if self._stream is None:
            raise RuntimeError("the tensorrt runner is closed")
        # The engine may step on another thread than the one that built the runner; the
        # current device is per thread.
        cuda.check("cudaSetDevice", cuda.cudart.cudaSetDevice(self._device))
        packed = self.plan.pack(step, self._staging_host.array)
        self._stream.copy_to_device(self._staging.ptr, self._staging_host.ptr, packed.nbytes)
        for name, shape in packed.shapes.items():
            self._bind(name, self._staging.ptr + packed.offsets[name], shape)
        # The plugins run inside execute_async_v3, in this thread: they take the grid size
        # from the hint instead of reading query_start_loc back per layer.
        with kv_registry.step_hints(step.max_query_len):
            if not self._context.execute_async_v3(int(self._stream)):
                raise RuntimeError("TensorRT failed to run the step (see its log above)")
        vocab = self.plan.logits.max_shape[1]
        rows = len(step.logits_indices)  # none for a step of middle prefill chunks
        self._stream.copy_to_host(self._logits_host.ptr, self._logits.ptr,
                                  rows * vocab * self.plan.logits.dtype.itemsize)
        self._stream.synchronize()
        return self._logits_host.view(np.float32, (rows, vocab)).copy()

    def close(self) -> None:
        """Free the pool, the buffers and the stream (idempotent). Everything is freed even
        after a CUDA error; then the first error is raised."""
        if self._ptrs_bound:
            self._plugin.unbind_pool_addresses(self._ptrs_bound)
            self._ptrs_bound = 0
        stream, self._stream = self._stream, None
        closers = [stream.synchronize] if stream is not None and stream.handle is not None \
            else []
        closers += [resource.close for resource in reversed(self._owned)]
        self._owned = []
        # The context and the engine go before the memory they were given.
        self._context = self._engine = self._runtime = None
        cuda.close_all(closers)


def check_engine_io(engine: trt.ICudaEngine, plan: BufferPlan, plan_path: Path,
                    trt: Any) -> None:
    """Refuse a plan whose I/O tensors differ from the I/O contract in name, type or (the
    logits') vocabulary, or whose profile differs from the build limits the engine folder
    states."""
    slots: list[TensorSlot] = [*plan.inputs.values(), plan.kv_cache_ptrs, plan.logits]
    names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
    if names != {slot.name for slot in slots}:
        raise RuntimeError(f"{plan_path}: the engine's I/O tensors are {sorted(names)}; the "
                           f"I/O contract's are {sorted(slot.name for slot in slots)}")
    for slot in slots:
        trt_dtype = engine.get_tensor_dtype(slot.name)
        try:
            dtype = np.dtype(trt.nptype(trt_dtype))
        except TypeError:  # no NumPy type (bf16, fp8): not the contract's either
            dtype = None
        if dtype != slot.dtype:
            raise RuntimeError(f"{plan_path}: engine tensor {slot.name} is {trt_dtype}; the "
                               f"I/O contract says {slot.dtype}")
        if slot is plan.logits:
            shape = engine.get_tensor_shape(slot.name)
            if len(shape) != 2 or shape[1] != slot.max_shape[1]:
                raise RuntimeError(f"{plan_path}: the engine's logits are {shape}; the engine "
                                   f"folder says [num_logits, {slot.max_shape[1]}]")
            continue
        dims = engine.get_tensor_profile_shape(slot.name, 0)[2]
        most = tuple(int(dims[i]) for i in range(len(dims)))
        if most != slot.max_shape:
            raise RuntimeError(f"{plan_path}: the profile's largest {slot.name} is {most}, but "
                               f"the engine's build limits give {slot.max_shape}: rebuild it")
