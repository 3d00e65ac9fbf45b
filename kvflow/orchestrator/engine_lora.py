"""The engine's LoRA side: its :class:`~kvflow.orchestrator.lora_manager.LoraManager`, the
adapters' lifecycle (load, unload, list) and each step's slots. Pure Python.

:class:`LoraEngine` is a base of :class:`~kvflow.orchestrator.engine.LLMEngine`; its methods
run on the engine's thread (a served engine: through
:meth:`~kvflow.orchestrator.engine_loop.EngineLoop.call`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kvflow.orchestrator.lora_manager import LoraManager
from kvflow.orchestrator.outputs import EngineCounters, RequestError

if TYPE_CHECKING:
    from kvflow.lora.adapter import LoraAdapter
    from kvflow.orchestrator.options import EngineOptions
    from kvflow.orchestrator.scheduler.core import Scheduler
    from kvflow.orchestrator.scheduler.output import SchedulerOutput
    from kvflow.runtime.base import ModelRunner


class LoraEngine:
    """LoRA adapters on an engine: :attr:`lora` is None unless the options turn LoRA on
    (``enable_lora`` or ``lora_modules``)."""

    lora: LoraManager | None
    scheduler: Scheduler
    counters: EngineCounters

    def _init_lora(self, runner: ModelRunner, options: EngineOptions) -> None:
        """Make the slot pool and load ``lora_modules`` (an adapter that fails to load is
        an error naming it)."""
        self.lora = None
        if not options.lora_enabled:
            return
        self.lora = LoraManager(runner, runner.engine.model, options.max_loras,
                                options.max_lora_rank, self.counters)
        self.lora.running = self.scheduler.loras.running
        for name, path in options.lora_modules.items():
            try:
                self.lora.add(name, path)
            except ValueError as e:
                raise ValueError(f"lora_modules: adapter {name!r} ({path}): {e}") from e

    def read_lora(self, name: str, path: str | os.PathLike[str]) -> LoraAdapter:
        """An adapter's files read and checked for this engine (:meth:`LoraManager.read`),
        on the caller's thread: what a server does before :meth:`add_lora`, so that the engine
        loop never waits on a disk."""
        return self._loras().read(name, path)

    def add_lora(self, name: str, path: str | os.PathLike[str] | LoraAdapter) -> LoraAdapter:
        """Load an adapter at run time (:meth:`LoraManager.add`: a path, or what
        :meth:`read_lora` returned); requests may name it at once."""
        return self._loras().add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter; refused (:class:`~kvflow.orchestrator.lora_manager.
        LoraInUseError`, naming them) while requests, running or waiting, use it."""
        users = {r.parent_id for r in self.scheduler.requests.values() if r.lora_name == name}
        self._loras().remove(name, users)

    def list_loras(self) -> list[dict[str, Any]]:
        """The adapters loaded (:meth:`LoraManager.info`); [] with LoRA off."""
        return [] if self.lora is None else self.lora.info()

    def _loras(self) -> LoraManager:
        if self.lora is None:
            raise ValueError("LoRA adapters are off on this engine: start it with "
                             "enable_lora (or lora_modules)")
        return self.lora

    def lora_fields(self, lora_name: str | None) -> dict[str, Any]:
        """A new request's adapter keywords; an unknown adapter is refused naming ``model``."""
        if lora_name is None:
            return {}
        if self.lora is None:
            raise RequestError(f"model: no adapter {lora_name!r}; LoRA adapters are off on "
                               "this engine")
        return self.lora.request_fields(lora_name)

    def _lora_slots(self, sched: SchedulerOutput) -> dict[str | None, int]:
        """This step's adapters' slots (loading what is not resident); base: absent."""
        if self.lora is None:
            return {}
        names = {s.request.lora_name for s in sched.scheduled}
        names.discard(None)
        return self.lora.slots_for(names)  # type: ignore[arg-type,return-value]
