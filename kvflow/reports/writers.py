"""Writing benchmark reports: one markdown file per benchmark, also printed, and its plots."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def write_report(path: str | Path, lines: Sequence[str], echo: bool = True) -> str:
    """Write ``lines`` as a markdown file (creating its folder) and, with ``echo``, print it;
    returns the text."""
    text = "\n".join(lines).rstrip("\n") + "\n"
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if echo:
        print(text)
    return text


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend: report plots are written, never
    shown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> str:
    """Lay ``fig`` out, write it as a PNG at ``path`` (110 dpi, as every kvflow plot) and
    close it; returns the file name."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path.name


def memory_bandwidth_gb_s(size_mb: int = 512, repeats: int = 5) -> float:
    """Best-of-``repeats`` numpy copy of a ``size_mb`` MB array, bytes read plus written per
    second (one thread), in GB/s."""
    src = np.ones(size_mb * 1_000_000 // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9
