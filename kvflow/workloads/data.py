"""Where the team's shared data files are: the Azure trace, tinyshakespeare."""

from __future__ import annotations

from pathlib import Path


def shared_data_file(name: str) -> Path:
    """``name`` in ``../shared/data`` beside the checkout (where the team's machines keep it),
    else in ``/work/shared/data``; the first candidate when neither exists, so that the error
    names where it was looked for."""
    candidates = [Path(__file__).resolve().parents[3] / "shared" / "data" / name,
                  Path("/work/shared/data") / name]
    return next((c for c in candidates if c.is_file()), candidates[0])
