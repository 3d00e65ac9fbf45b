"""The PyTorch + OpenAI Triton runner: the step model on a device pool, attention by the
Triton kernels.

On a CUDA GPU this is kvflow's CUDA runner: weights and the KV pool on the GPU, the model in
PyTorch, each layer's PagedAttention launching the Triton kernels on the pool. Without CUDA it
runs on the host with the kernels in Triton's interpreter (``TRITON_INTERPRET=1``), slowly,
which is how CI checks the wiring against the other runners.

Decode steps replay CUDA graphs captured per batch-size bucket (:mod:`.cuda_graphs`); prefill
and mixed steps run eagerly, and so do steps with LoRA adapters (``max_loras`` > 0: a slot pool
on the device, applied to the model's linears by hooks that launch
:mod:`kvflow.plugins.lora_triton`'s kernels; without adapters in the step they do nothing).
Either way the runner tells the kernels the step's ``max_query_len``
(``kv_registry.step_hints``), so no layer reads it back from the GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from kvflow.build.engine_config import EngineConfig
from kvflow.lora import LoraAdapter
from kvflow.model.llama import LlamaForCausalLM
from kvflow.model.lora_hooks import add_lora_hooks
from kvflow.plugins import kv_registry
from kvflow.runtime.base import PoolRunner, StepInput, check_payloads, engine_kv_cache_dtype
from kvflow.runtime.cuda_graphs import DecodeGraphs, decode_batch_sizes
from kvflow.runtime.lora_pool import LoraPool, module_groups
from kvflow.runtime.lora_runner import LoraSlots
from kvflow.runtime.torch_runner import load_model

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# kv_cache_dtype names (kvflow.runtime.base.KV_CACHE_DTYPE_BYTES) as torch types.
KV_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class DeviceKVPool:
    """Per-layer K and V tensors ``[num_blocks, block_size, num_kv_heads, head_dim]`` on a
    device, registered by address; a host swap space of the same layout and type (pinned on
    CUDA). The Triton kernels cast new K/V to the pool's type as they write it. Blocks leave
    and return as bytes for the KV tiers (:meth:`read_blocks`, :meth:`write_blocks`) in the
    host pool's payload layout."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 num_host_blocks: int = 0) -> None:
        names = {v: k for k, v in KV_TORCH_DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"a device KV pool holds one of {tuple(names)}, got {dtype}")
        self.kv_cache_dtype = names[dtype]
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.ptrs = torch.tensor([[kv_registry.register_device(k),
                                   kv_registry.register_device(v)]
                                  for k, v in zip(self.k, self.v, strict=True)],
                                 dtype=torch.int64).reshape(num_layers, 2)
        pin = device.type == "cuda"
        host_shape = (num_host_blocks + 1, *shape[1:]) if num_host_blocks else (0, *shape[1:])
        self.host_k = [torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
                       for _ in range(num_layers)]
        self.host_v = [torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
                       for _ in range(num_layers)]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """``(device_block, host_block)`` copies, every layer, K and V."""
        src, dst = (torch.tensor(x) for x in zip(*pairs, strict=True))
        for k, v, hk, hv in zip(self.k, self.v, self.host_k, self.host_v, strict=True):
            hk[dst] = k[src.to(k.device)].cpu()
            hv[dst] = v[src.to(v.device)].cpu()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """``(host_block, device_block)`` copies, every layer, K and V."""
        src, dst = (torch.tensor(x) for x in zip(*pairs, strict=True))
        for k, v, hk, hv in zip(self.k, self.v, self.host_k, self.host_v, strict=True):
            k[dst.to(k.device)] = hk[src].to(k.device, non_blocking=True)
            v[dst.to(v.device)] = hv[src].to(v.device, non_blocking=True)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """``(src, dst)`` device-block copies, every layer, K and V (destinations distinct)."""
        src, dst = (torch.tensor(x) for x in zip(*pairs, strict=True))
        for k, v in zip(self.k, self.v, strict=True):
            s, d = src.to(k.device), dst.to(k.device)
            k[d] = k[s]
            v[d] = v[s]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's payload: every layer's K and V (:meth:`read_blocks`)."""
        return 2 * sum(k[0].nbytes for k in self.k)

    def _block_index(self, block_ids: list[int]) -> torch.Tensor:
        if not self.k:
            raise RuntimeError("this KV pool is closed")
        num_blocks = self.k[0].shape[0]
        for b in block_ids:  # NOTE: an index past the pool is a device-side assert on CUDA
            if not 0 <= b < num_blocks:
                raise ValueError(f"block {b} is not in the pool's {num_blocks} blocks")
        return torch.tensor(block_ids, dtype=torch.int64, device=self.k[0].device)

    def _steps_stream_sync(self) -> None:
        # The steps run on the current stream: waiting for it means every queued copy is done.
        if self.k[0].device.type == "cuda":
            torch.cuda.current_stream(self.k[0].device).synchronize()

    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Each block's KV as bytes, in the pool's dtype: layer 0's K, layer 0's V, layer 1's
        K, ... (each ``[block_size, num_kv_heads, head_dim]``, C order): the host pool's
        payload. One gather per layer's K and V and one copy to (pinned) host memory, waited
        for before returning, so the block may be overwritten as soon as this returns."""
        if not block_ids:
            return []
        idx = self._block_index(block_ids)
        gathered = torch.stack([a.index_select(0, idx) for k, v in zip(self.k, self.v,
                                                                       strict=True)
                                for a in (k, v)], dim=1)  # [blocks, 2 * layers, ...]
        if gathered.device.type == "cuda":
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            self._steps_stream_sync()
        else:
            host = gathered
        # NOTE: bytes through uint8: NumPy has no bfloat16.
        rows = host.reshape(len(block_ids), -1).view(torch.uint8).numpy()
        return [row.tobytes() for row in rows]

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Write :meth:`read_blocks` payloads into ``block_ids`` (every layer, K and V): one
        copy to the device, then one indexed write per layer's K and V, queued on the steps'
        stream (so the next step reads them)."""
        size = self.block_nbytes
        check_payloads(block_ids, payloads, size)
        if not block_ids:
            return
        idx = self._block_index(block_ids)
        device = self.k[0].device
        host = torch.empty((len(payloads), size), dtype=torch.uint8,
                           pin_memory=device.type == "cuda")
        rows = host.numpy()
        for row, payload in zip(rows, payloads, strict=True):
            row[:] = np.frombuffer(payload, dtype=np.uint8)
        # NOTE: the host allocator keeps pinned memory until the queued copy from it is done.
        staged = host.to(device, non_blocking=True).view(self.k[0].dtype).reshape(
            len(payloads), 2 * len(self.k), *self.k[0].shape[1:])
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            k.index_put_((idx,), staged[:, 2 * i])
            v.index_put_((idx,), staged[:, 2 * i + 1])

    def close(self) -> None:
        for t in (*self.k, *self.v):
            kv_registry.unregister_device(t)
        self.k, self.v, self.host_k, self.host_v = [], [], [], []


class TritonRunner(LoraSlots, PoolRunner):
    """:class:`LlamaForCausalLM` on ``device`` (CUDA when there is one), PagedAttention by the
    Triton kernels over a device KV pool. Needs an engine built with ``--backend torch``.

    ``cuda_graphs``: replay decode steps of up to the engine's ``max_batch_size`` sequences
    from CUDA graphs (default: on a CUDA device). True without CUDA runs the graphs' padded
    static buffers eagerly, which is how CI checks them. ``kv_cache_dtype``: the pool's type
    (``fp32``, ``fp16`` or ``bf16``; None: the engine's own); the kernels multiply in it and
    sum in fp32. ``max_loras`` > 0: a LoRA slot pool (:meth:`enable_lora`).
    """

    pool: DeviceKVPool

    name = "triton"
    supports_lora = True

    def __init__(self, engine_dir: str | Path | None, engine: EngineConfig, num_blocks: int,
                 num_host_blocks: int = 0, device: str | None = None,
                 model: LlamaForCausalLM | None = None, cuda_graphs: bool | None = None,
                 kv_cache_dtype: str | None = None, max_loras: int = 0,
                 max_lora_rank: int = 16) -> None:
        super().__init__(engine, num_blocks, num_host_blocks)
        kv_name = kv_cache_dtype or engine_kv_cache_dtype(engine)
        if kv_name not in KV_TORCH_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_name!r}: the triton runner's pool holds one "
                             f"of {tuple(KV_TORCH_DTYPES)}")
        self.kv_cache_dtype = kv_name
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the triton runner needs a CUDA GPU, or TRITON_INTERPRET=1 to run "
                               "its kernels in Triton's interpreter on the CPU (slowly)")
        dtype = TORCH_DTYPES[engine.dtype]
        if model is None:
            if engine_dir is None:
                raise ValueError("give an engine folder or a model")
            model = load_model(Path(engine_dir), engine)
        self.model = model.eval().to(self.device)
        for param in self.model.parameters():  # NOTE: the RoPE tables (buffers) stay fp32
            param.data = param.data.to(dtype)
        m = engine.model
        self.pool = DeviceKVPool(m.num_hidden_layers, num_blocks, engine.limits.block_size,
                                 m.num_key_value_heads, m.head_dim, KV_TORCH_DTYPES[kv_name],
                                 self.device,
                                 num_host_blocks)
        self._lora_dev: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._lora_hooks: list = []
        self._lora_slots: torch.Tensor | None = None  # the running step's, on the device
        self.graphs: DecodeGraphs | None = None
        # Decode graphs with the LoRA kernels in them, reading each row's slot from a static
        # buffer (the step's slots, padding rows -1); base decode steps replay self.graphs.
        self.lora_graphs: DecodeGraphs | None = None
        if max_loras:
            try:
                self.enable_lora(max_loras, max_lora_rank)
            except BaseException:
                self.close()
                raise
        if cuda_graphs if cuda_graphs is not None else self.device.type == "cuda":
            lim = engine.limits
            sizes = decode_batch_sizes(lim.max_batch_size)
            self._graph_slots = torch.full((sizes[-1],), -1, dtype=torch.int32,
                                           device=self.device)
            try:
                with torch.inference_mode():
                    self.graphs = DecodeGraphs(self._forward, self.device, sizes,
                                               -(-lim.max_model_len // lim.block_size),
                                               capture=self.device.type == "cuda")
                    if self.lora is not None:
                        self.lora_graphs = DecodeGraphs(
                            self._lora_graph_forward, self.device, sizes,
                            -(-lim.max_model_len // lim.block_size),
                            capture=self.device.type == "cuda")
            except BaseException:
                self.close()  # the pools are not leaked by a failed capture
                raise

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        """A slot pool (one group per module) mirrored on the device, and the hooks that apply
        it. Called after the runner was made (no ``max_loras``), its decode graphs stay
        base-only and steps with adapters run eagerly."""
        if self.lora is not None:
            if (self.lora.max_loras, self.lora.max_rank) == (max_loras, max_rank):
                return
            raise ValueError(f"the triton runner's LoRA pool is {self.lora.max_loras} slots of "
                             f"rank {self.lora.max_rank} already; it cannot change")
        from kvflow.plugins.lora_triton import lora_apply_triton

        m = self.engine.model
        self.lora = LoraPool(module_groups(m), m.num_hidden_layers, max_loras, max_rank)
        pool = self.lora
        self._lora_dev = {g: (torch.from_numpy(pool.a[g][:, :, 0]).to(self.device),
                              torch.from_numpy(pool.bt[g]).to(self.device),
                              torch.from_numpy(pool.ranks[g][:, :, 0].copy()).to(self.device))
                          for g in pool.groups}

        def delta(layer: int, module: str, x: torch.Tensor, y: torch.Tensor):
            if self._lora_slots is None:
                return None
            a, bt, ranks = self._lora_dev[module]
            return lora_apply_triton(y, x, a[layer], bt[layer], ranks[layer], self._lora_slots)

        self._lora_hooks = add_lora_hooks(self.model, delta)

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        super().load_lora(slot, adapter)
        assert self.lora is not None
        for g, (a, bt, ranks) in self._lora_dev.items():
            a[:, slot] = torch.from_numpy(self.lora.a[g][:, slot, 0]).to(self.device)
            bt[:, slot] = torch.from_numpy(self.lora.bt[g][:, slot]).to(self.device)
            ranks[:, slot] = torch.from_numpy(self.lora.ranks[g][:, slot, 0]).to(self.device)

    @classmethod
    def from_model(cls, engine: EngineConfig, model: LlamaForCausalLM, num_blocks: int,
                   device: str | None = None, cuda_graphs: bool | None = None,
                   ) -> TritonRunner:
        """A runner over an in-memory model (benchmarks with random weights)."""
        return cls(None, engine, num_blocks, device=device, model=model,
                   cuda_graphs=cuda_graphs)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self.pool.ptrs, slot_mapping, block_tables,
                          seq_lens, query_start_loc, logits_indices)

    def _lora_graph_forward(self, input_ids: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        # NOTE: under capture this runs once per bucket: its kernels keep reading the buffer.
        self._lora_slots = self._graph_slots[: input_ids.shape[0]]
        try:
            return self._forward(input_ids, *rest)
        finally:
            self._lora_slots = None

    @torch.inference_mode()
    def execute(self, step: StepInput) -> np.ndarray:
        self.check_lora_step(step)
        if step.lora_slots is not None and self.lora_graphs is not None:
            bucket = self.lora_graphs.bucket(step)
            if bucket is not None:
                n = step.num_seqs
                self._graph_slots[:n].copy_(torch.from_numpy(step.lora_slots.astype(np.int32)))
                self._graph_slots[n:].fill_(-1)
                return self.lora_graphs.run(step, bucket).cpu().numpy()
        if step.lora_slots is not None:
            self._lora_slots = torch.from_numpy(step.lora_slots.astype(np.int32)).to(self.device)
            try:
                return self.execute_eager(step)
            finally:
                self._lora_slots = None
        bucket = self.graphs.bucket(step) if self.graphs is not None else None
        if bucket is not None:
            assert self.graphs is not None
            return self.graphs.run(step, bucket).cpu().numpy()
        return self.execute_eager(step)

    @torch.inference_mode()
    def execute_eager(self, step: StepInput) -> np.ndarray:
        """Run a step by launching its kernels one by one, never from a graph (what
        :meth:`execute` does for prefill and mixed steps; benchmarks time both)."""

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        with kv_registry.step_hints(step.max_query_len):
            logits = self._forward(dev(step.input_ids), dev(step.positions),
                                   dev(step.slot_mapping), dev(step.block_tables),
                                   dev(step.seq_lens), dev(step.query_start_loc),
                                   dev(step.logits_indices))
        return logits.float().cpu().numpy()

    def close(self) -> None:
        for graphs in (self.graphs, self.lora_graphs):
            if graphs is not None:
                graphs.close()
        self.graphs = self.lora_graphs = None
        for handle in self._lora_hooks:
            handle.remove()
        self._lora_hooks, self._lora_dev = [], {}
        self.close_lora()
        super().close()
