"""The PyTorch runner: the step model executed eagerly, attention by the reference op."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvflow.build.engine_config import EngineConfig
from kvflow.model.llama import LlamaForCausalLM
from kvflow.runtime.base import PoolRunner, StepInput, kv_cache_numpy_dtype
from kvflow.runtime.kv_cache import HostKVPool

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


class TorchRunner(PoolRunner):
    """Runs :class:`LlamaForCausalLM` eagerly on the CPU over a host KV pool of
    ``kv_cache_dtype`` (``fp32`` or ``fp16``: the reference op reads it in fp32).

    ``model``: an fp32 model to run instead of the engine folder's weights (``kvflow
    check-engine``'s reference, loaded from the checkpoint the engine was built from)."""

    name = "torch"

    def __init__(self, engine_dir: str | Path, engine: EngineConfig, num_blocks: int,
                 num_host_blocks: int = 0, kv_cache_dtype: str = "fp32",
                 model: LlamaForCausalLM | None = None) -> None:
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

    @torch.inference_mode()
    def execute(self, step: StepInput) -> np.ndarray:
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
