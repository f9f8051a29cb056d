"""Helpers shared by the Triton kernels' launchers; importing this module never imports triton."""

from __future__ import annotations

import os

__all__ = ["interpret_mode", "next_pow2", "triton_importable"]


def interpret_mode() -> bool:
    """Whether ``triton.jit`` builds interpreted functions right now (TRITON_INTERPRET)."""
    try:
        from triton import knobs  # triton >= 3.4 reads the env var through knobs

        return bool(knobs.runtime.interpret)
    except Exception:
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(x: int) -> int:
    """The smallest power of two >= ``x`` (1 for ``x <= 1``): a Triton block size."""
    return 1 << max(0, (int(x) - 1).bit_length())


_TRITON_OK: bool | None = None


def triton_importable() -> bool:
    """Whether ``triton`` and ``triton.language`` import (checked once, then cached)."""
    global _TRITON_OK
    if _TRITON_OK is None:
        try:
            import triton
            import triton.language  # noqa: F401

            _TRITON_OK = True
        except Exception:
            _TRITON_OK = False
    return _TRITON_OK
