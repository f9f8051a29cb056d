"""Small deterministic media for serving tests: random-pixel PNGs, tone WAVs, data URLs."""

from __future__ import annotations

import base64
import io

import numpy as np
import soundfile as sf
from PIL import Image


def png(seed: int, size: tuple[int, int] = (30, 40)) -> bytes:
    """A PNG of ``size`` (height, width) random RGB pixels, seeded."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def wav(seed: int, seconds: float = 1.0) -> bytes:
    """A 16 kHz 16-bit mono WAV: a tone (pitch set by ``seed``) plus a little seeded noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    x = (0.3 * np.sin(2 * np.pi * (220 + 50 * seed) * t) + 0.05 * rng.standard_normal(len(t))).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, x, 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def data_url(png_bytes: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes).decode()
