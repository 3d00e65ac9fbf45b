"""The simulated model: a runner whose step costs what a cost model says, on a clock that only
the simulation moves. It receives the same :class:`~kvflow.runtime.base.StepInput` a real
runner receives and always samples :data:`SIM_TOKEN`, so every request produces exactly its
requested output length."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvflow.build.engine_config import BuildLimits, EngineConfig
from kvflow.model.config import ModelConfig
from kvflow.runtime.base import ModelRunner, StepInput
from kvflow.sim.cost_model import CostModel, StepShape

SIM_VOCAB = 8  # the simulated model's logits: small, since no token is ever read
SIM_EOS = SIM_VOCAB - 1
SIM_TOKEN = 0  # the token the simulated model always samples (greedy over its logits)


class SimClock:
    """Simulated seconds; only the simulation moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimRunner(ModelRunner):
    """Costs each step by the cost model, advances the clock, returns logits favouring
    :data:`SIM_TOKEN`."""

    name = "sim"
    reads_token_ids = False
    needs_inputs = False  # the cost model reads the step's shape alone

    def __init__(self, engine: EngineConfig, num_blocks: int, cost: CostModel,
                 clock: SimClock) -> None:
        super().__init__(engine, num_blocks)
        self.cost, self.clock = cost, clock
        self._logits = np.zeros((1, SIM_VOCAB), dtype=np.float32)
        self._logits[:, SIM_TOKEN] = 1.0

    # LoRA: requests may carry adapters (the scheduler's slot limit and the adapters' swaps
    # run as served); the simulated model computes nothing, so loads and slots are free.
    supports_lora = True

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        """No pool to make: the simulated model computes nothing."""

    def load_lora(self, slot: int, adapter: Any) -> None:
        """Nothing to write (a load's time is not modelled)."""

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Nothing to copy: the simulated pool holds no data (a copy's time is not modelled)."""

    def execute(self, step: StepInput) -> np.ndarray:
        self.clock.now += self.cost.step_time_s(StepShape.of(step))
        return np.repeat(self._logits, len(step.logits_indices), axis=0)

    def execute_argmax(self, step: StepInput) -> np.ndarray:
        """The argmax of :meth:`execute`'s logits, without building them."""
        self.clock.now += self.cost.step_time_s(StepShape.of(step))
        return np.full(len(step.logits_indices), SIM_TOKEN, dtype=np.int64)


def sim_engine_config(block_size: int, max_model_len: int, max_num_tokens: int,
                      max_batch_size: int) -> EngineConfig:
    """An engine config for a model the simulator never runs (only its KV layout matters)."""
    model = ModelConfig(architecture="llama", vocab_size=SIM_VOCAB, hidden_size=8,
                        intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                        num_key_value_heads=1, head_dim=8, eos_token_ids=(SIM_EOS,))
    limits = BuildLimits(max_model_len, max(max_num_tokens, block_size), max_batch_size,
                         block_size)
    return EngineConfig(model, "torch", "float32", limits, {"name": "simulated"}, {})
