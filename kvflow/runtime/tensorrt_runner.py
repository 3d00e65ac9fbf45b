"""The TensorRT runner: a built plan executed with ``execute_async_v3``, tensor addresses bound
per step.

Each step's inputs are copied to the GPU as torch tensors, their shapes set on the execution
context and their addresses bound; the logits buffer is allocated for the step's
``num_logits``. The KV pool is a :class:`~kvflow.runtime.triton_runner.DeviceKVPool` whose
addresses go in ``kv_cache_ptrs``, which stays on the GPU for the engine's lifetime (and whose
host copy the plugin is given, so a step reads no address back from the device).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import tensorrt as trt
import torch

from kvflow.build.engine_config import EngineConfig
from kvflow.plugins import kv_registry
from kvflow.runtime.base import PoolRunner, StepInput, engine_kv_cache_dtype
from kvflow.runtime.triton_runner import TORCH_DTYPES, DeviceKVPool

PLAN_FILE = "model.plan"


class TensorRTRunner(PoolRunner):
    """Runs an engine folder's ``model.plan`` on the current CUDA device."""

    name = "tensorrt"

    def __init__(self, engine_dir: str | Path, engine: EngineConfig, num_blocks: int,
                 num_host_blocks: int = 0, kv_cache_dtype: str | None = None) -> None:
        from kvflow.plugins import tensorrt_plugin  # the plan's PagedAttention plugin

        super().__init__(engine, num_blocks, num_host_blocks)
        own = engine_kv_cache_dtype(engine)
        if kv_cache_dtype not in (None, own):
            # NOTE: the plugin's Triton kernels would read another pool type, but no plan has
            # been checked with one.
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: the tensorrt runner keeps the "
                             f"KV cache in the engine's dtype ({own}); use auto, or the triton "
                             "runner")
        plan = Path(engine_dir) / engine.files.get("plan", PLAN_FILE)
        if not plan.is_file():
            raise FileNotFoundError(f"{plan} is missing: build the engine with --backend "
                                    "tensorrt")
        self._plugin = tensorrt_plugin
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self._engine = self._runtime.deserialize_cuda_engine(plan.read_bytes())
        if self._engine is None:
            raise RuntimeError(f"TensorRT could not load {plan} (built for another TensorRT "
                               "or GPU?)")
        if self._engine.get_tensor_dtype("logits") != trt.DataType.FLOAT:
            raise RuntimeError(f"{plan}: the engine's logits are not float32 (the I/O contract)")
        self._context = self._engine.create_execution_context()
        m = engine.model
        self.pool = DeviceKVPool(m.num_hidden_layers, num_blocks, engine.limits.block_size,
                                 m.num_key_value_heads, m.head_dim, TORCH_DTYPES[engine.dtype],
                                 torch.device("cuda"), num_host_blocks)
        self._ptrs = self.pool.ptrs.cuda()
        tensorrt_plugin.bind_pool_addresses(self._ptrs)
        self._stream = torch.cuda.Stream()

    def execute(self, step: StepInput) -> np.ndarray:
        most = self.engine.limits.max_batch_size  # the profile's most logits_indices
        num_logits = len(step.logits_indices)
        if num_logits <= most:
            return self._execute(step)
        # More rows than the plan takes (prompt logprobs): a pass per slice of rows; each
        # pass writes the step's KV again, the same values.
        return np.concatenate([
            self._execute(replace(step, logits_indices=step.logits_indices[i:i + most]))
            for i in range(0, num_logits, most)])

    @torch.inference_mode()
    def _execute(self, step: StepInput) -> np.ndarray:
        num_logits = len(step.logits_indices)
        inputs = {
            "input_ids": step.input_ids, "positions": step.positions,
            "slot_mapping": step.slot_mapping, "block_tables": step.block_tables,
            "seq_lens": step.seq_lens, "query_start_loc": step.query_start_loc,
            # A step of middle prefill chunks samples nothing, but the profile's smallest
            # logits_indices is one row: ask for row 0 and return none.
            "logits_indices": step.logits_indices if num_logits else np.zeros(1, np.int64),
        }
        # Swaps (DeviceKVPool) copy on the current stream; this stream must see them.
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            bound = {name: torch.from_numpy(np.ascontiguousarray(a)).cuda(non_blocking=True)
                     for name, a in inputs.items()}
            bound["kv_cache_ptrs"] = self._ptrs
            for name, tensor in bound.items():
                if not self._context.set_input_shape(name, tuple(tensor.shape)):
                    raise ValueError(f"TensorRT refused {name} of shape {tuple(tensor.shape)}: "
                                     "outside the engine's optimization profile (its build "
                                     "limits)")
                if not self._context.set_tensor_address(name, tensor.data_ptr()):
                    raise RuntimeError(f"TensorRT refused the address of {name}")
            logits = torch.empty((len(inputs["logits_indices"]), self.engine.model.vocab_size),
                                 dtype=torch.float32, device="cuda")
            if not self._context.set_tensor_address("logits", logits.data_ptr()):
                raise RuntimeError("TensorRT refused the address of logits")
            # The plugins run inside execute_async_v3, in this thread: they take the grid
            # size from the hint instead of reading query_start_loc back per layer.
            with kv_registry.step_hints(step.max_query_len):
                if not self._context.execute_async_v3(self._stream.cuda_stream):
                    raise RuntimeError("TensorRT failed to run the step")
            result = logits[:num_logits].cpu()  # synchronizes the stream
        return result.numpy()

    def close(self) -> None:
        self._plugin.unbind_pool_addresses(self._ptrs)
        super().close()
