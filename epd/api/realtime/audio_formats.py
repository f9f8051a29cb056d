"""The realtime API's audio formats: PCM16 at a chosen rate, and G.711 for telephony.

``audio/pcm`` is PCM16 little-endian mono (input at 8 to 48 kHz, output at 24 kHz);
``audio/pcmu`` (G.711 mu-law) and ``audio/pcma`` (G.711 A-law) are one byte per sample
at 8 kHz, as OpenAI's Realtime API and telephony (Twilio media streams) carry them.
The G.711 companding is the standard library's ``audioop`` (``audioop-lts`` from
Python 3.13), ITU-T G.711's segment tables; resampling is torchaudio's.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

with warnings.catch_warnings():  # deprecated in 3.11/3.12; the audioop-lts package provides it from 3.13
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

PCM = "audio/pcm"
PCMU = "audio/pcmu"
PCMA = "audio/pcma"
G711_RATE = 8000
FORMATS = (PCM, PCMU, PCMA)


@dataclass(frozen=True, slots=True)
class AudioFormat:
    """A realtime audio format: ``type`` (one of ``FORMATS``) and its sample ``rate`` (Hz)."""

    type: str = PCM
    rate: int = 24000

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.type == PCM else 1

    def to_json(self) -> dict:
        return {"type": self.type, "rate": self.rate} if self.type == PCM else {"type": self.type}

    def decode(self, data: bytes) -> bytes:
        """Wire bytes in this format -> PCM16 little-endian bytes at ``rate``."""
        if self.type == PCMU:
            return audioop.ulaw2lin(data, 2)
        if self.type == PCMA:
            return audioop.alaw2lin(data, 2)
        return data

    def encode(self, pcm: bytes, rate: int) -> bytes:
        """PCM16 little-endian bytes at ``rate`` Hz -> wire bytes in this format
        (resampled to ``self.rate`` first when the rates differ)."""
        if rate != self.rate and pcm:
            pcm = resample_pcm16(pcm, rate, self.rate)
        if self.type == PCMU:
            return audioop.lin2ulaw(pcm, 2)
        if self.type == PCMA:
            return audioop.lin2alaw(pcm, 2)
        return pcm

    def duration_ms(self, nbytes: int) -> float:
        """Milliseconds of audio in ``nbytes`` wire bytes."""
        return nbytes / self.bytes_per_sample / self.rate * 1000


def resample_pcm16(pcm: bytes, src: int, dst: int) -> bytes:
    """PCM16 little-endian bytes from ``src`` Hz to ``dst`` Hz (torchaudio's windowed-sinc resampler)."""
    import torch
    import torchaudio.functional as F

    x = torch.from_numpy(np.frombuffer(pcm, dtype="<i2").astype(np.float32))
    y = F.resample(x, src, dst).round().clamp(-32768, 32767)
    return y.to(torch.int16).numpy().astype("<i2").tobytes()
