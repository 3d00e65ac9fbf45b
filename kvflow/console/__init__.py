"""The live console: one engine's state as a bounded snapshot (``state``), served at
``GET /v1/kvflow/state``, for the browser page and for scripts."""
