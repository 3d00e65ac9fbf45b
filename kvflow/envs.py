"""The one place that reads kvflow's environment variables.

* ``KVFLOW_DEBUG_CHECKS`` (``1``/``true``): the default of the engine option ``debug_checks``,
  the invariants of the KV pool and the scheduler checked after every step.
* ``KVFLOW_API_KEY``: the default ``--api-key`` of ``kvflow serve`` and ``kvflow generate``.
"""

from __future__ import annotations

import os

DEBUG_CHECKS = "KVFLOW_DEBUG_CHECKS"
API_KEY = "KVFLOW_API_KEY"


def debug_checks() -> bool:
    return os.environ.get(DEBUG_CHECKS, "").strip().lower() in ("1", "true", "yes", "on")


def api_key() -> str | None:
    return os.environ.get(API_KEY) or None
