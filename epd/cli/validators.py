"""argparse ``type=`` validators shared by every ``epd`` subcommand.

Each takes the flag's text and returns the parsed value, or raises
``argparse.ArgumentTypeError`` with a message naming what was expected, which argparse
prints with the flag's name (exit code 2).
"""

from __future__ import annotations

import argparse


def _parse(text: str, kind: type[int] | type[float]) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'a number' if kind is float else 'a whole number'}") \
            from None


def non_negative_float(text: str) -> float:
    """A float >= 0 (nan refused)."""
    x = _parse(text, float)
    if not x >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return x


def positive_float(text: str) -> float:
    """A finite float > 0 (nan and inf refused)."""
    x = _parse(text, float)
    if not (x > 0 and x != float("inf")):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a number > 0 (finite), got {text}")
    return x


def non_negative_int(text: str) -> int:
    """A whole number >= 0."""
    n = _parse(text, int)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    n = _parse(text, int)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n
