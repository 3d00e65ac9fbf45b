"""The one place that reads kvflow's environment variables.

* ``KVFLOW_DEBUG_CHECKS`` (``1``/``true``): the default of the engine option ``debug_checks``,
  the invariants of the KV pool and the scheduler checked after every step.
* ``KVFLOW_API_KEY``: the default ``--api-key`` of ``kvflow serve`` and ``kvflow generate``.
* ``KVFLOW_FAIL_AFTER_STEPS`` (an integer N): fault injection for tests of failure handling:
  the served engine loop raises instead of running its step N + 1, as a failing runner would.
"""

from __future__ import annotations

import os

DEBUG_CHECKS = "KVFLOW_DEBUG_CHECKS"
API_KEY = "KVFLOW_API_KEY"
FAIL_AFTER_STEPS = "KVFLOW_FAIL_AFTER_STEPS"


def debug_checks() -> bool:
    return os.environ.get(DEBUG_CHECKS, "").strip().lower() in ("1", "true", "yes", "on")


def api_key() -> str | None:
    return os.environ.get(API_KEY) or None


def fail_after_steps() -> int | None:
    value = os.environ.get(FAIL_AFTER_STEPS, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{FAIL_AFTER_STEPS} must be a step count (an integer >= 0), got "
                         f"{value!r}")
    return int(value)
