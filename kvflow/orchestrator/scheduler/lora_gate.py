"""The LoRA slot limit on admission: at most ``max_loras`` distinct adapters run at once.

The runner holds ``max_loras`` adapters in its slot pool, and every token of a step must find
its adapter there, so the set of adapters among the *running* requests (a superset of any
step's) is kept within ``max_loras``. A waiting request of an adapter that is not running when
the limit is reached waits; requests of the base model need no slot and are admitted past it.

Starvation: once an admission pass has passed over a request for want of a slot, no request
of any adapter that the policy ranks after it is admitted in that pass (not even one of an
adapter already running), so the running adapters drain and a slot frees for it. Requests the
policy ranks ahead of it still go first; the policy's own bound (aging, the maximum wait)
eventually ranks the waiting one first. Pure Python.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvflow.orchestrator.request import Request


class LoraGate:
    """Running sequences per adapter name, and the admission rule over them."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.running: Counter[str] = Counter()
        # This admission pass passed over a request for want of a slot (reset each pass).
        self.blocked = False

    def admits(self, request: Request, leaving: Iterable[Request] = ()) -> bool:
        """Whether ``request`` may start running now as far as adapters go; ``leaving``:
        running sequences about to be preempted (their adapters' counts drop first)."""
        name = request.lora_name
        if name is None:
            return True
        if self.blocked:
            return False
        running = self.running
        gone = Counter(r.lora_name for r in leaving if r.lora_name is not None)
        if gone:
            running = running - gone  # NOTE: Counter subtraction drops names at zero
        return name in running or len(running) < self.max_loras

    def started(self, request: Request) -> None:
        if request.lora_name is not None:
            self.running[request.lora_name] += 1

    def stopped(self, request: Request) -> None:
        name = request.lora_name
        if name is not None:
            self.running[name] -= 1
            if not self.running[name]:
                del self.running[name]

    def check_integrity(self, running: Iterable[Request]) -> None:
        """The counts are those of ``running`` (the scheduler's), within ``max_loras``."""
        want = Counter(r.lora_name for r in running if r.lora_name is not None)
        assert self.running == want, f"LoRA running counts {self.running} != {want}"
        assert len(want) <= self.max_loras, f"{len(want)} adapters running > {self.max_loras}"
