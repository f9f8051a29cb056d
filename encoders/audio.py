"""Decode untrusted audio bytes under hard limits (runs in the API process).

Each step is checked before the costlier next one (libsndfile via soundfile): byte size
-> container sniffed (only WAV, FLAC, OGG and MP3 parsers are ever run) ->
header-declared duration (including the WAV ``data`` chunk size, which libsndfile
silently clamps) -> samples read in fixed-size blocks and down-mixed per block, so memory
follows the data actually decoded, never the header -> resampled with
``torchaudio.functional.resample`` under a kernel-size budget. Failures are
:class:`~epd.encoders.media_limits.MediaError` subclasses.
"""

from __future__ import annotations

import io
import math
import re
import struct
from fractions import Fraction
from typing import Any

import numpy as np

from epd.encoders.media_limits import (
    CorruptMediaError,
    EmptyMediaError,
    MediaLimits,
    MediaTooLargeError,
    UnsupportedMediaError,
    as_bytes,
)

__all__ = ["AUDIO_FORMATS", "decode_audio", "normalize_audio"]

_DEFAULT_LIMITS = MediaLimits()

AUDIO_FORMATS = {"WAV", "FLAC", "OGG", "MP3"}
# libsndfile major formats accepted, mapped to the names above.
_SF_FORMATS = {"WAV": "WAV", "WAVEX": "WAV", "FLAC": "FLAC", "OGG": "OGG", "MP3": "MP3"}

_AUDIO_ACCEPTED = "accepted audio formats: WAV, FLAC, OGG (Vorbis/Opus), MP3"

# Samples (frames * channels) per soundfile read: 1 MiB of float32.
_AUDIO_BLOCK_SAMPLES = 1 << 18
# Budget for torchaudio's sinc-resampling kernel ([new, 2*width + orig] after gcd
# reduction) and for its cost in multiply-adds per input sample.
_MAX_RESAMPLE_KERNEL = 1 << 22
_MAX_RESAMPLE_MACS_PER_SAMPLE = 1024


def _sniff_audio(data: bytes) -> str | None:
    """Accepted container from magic bytes ("WAV", "FLAC", "OGG", "MP3"/"ID3"), else None."""
    if data[:4] in (b"RIFF", b"RIFX") and data[8:12] == b"WAVE":
        return "WAV"
    if data[:4] == b"fLaC":
        return "FLAC"
    if data[:4] == b"OggS":
        return "OGG"
    if data[:3] == b"ID3":
        return "ID3"  # MP3, or FLAC behind an ID3 tag: decided after opening
    if len(data) >= 2 and data[0] == 0xFF and (data[1] & 0xE0) == 0xE0 and (data[1] & 0x06) != 0:
        return "MP3"  # MPEG audio frame sync with a valid layer (layer bits 00 is AAC ADTS)
    return None


def _identify_other_audio_format(data: bytes) -> str | None:
    if data[4:8] == b"ftyp":
        return "MP4/M4A (AAC/ALAC)"
    if data[:4] == b"\x1aE\xdf\xa3":
        return "WebM/Matroska"
    if len(data) >= 2 and data[0] == 0xFF and (data[1] & 0xF6) == 0xF0:
        return "AAC (ADTS)"
    if data[:4] == b"FORM" and data[8:12] in (b"AIFF", b"AIFC"):
        return "AIFF"
    if data[:4] == b"RF64" or data[:4] == b"BW64":
        return "RF64"
    if data[:4] == b"riff":
        return "W64"
    if data[:4] == b".snd":
        return "AU"
    if data[:4] == b"caff":
        return "CAF"
    if data[:5] == b"#!AMR":
        return "AMR"
    if data[:4] == b"wvpk":
        return "WavPack"
    if data[:4] == b"MAC ":
        return "APE"
    return None


def _wav_declared_seconds(data: bytes) -> float | None:
    """Duration declared by a WAV ``data`` chunk header, or None if unknown.

    libsndfile clamps an oversized ``data`` chunk to the bytes present, so a header
    claiming hours with a few bytes of payload would otherwise pass. The streaming
    placeholders 0 and 0xFFFFFFFF mean "unknown" and are left to libsndfile. For
    compressed subtypes ``block_align`` covers several frames, so this under-estimates
    (the libsndfile frame count is checked afterwards anyway).
    """
    if len(data) < 12 or data[8:12] != b"WAVE" or data[:4] not in (b"RIFF", b"RIFX"):
        return None
    endian = "<" if data[:4] == b"RIFF" else ">"
    pos, fmt = 12, None
    for _ in range(256):  # chunks before "data": fmt, fact, LIST, bext, ...
        if pos + 8 > len(data):
            return None
        cid = data[pos : pos + 4]
        (size,) = struct.unpack(endian + "I", data[pos + 4 : pos + 8])
        if cid == b"fmt " and size >= 16 and pos + 24 <= len(data):
            _tag, _ch, rate, _bps, block_align, _bits = struct.unpack(endian + "HHIIHH", data[pos + 8 : pos + 24])
            fmt = (rate, block_align)
        elif cid == b"data":
            if fmt is None or size in (0, 0xFFFFFFFF) or fmt[0] <= 0 or fmt[1] <= 0:
                return None
            return (size // fmt[1]) / fmt[0]
        pos += 8 + size + (size & 1)
    return None


def decode_audio(
    data: bytes,
    *,
    target_sample_rate: int,
    limits: MediaLimits = _DEFAULT_LIMITS,
) -> np.ndarray:
    """Decode untrusted audio bytes to mono float32 samples at ``target_sample_rate``.

    Accepted containers: WAV (PCM 8/16/24/32-bit, float, and the other libsndfile WAV
    codecs, incl. WAVE_FORMAT_EXTENSIBLE), FLAC, OGG (Vorbis, Opus) and MP3. Returns a
    C-contiguous ``np.ndarray`` of dtype float32 and shape ``[num_samples]`` (nominally
    in [-1, 1]; multi-channel audio is down-mixed by the mean over channels), resampled
    from the file's rate to ``target_sample_rate`` Hz with
    ``torchaudio.functional.resample``: ``num_samples == ceil(frames * target / rate)``.

    Checks, each before costlier work: byte size (``max_audio_bytes``), container magic
    (only the accepted parsers run), WAV ``data``-chunk duration, then the header's
    frame count / sample rate against ``max_audio_seconds``, ``max_audio_sample_rate``
    and ``max_audio_channels``. Samples are then read in 1 MiB blocks and down-mixed per
    block, so memory follows the data actually present (never more than
    ``max_audio_seconds * rate`` mono samples), whatever the header claims. A stream that
    fails mid-way (e.g. a truncated FLAC, or a header claiming more frames than exist)
    is rejected; MP3/OGG that simply end early are returned as decoded.

    Raises:
        EmptyMediaError: empty bytes, or a stream with zero frames.
        MediaTooLargeError: over the byte, duration, sample-rate or channel limits.
        UnsupportedMediaError: a recognised but not accepted format (AIFF, M4A, ...).
        CorruptMediaError: unrecognisable or undecodable data, non-finite float samples.
        TypeError / ValueError: ``data`` not bytes-like / invalid ``target_sample_rate``.
    """
    target = _check_target_rate(target_sample_rate)
    buf = as_bytes(data, "audio", limits.max_audio_bytes)

    kind = _sniff_audio(buf)
    if kind is None:
        other = _identify_other_audio_format(buf)
        if other is not None:
            raise UnsupportedMediaError(f"audio format {other} is not accepted; {_AUDIO_ACCEPTED}", modality="audio")
        raise CorruptMediaError(
            f"cannot identify audio data (not a valid audio file); {_AUDIO_ACCEPTED}", modality="audio"
        )
    if kind == "WAV":
        declared = _wav_declared_seconds(buf)
        if declared is not None and declared > limits.max_audio_seconds:
            raise MediaTooLargeError(
                f"audio header declares {declared:.1f} s; the limit is {limits.max_audio_seconds:g} s",
                modality="audio",
            )

    import soundfile as sf

    try:
        f = sf.SoundFile(io.BytesIO(buf))
    except (RuntimeError, ValueError, TypeError, OSError, EOFError) as e:
        why = re.sub(r"^Error opening <[^>]*>: ", "", str(e))  # soundfile names its BytesIO object
        raise CorruptMediaError(f"cannot decode audio header: {why}; {_AUDIO_ACCEPTED}", modality="audio") from e
    with f:
        fmt = _SF_FORMATS.get(f.format)
        if fmt is None:
            raise UnsupportedMediaError(f"audio format {f.format} is not accepted; {_AUDIO_ACCEPTED}", modality="audio")
        rate, channels, frames = int(f.samplerate), int(f.channels), int(f.frames)
        _check_audio_layout(rate, channels, limits)
        if frames <= 0:
            raise EmptyMediaError("audio has no samples (0 frames)", modality="audio")
        if frames / rate > limits.max_audio_seconds:
            raise MediaTooLargeError(
                f"audio is {frames / rate:.1f} s long; the limit is {limits.max_audio_seconds:g} s",
                modality="audio",
            )
        mono = _read_mono_bounded(f, rate, channels, limits)
    if mono.size == 0:
        raise CorruptMediaError(f"audio header declares {frames} frames but none could be decoded", modality="audio")
    if not np.isfinite(mono).all():
        raise CorruptMediaError("audio contains NaN or infinite samples", modality="audio")
    return _resample(mono, rate, target)


def _check_target_rate(target_sample_rate: Any) -> int:
    if isinstance(target_sample_rate, bool) or not isinstance(target_sample_rate, (int, np.integer)):
        raise TypeError(f"target_sample_rate must be an int, got {type(target_sample_rate).__name__}")
    if target_sample_rate <= 0:
        raise ValueError(f"target_sample_rate must be positive, got {target_sample_rate}")
    return int(target_sample_rate)


def _check_audio_layout(rate: int, channels: int, limits: MediaLimits) -> None:
    if rate <= 0:
        raise CorruptMediaError(f"audio sample rate {rate} Hz is invalid", modality="audio")
    if rate > limits.max_audio_sample_rate:
        raise MediaTooLargeError(
            f"audio sample rate is {rate} Hz; the limit is {limits.max_audio_sample_rate} Hz", modality="audio"
        )
    if channels <= 0:
        raise CorruptMediaError(f"audio channel count {channels} is invalid", modality="audio")
    if channels > limits.max_audio_channels:
        raise MediaTooLargeError(
            f"audio has {channels} channels; the limit is {limits.max_audio_channels}", modality="audio"
        )


def _read_mono_bounded(f: Any, rate: int, channels: int, limits: MediaLimits) -> np.ndarray:
    """Read float32 blocks, down-mixing each; never hold more than the duration limit."""
    max_frames = int(math.floor(limits.max_audio_seconds * rate))
    block = max(1, _AUDIO_BLOCK_SAMPLES // channels)
    parts: list[np.ndarray] = []
    total = 0
    while True:
        want = min(block, max_frames + 1 - total)
        try:
            chunk = f.read(want, dtype="float32", always_2d=True)
        except (RuntimeError, ValueError, OSError, EOFError) as e:
            raise CorruptMediaError(
                f"audio stream is truncated or corrupt after {total} frames: {e}", modality="audio"
            ) from e
        n = chunk.shape[0]
        if n == 0:
            break
        parts.append(chunk[:, 0].copy() if channels == 1 else chunk.mean(axis=1, dtype=np.float32))
        total += n
        if total > max_frames:
            raise MediaTooLargeError(
                f"audio is longer than the limit of {limits.max_audio_seconds:g} s (header said less)",
                modality="audio",
            )
    if not parts:
        return np.zeros(0, dtype=np.float32)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


_INT_SCALES = {
    np.dtype(np.int8): 2.0**7,
    np.dtype(np.int16): 2.0**15,
    np.dtype(np.int32): 2.0**31,
}


def normalize_audio(
    samples: np.ndarray,
    sample_rate: int,
    *,
    target_sample_rate: int,
    limits: MediaLimits = _DEFAULT_LIMITS,
) -> np.ndarray:
    """Turn an offline user's ``(samples, sample_rate)`` into what :func:`decode_audio` returns.

    ``samples``: an array (or anything ``np.asarray`` accepts, e.g. a CPU tensor) of shape
    ``[num_samples]`` (mono) or ``[num_samples, channels]``; channel-first
    ``[channels, num_samples]`` arrays are not guessed at (they would look like more
    than ``max_audio_channels`` channels and are rejected with a hint to transpose).
    dtypes: float16/32/64 are taken as-is (nominally [-1, 1]); int8, int16 and int32 PCM
    are scaled by 2**7, 2**15, 2**31; uint8 is 8-bit WAV PCM, ``(x - 128) / 128``. Other
    dtypes (int64, uint16+, bool, complex, object) are rejected because their scale is
    ambiguous: convert to float32 in [-1, 1] first.
    ``sample_rate``: Hz of ``samples``.

    Returns a new C-contiguous float32 array ``[num_samples']`` at ``target_sample_rate``
    (mean over channels), ``num_samples' == ceil(num_samples * target / sample_rate)``.

    Raises:
        EmptyMediaError: zero samples.
        MediaTooLargeError: over ``max_audio_seconds``, ``max_audio_sample_rate`` or
            ``max_audio_channels``.
        UnsupportedMediaError: wrong number of dimensions or unsupported dtype.
        CorruptMediaError: NaN or infinite samples.
        TypeError / ValueError: invalid ``sample_rate`` / ``target_sample_rate`` types.
    """
    target = _check_target_rate(target_sample_rate)
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
        raise TypeError(f"sample_rate must be an int, got {type(sample_rate).__name__}")
    rate = int(sample_rate)
    arr = np.asarray(samples)
    if arr.ndim not in (1, 2):
        raise UnsupportedMediaError(
            f"audio array must have shape [num_samples] or [num_samples, channels], got shape {arr.shape}",
            modality="audio",
        )
    channels = 1 if arr.ndim == 1 else arr.shape[1]
    if arr.ndim == 2 and channels > limits.max_audio_channels:
        raise MediaTooLargeError(
            f"audio array of shape {arr.shape} has {channels} channels; the limit is "
            f"{limits.max_audio_channels}. Arrays must be [num_samples, channels]: transpose "
            "channel-first [channels, num_samples] arrays",
            modality="audio",
        )
    if rate <= 0:
        raise UnsupportedMediaError(f"audio sample rate must be positive, got {rate} Hz", modality="audio")
    _check_audio_layout(rate, max(channels, 1), limits)
    frames = arr.shape[0]
    if frames == 0 or channels == 0:
        raise EmptyMediaError(f"audio array has no samples (shape {arr.shape})", modality="audio")
    if frames / rate > limits.max_audio_seconds:
        raise MediaTooLargeError(
            f"audio is {frames / rate:.1f} s long; the limit is {limits.max_audio_seconds:g} s", modality="audio"
        )

    dt = arr.dtype
    if dt.kind == "f" and dt.itemsize <= 8:
        x = arr.astype(np.float32, copy=False)
    elif dt in _INT_SCALES:
        x = arr.astype(np.float32) / np.float32(_INT_SCALES[dt])
    elif dt == np.dtype(np.uint8):
        x = (arr.astype(np.float32) - 128.0) / np.float32(128.0)
    else:
        raise UnsupportedMediaError(
            f"audio dtype {dt} is not supported; use float16/32/64 in [-1, 1], int8/int16/int32 PCM, or uint8",
            modality="audio",
        )
    mono = x if x.ndim == 1 else (x[:, 0] if channels == 1 else x.mean(axis=1, dtype=np.float32))
    if not np.isfinite(mono).all():
        raise CorruptMediaError("audio contains NaN or infinite samples", modality="audio")
    out = _resample(np.ascontiguousarray(mono, dtype=np.float32), rate, target)
    if np.may_share_memory(out, arr):
        out = out.copy()
    return out


# --------------------------------------------------------------------------- resampling


def _resample_cost(orig: int, new: int) -> tuple[int, float]:
    """(kernel elements, multiply-adds per input sample) of torchaudio's sinc resampler."""
    g = math.gcd(orig, new)
    o, n = orig // g, new // g
    width = math.ceil(6 * o / (min(o, n) * 0.99))  # lowpass_filter_width=6, rolloff=0.99
    kernel = n * (2 * width + o)
    return kernel, kernel / o


def _resample(x: np.ndarray, orig: int, new: int) -> np.ndarray:
    """Resample float32 ``x`` [n] from ``orig`` to ``new`` Hz; output length ceil(n*new/orig).

    Uses ``torchaudio.functional.resample`` (Hann-windowed sinc). Its kernel grows with
    the gcd-reduced rates (47999 -> 16000 Hz would need a 16000 x 48000 kernel), so
    when that exceeds the budget the ratio is replaced by the nearest fraction with a
    small enough denominator (a relative rate error of ~1e-5 or less, inaudible) and the
    output is trimmed/padded to the exact length.
    """
    if orig == new:
        return np.ascontiguousarray(x, dtype=np.float32)
    import torch
    from torchaudio.functional import resample

    o, n = orig, new
    kernel, macs = _resample_cost(o, n)
    if kernel > _MAX_RESAMPLE_KERNEL or macs > _MAX_RESAMPLE_MACS_PER_SAMPLE:
        ratio = Fraction(orig, new)
        limit_den = ratio.denominator
        while kernel > _MAX_RESAMPLE_KERNEL or macs > _MAX_RESAMPLE_MACS_PER_SAMPLE:
            limit_den = max(1, limit_den // 2)
            approx = ratio.limit_denominator(limit_den)
            o, n = approx.numerator, approx.denominator
            kernel, macs = _resample_cost(o, n)
            if limit_den == 1:
                break
    out_len = math.ceil(x.shape[0] * new / orig)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not x.flags.writeable:  # torch.from_numpy warns on read-only memory
        x = x.copy()
    with torch.inference_mode():
        y = resample(torch.from_numpy(x), o, n).numpy()
    if y.shape[0] > out_len:
        y = y[:out_len]
    elif y.shape[0] < out_len:
        y = np.concatenate([y, np.zeros(out_len - y.shape[0], dtype=np.float32)])
    return np.ascontiguousarray(y, dtype=np.float32)
