"""Streaming band-limited resampling of int16 PCM, for the synthesizers (epd.tts)."""

from __future__ import annotations

import numpy as np


class StreamResampler:
    """Band-limited resampling of a stream, chunk by chunk, equal to one
    ``torchaudio.functional.resample`` of the whole stream: torchaudio's polyphase sinc
    kernel, applied with numpy to each block of ``orig`` input samples (the rates divided
    by their gcd) as soon as its filter support (``width`` samples each side) has arrived.
    numpy's einsum runs on the calling thread; torch's conv1d would wake its thread pool,
    whose spinning starves the synthesis thread on a small machine."""

    def __init__(self, resample) -> None:  # a torchaudio.transforms.Resample
        self._orig, self._new = resample.orig_freq // resample.gcd, resample.new_freq // resample.gcd
        self._width = resample.width
        self._kernel = resample.kernel[:, 0, :].T.contiguous().numpy()  # [2 * width + orig, new]
        self._buf = np.zeros(self._width, np.float32)  # from the next block's start - width
        self._seen = 0  # input samples pushed
        self._done = 0  # output samples produced

    def push(self, pcm: np.ndarray) -> np.ndarray:
        """``[n] int16`` in; ``[m] int16`` out at the new rate (possibly empty)."""
        self._buf = np.concatenate([self._buf, pcm.astype(np.float32)])
        self._seen += len(pcm)
        return self._blocks((len(self._buf) - 2 * self._width) // self._orig)

    def flush(self) -> np.ndarray:
        """The rest of the stream, zero-padded at its end like the one-shot resample."""
        self._buf = np.concatenate([self._buf, np.zeros(self._width + self._orig, np.float32)])
        total = -(-self._seen * self._new // self._orig)
        return self._blocks((len(self._buf) - 2 * self._width) // self._orig, total - self._done)

    def _blocks(self, n: int, keep: int | None = None) -> np.ndarray:
        """Convert the next ``n`` blocks (keeping ``keep`` output samples) and drop their input."""
        if n < 1:
            return np.zeros(0, np.int16)
        frames = np.lib.stride_tricks.sliding_window_view(self._buf, len(self._kernel))[:: self._orig][:n]
        out = np.einsum("bk,kc->bc", frames, self._kernel).reshape(-1)[:keep]
        self._buf = self._buf[n * self._orig:]
        self._done += len(out)
        return np.clip(np.rint(out), -32768, 32767).astype(np.int16)
