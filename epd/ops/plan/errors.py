"""The error of ``epd plan``."""

from __future__ import annotations

__all__ = ["PlanError"]


class PlanError(ValueError):
    """Bad input for ``epd plan``: a missing or malformed profile or trace, bad arguments,
    a server that cannot be profiled (exit code 2)."""

