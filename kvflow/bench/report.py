"""Writing benchmark reports: one markdown file per benchmark, also printed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


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
