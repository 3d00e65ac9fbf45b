"""Writing benchmark reports: one markdown file per benchmark, also printed, and its plots."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


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
