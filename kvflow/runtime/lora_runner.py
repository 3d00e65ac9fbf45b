"""What every LoRA-serving runner shares: its slot pool (:class:`LoraPool`), loading an adapter
into a slot, the pool's size, and freeing it on close; and the ORT graph's LoRA feeds."""

from __future__ import annotations

import numpy as np

from kvflow.lora import LoraAdapter
from kvflow.runtime.base import StepInput
from kvflow.runtime.lora_pool import LoraPool
from kvflow.runtime.ort_graph_lora import LOGIT_SLOTS_INPUT, PTRS_INPUT, SLOTS_INPUT

_NO_SLOTS = np.zeros(0, np.int32)  # lora_slots of a step without adapters: LoraMatMul is a no-op


class LoraSlots:
    """Mixin of a runner with an optional LoRA slot pool ``self.lora`` (None: LoRA off)."""

    name: str
    lora: LoraPool | None = None

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        """Write ``adapter`` into pool slot ``slot`` (the modules it leaves out are zeroed)."""
        if self.lora is None:
            raise ValueError(f"the {self.name} runner has no LoRA pool: make it with "
                             "max_loras > 0 (or call enable_lora)")
        self.lora.load(slot, adapter)

    @property
    def lora_pool_bytes(self) -> int:
        """Bytes of the LoRA slot pool (0 without one)."""
        return self.lora.nbytes if self.lora is not None else 0

    def check_lora_step(self, step: StepInput) -> None:
        """Refuse a step that names LoRA slots when the runner has no pool."""
        if step.lora_slots is not None and self.lora is None:
            raise ValueError(f"the step has lora_slots but the {self.name} runner has no LoRA "
                             "pool (max_loras = 0)")

    def close_lora(self) -> None:
        """Free the pool (its arrays are unregistered: nothing may run on it again)."""
        if self.lora is not None:
            self.lora.close()
            self.lora = None


def ort_lora_feeds(pool: LoraPool, step: StepInput) -> dict[str, np.ndarray]:
    """The ORT graph's LoRA inputs (:mod:`kvflow.runtime.ort_graph_lora`) for ``step``."""
    if step.lora_slots is None:
        return {PTRS_INPUT: pool.ptrs, SLOTS_INPUT: _NO_SLOTS, LOGIT_SLOTS_INPUT: _NO_SLOTS}
    slots = step.lora_slots.astype(np.int32, copy=False)
    return {PTRS_INPUT: pool.ptrs, SLOTS_INPUT: slots,
            LOGIT_SLOTS_INPUT: slots[step.logits_indices]}
