"""The PyTorch runner: the step model executed eagerly, attention by the reference op."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvflow.build.engine_config import EngineConfig
from kvflow.model.llama import LlamaForCausalLM
from kvflow.model.lora_hooks import add_lora_hooks
from kvflow.plugins.lora_torch import Segments, lora_apply, slot_segments
from kvflow.runtime.base import PoolRunner, StepInput, kv_cache_numpy_dtype
from kvflow.runtime.kv_cache import HostKVPool
from kvflow.runtime.lora_pool import LoraPool, module_groups
from kvflow.runtime.lora_runner import LoraSlots

WEIGHTS_FILE = "weights.safetensors"


def load_model(engine_dir: Path, engine: EngineConfig) -> LlamaForCausalLM:
    """Build the step model of an engine folder and load its weights."""
    from safetensors.torch import load_file

    weights = engine_dir / engine.files.get("weights", WEIGHTS_FILE)
    if not weights.is_file():
        raise FileNotFoundError(
            f"{weights} is missing: the PyTorch runner needs an engine built with "
            "--backend torch"
        )
    model = LlamaForCausalLM(engine.model, engine.limits.block_size, engine.limits.max_model_len)
    model.load_hf_state_dict(load_file(str(weights)))
    return model.eval()


class TorchRunner(LoraSlots, PoolRunner):
    """Runs :class:`LlamaForCausalLM` eagerly on the CPU over a host KV pool of
    ``kv_cache_dtype`` (``fp32`` or ``fp16``: the reference op reads it in fp32).

    ``model``: an fp32 model to run instead of the engine folder's weights (``kvflow
    check-engine``'s reference, loaded from the checkpoint the engine was built from).
    ``max_loras`` > 0: a LoRA slot pool of that many adapters of rank up to ``max_lora_rank``
    (:meth:`enable_lora`), applied by forward hooks on the model's linears
    (:func:`kvflow.plugins.lora_torch.lora_apply`)."""

    name = "torch"
    supports_lora = True

    def __init__(self, engine_dir: str | Path, engine: EngineConfig, num_blocks: int,
                 num_host_blocks: int = 0, kv_cache_dtype: str = "fp32",
                 model: LlamaForCausalLM | None = None, max_loras: int = 0,
                 max_lora_rank: int = 16) -> None:
        super().__init__(engine, num_blocks, num_host_blocks)
        kv_dtype = kv_cache_numpy_dtype(kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_dtype
        if model is None and engine.dtype != "float32":
            raise ValueError(f"the torch runner computes in float32 on the CPU; this engine is "
                             f"{engine.dtype}: run it with --runner triton (a CUDA GPU)")
        self.model = model.eval() if model is not None else load_model(Path(engine_dir), engine)
        m = engine.model
        self.pool = HostKVPool(m.num_hidden_layers, num_blocks, engine.limits.block_size,
                               m.num_key_value_heads, m.head_dim, kv_dtype, num_host_blocks)
        self._ptrs = torch.from_numpy(self.pool.ptrs)
        self.lora: LoraPool | None = None
        self._lora_hooks: list = []
        self._segments: Segments = []  # the running step's tokens by LoRA slot
        if max_loras:
            self.enable_lora(max_loras, max_lora_rank)

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        """The slot pool (one group per module) and the hooks that apply it."""
        if self.lora is not None:
            if (self.lora.max_loras, self.lora.max_rank) == (max_loras, max_rank):
                return
            raise ValueError(f"the torch runner's LoRA pool is {self.lora.max_loras} slots of "
                             f"rank {self.lora.max_rank} already; it cannot change")
        m = self.engine.model
        self.lora = LoraPool(module_groups(m), m.num_hidden_layers, max_loras, max_rank)
        pool = self.lora
        views = {(i, g): (torch.from_numpy(pool.a[g][i][:, 0]), torch.from_numpy(pool.bt[g][i]),
                          pool.ranks[g][i][:, 0])
                 for g in pool.groups for i in range(m.num_hidden_layers)}

        def delta(layer: int, module: str, x: torch.Tensor, y: torch.Tensor):
            if not self._segments:
                return None
            a, bt, ranks = views[layer, module]
            return lora_apply(y, x, a, bt, self._segments, ranks)

        self._lora_hooks = add_lora_hooks(self.model, delta)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> np.ndarray:
        self.check_lora_step(step)
        self._segments = slot_segments(step.lora_slots) if step.lora_slots is not None else []
        try:
            return self._run(step)
        finally:
            self._segments = []

    def _run(self, step: StepInput) -> np.ndarray:
        logits = self.model(
            torch.from_numpy(step.input_ids),
            torch.from_numpy(step.positions),
            self._ptrs,
            torch.from_numpy(step.slot_mapping),
            torch.from_numpy(step.block_tables),
            torch.from_numpy(step.seq_lens),
            torch.from_numpy(step.query_start_loc),
            torch.from_numpy(step.logits_indices),
        )
        return logits.numpy()

    def close(self) -> None:
        for handle in self._lora_hooks:
            handle.remove()
        self._lora_hooks = []
        self.close_lora()
        super().close()
