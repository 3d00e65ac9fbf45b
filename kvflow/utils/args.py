"""argparse types that the commands share."""

from __future__ import annotations

import argparse


def int_arg(text: str) -> int:
    """An integer flag, whose error names the value (``expected an integer, got 'x'``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    return value
