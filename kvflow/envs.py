"""The one place that reads kvflow's environment variables.

* ``KVFLOW_DEBUG_CHECKS`` (``1``/``true``): the default of the engine option ``debug_checks``,
  the invariants of the KV pool and the scheduler checked after every step.
* ``KVFLOW_API_KEY``: the default ``--api-key`` of ``kvflow serve`` and ``kvflow generate``.
* ``KVFLOW_FAIL_AFTER_STEPS`` (an integer N): fault injection for tests of failure handling:
  the served engine loop raises instead of running its step N + 1, as a failing runner would.
* ``KVFLOW_CACHE_DIR``: where kvflow keeps what it builds or measures once per machine (the
  native ONNX Runtime op library, the CPU runner's thread policy); default
  ``$XDG_CACHE_HOME/kvflow``, else ``~/.cache/kvflow``.
* ``KVFLOW_ISA`` (``portable``, ``avx2``, ``avxvnni``, ``avx512vnni``): the native op library's
  instruction set, forced (default: the widest this CPU has; :mod:`kvflow.plugins.ort_isa`).
"""

from __future__ import annotations

import os
from pathlib import Path

DEBUG_CHECKS = "KVFLOW_DEBUG_CHECKS"
API_KEY = "KVFLOW_API_KEY"
FAIL_AFTER_STEPS = "KVFLOW_FAIL_AFTER_STEPS"
CACHE_DIR = "KVFLOW_CACHE_DIR"
ISA = "KVFLOW_ISA"


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


def cache_dir() -> Path:
    value = os.environ.get(CACHE_DIR, "").strip()
    if value:
        return Path(value)
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvflow"
