"""Text helpers of ``epd diagnose``'s report and check details: durations, sizes,
percentages, aligned tables, JSON-safe numbers."""

from __future__ import annotations

import math

__all__ = ["byte_size", "json_safe", "ms", "percent", "table"]


def ms(x: float) -> str:
    """Seconds as ``1.25s``, ``120ms`` or ``3.5ms``; ``-`` for None or NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x >= 1.0:
        return f"{x:.2f}s"
    if x >= 0.0095:
        return f"{x * 1000:.0f}ms"
    return f"{x * 1000:.1f}ms"


def byte_size(n: float) -> str:
    """Bytes in B, KiB, MiB or GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def percent(x: float) -> str:
    """A fraction 0..1 as a percentage, one decimal under 10%."""
    return f"{x:.1%}" if x < 0.1 else f"{x:.0%}"


def json_safe(x):
    """JSON-safe: NaN/inf -> None, recursively."""
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def table(rows: list[list[str]], right: set[int]) -> list[str]:
    """``rows`` as aligned lines: columns padded to their widest cell, those in ``right`` right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)).rstrip()
            for r in rows]

