"""The LoRA adapters an engine serves, and the runner's slot pool they take turns in. Pure Python.

Adapters are read once (:func:`kvflow.lora.adapter.load_lora_adapter`) and kept on the host:
they are small (a rank-16 adapter of a 1B model is tens of MB). The runner holds ``max_loras``
of them in its slot pool (:meth:`~kvflow.runtime.base.ModelRunner.load_lora`); a step's tokens
each name a slot (``StepInput.lora_slots``). Before each step :meth:`LoraManager.slots_for`
makes the step's adapters resident: one not in a slot goes into a free one or takes the slot
of the least recently used adapter that no running request uses (an *eviction*; every load
into a slot is a *swap*). The scheduler keeps the running adapters within ``max_loras``
(:mod:`~kvflow.orchestrator.scheduler.lora_gate`), so such a slot always exists.

Each name keeps one ``lora_id`` (1-based, Dynamo's) for the engine's life, across unload and
load. Requests under an adapter key their prefix-cache blocks by its digest
(:func:`~kvflow.kv_manager.block_pool.block_extra`).
"""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kvflow.lora import LoraAdapter, load_lora_adapter
from kvflow.lora.adapter import check_lora_name
from kvflow.orchestrator.outputs import EngineCounters, RequestError

if TYPE_CHECKING:
    from kvflow.model.config import ModelConfig
    from kvflow.runtime.base import ModelRunner

NO_SLOT = -1  # a token of the base model


class LoraInUseError(ValueError):
    """An adapter cannot be unloaded: requests (running or waiting) use it; the message names
    them."""


class LoraManager:
    """The adapters loaded (by name), their slots in the runner's pool, and the counts.

    Args:
        runner: its slot pool is made here (``enable_lora(max_loras, max_rank)``).
        config: the base model the adapters must fit.
        max_loras: slots in the pool (adapters resident at once).
        max_rank: the largest adapter rank the pool holds.
        counters: where the swaps and evictions are counted (the engine's; default: own).
    """

    def __init__(self, runner: ModelRunner, config: ModelConfig, max_loras: int,
                 max_rank: int, counters: EngineCounters | None = None) -> None:
        if not runner.supports_lora:
            raise ValueError(f"LoRA adapters cannot run on the {runner.name} runner; use "
                             "onnxruntime, torch or triton")
        self.runner, self.config = runner, config
        self.max_loras, self.max_rank = max_loras, max_rank
        self.counters = counters if counters is not None else EngineCounters()
        self.adapters: dict[str, LoraAdapter] = {}  # loaded, by name, in load order
        self._ids: dict[str, int] = {}  # every name ever loaded -> its lora_id (never reused)
        self._slots: list[str | None] = [None] * max_loras  # slot -> resident adapter
        self._lru: OrderedDict[str, int] = OrderedDict()  # resident name -> slot, LRU first
        # Running sequences per adapter: the scheduler's counts (the engine wires them).
        self.running: Mapping[str, int] = {}
        runner.enable_lora(max_loras, max_rank)

    # --- lifecycle ----------------------------------------------------------------------------
    def read(self, name: str, path: str | os.PathLike[str]) -> LoraAdapter:
        """The adapter at ``path`` read and checked for this model, changing nothing: safe on
        any thread, so that a server reads a large adapter off the engine's thread and hands
        :meth:`add` the result (:class:`~kvflow.lora.adapter.LoraAdapterError` if it does
        not fit)."""
        return load_lora_adapter(name, path, self.config, self.max_rank)

    def add(self, name: str, path: str | os.PathLike[str] | LoraAdapter) -> LoraAdapter:
        """Load the adapter at ``path`` as ``name`` (a PEFT folder or a GGUF LoRA file; or one
        :meth:`read` returned).

        Refused with a ValueError naming the problem: a name loaded already, an empty one, or
        an adapter that does not fit (:class:`~kvflow.lora.adapter.LoraAdapterError`: its
        rank over ``max_rank``, a shape of another model...). Nothing changes then. Into a
        free slot at once, if there is one (so a runner's refusal shows here, not mid-step).
        """
        check_lora_name(name)
        if name in self.adapters:
            raise ValueError(f"lora_name {name!r} is loaded already (from "
                             f"{self.adapters[name].path}); unload it first")
        adapter = (dataclasses.replace(path, name=name) if isinstance(path, LoraAdapter)
                   else self.read(name, path))
        if None in self._slots:
            self._load(self._slots.index(None), adapter)
        self.adapters[name] = adapter
        self._ids.setdefault(name, len(self._ids) + 1)
        return adapter

    def remove(self, name: str, users: Collection[str] = ()) -> None:
        """Unload adapter ``name``; ``users``: the ids of the unfinished requests under it (the
        engine's), which refuse it (:class:`LoraInUseError` naming them)."""
        if name not in self.adapters:
            raise ValueError(f"lora_name {name!r} is not loaded; loaded: {self.names()}")
        if users:
            raise LoraInUseError(f"lora_name {name!r} is in use by request(s) "
                                 f"{sorted(users)}; unload it once they finish")
        del self.adapters[name]
        slot = self._lru.pop(name, None)
        if slot is not None:  # nothing reads the slot now; the next load overwrites it
            self._slots[slot] = None

    # --- lookups ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """The adapters loaded, in load order."""
        return list(self.adapters)

    def lora_id(self, name: str) -> int:
        """The stable 1-based id of adapter ``name`` (Dynamo's ``lora_id``)."""
        return self._ids[name]

    def get(self, name: str) -> LoraAdapter:
        """The loaded adapter ``name``; a request naming another is refused (a
        :class:`RequestError` on the field ``model``, as the OpenAI API selects adapters)."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise RequestError(f"model: no adapter {name!r}; loaded: {self.names()}")
        return adapter

    def request_fields(self, name: str | None) -> dict[str, Any]:
        """The :class:`~kvflow.orchestrator.request.Request` keywords of a request under
        adapter ``name`` (None: the base model)."""
        if name is None:
            return {}
        adapter = self.get(name)
        return {"lora_name": name, "lora_id": self._ids[name], "lora_digest": adapter.digest}

    @property
    def num_resident(self) -> int:
        """Adapters in a slot now."""
        return len(self._lru)

    @property
    def swaps(self) -> int:
        """Loads of an adapter into a slot, ever."""
        return self.counters.lora_swaps

    @property
    def evictions(self) -> int:
        """Loads that displaced a resident adapter, ever."""
        return self.counters.lora_evictions

    def known_names(self) -> list[str]:
        """Every name ever loaded (the metrics' label values)."""
        return list(self._ids)

    def info(self) -> list[dict[str, Any]]:
        """One entry per loaded adapter: ``name``, ``path``, ``rank``, ``lora_id``,
        ``resident``, ``slot`` (-1: none), ``running`` (sequences running under it)."""
        return [{"name": n, "path": a.path, "rank": a.rank, "lora_id": self._ids[n],
                 "resident": n in self._lru, "slot": self._lru.get(n, NO_SLOT),
                 "running": self.running.get(n, 0)} for n, a in self.adapters.items()]

    # --- the step -----------------------------------------------------------------------------
    def slots_for(self, names: Iterable[str]) -> dict[str, int]:
        """Each of this step's adapters' slot, loading the ones not resident (LRU eviction
        among those no running request and no request of this step uses)."""
        slots: dict[str, int] = {}
        wanted = set(names)
        for name in wanted:
            slot = self._lru.get(name)
            if slot is None:
                slot = self._free_slot(wanted)
                self._load(slot, self.adapters[name])
            else:
                self._lru.move_to_end(name)
            slots[name] = slot
        return slots

    def _free_slot(self, wanted: Collection[str]) -> int:
        if None in self._slots:
            return self._slots.index(None)
        for name, slot in self._lru.items():  # least recently used first
            if name not in wanted and not self.running.get(name):
                del self._lru[name]
                self._slots[slot] = None
                self.counters.lora_evictions += 1
                return slot
        # NOTE: the scheduler's LoraGate keeps the running adapters within max_loras.
        raise RuntimeError(f"no LoRA slot free for this step: {self.max_loras} slots held by "
                           f"running adapters {list(self._lru)}")

    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        self.runner.load_lora(slot, adapter)
        self._slots[slot] = adapter.name
        self._lru[adapter.name] = slot
        self.counters.lora_swaps += 1

    def check_integrity(self) -> None:
        """The slot table and the LRU agree; every running adapter is loaded, and they fit the
        slots. (A running adapter need not be resident yet: the static scheduler starts
        requests a step may not reach; :meth:`slots_for` loads it on the step that runs it.)"""
        assert {n: s for s, n in enumerate(self._slots) if n is not None} == dict(self._lru), \
            (self._slots, self._lru)
        assert set(self._lru) <= set(self.adapters), "a resident adapter is not loaded"
        running = {n for n, k in self.running.items() if k}
        assert running <= set(self.adapters), f"running adapters not loaded: {running}"
        assert len(running) <= len(self._slots), \
            f"{len(running)} adapters running, {len(self._slots)} slots"
