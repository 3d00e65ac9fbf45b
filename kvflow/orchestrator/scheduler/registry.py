"""The scheduler class for each policy name, and :func:`make_scheduler`. Pure Python.

Every queue policy of :mod:`~kvflow.orchestrator.scheduler.policies` runs under continuous
batching (:class:`~kvflow.orchestrator.scheduler.continuous.ContinuousScheduler`); ``static``
is the baseline (:class:`~kvflow.orchestrator.scheduler.static.StaticBatchScheduler`).
"""

from __future__ import annotations

import time

from kvflow.kv_manager import KVCacheManager
from kvflow.orchestrator.options import POLICIES, EngineOptions
from kvflow.orchestrator.scheduler.continuous import ContinuousScheduler
from kvflow.orchestrator.scheduler.core import Scheduler
from kvflow.orchestrator.scheduler.output import Clock
from kvflow.orchestrator.scheduler.policies import QUEUE_POLICIES
from kvflow.orchestrator.scheduler.static import StaticBatchScheduler

SCHEDULERS: dict[str, type[Scheduler]] = {
    **{name: ContinuousScheduler for name in QUEUE_POLICIES},
    "static": StaticBatchScheduler,
}
# NOTE: the options name the policies (for validation and the CLI); each has a class here.
assert set(SCHEDULERS) == set(POLICIES), (sorted(SCHEDULERS), POLICIES)


def make_scheduler(config: EngineOptions, kv: KVCacheManager,
                   clock: Clock = time.monotonic) -> Scheduler:
    """The scheduler class registered for ``config.policy``."""
    return SCHEDULERS[config.policy](config, kv, clock)
