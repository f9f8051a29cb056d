"""Limits and errors shared by the image, audio and video decoders of untrusted media.

A malicious client must not be able to make the server spend unbounded memory or time,
so every decoder checks cheap things first (byte size, header-declared dimensions or
duration) against :class:`MediaLimits` and only then decodes, in a bounded way.

Every failure is a :class:`MediaError` (an ``epd.errors.InvalidRequestError``: the
client's fault) whose subclass says what went wrong; the API answers 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epd.errors import InvalidRequestError

__all__ = [
    "CorruptMediaError",
    "EmptyMediaError",
    "MediaError",
    "MediaLimits",
    "MediaTooLargeError",
    "UnsupportedMediaError",
    "as_bytes",
]


# --------------------------------------------------------------------------- errors


class MediaError(InvalidRequestError):
    """A media item was rejected. ``modality`` is ``"image"``, ``"audio"`` or ``"video"``.

    The message says what is wrong and what is accepted (or which limit was hit).
    """

    def __init__(self, message: str, *, modality: str) -> None:
        super().__init__(message)
        self.modality = modality

    def __reduce__(self):  # keep the keyword-only ``modality`` through copy/pickle
        return (_rebuild_error, (type(self), str(self), self.modality))


def _rebuild_error(cls: type[MediaError], message: str, modality: str) -> MediaError:
    return cls(message, modality=modality)


class UnsupportedMediaError(MediaError):
    """The format (or sample layout) is not accepted; the message names what is."""


class CorruptMediaError(MediaError):
    """The bytes cannot be decoded: truncated, damaged, or not really that format."""


class MediaTooLargeError(MediaError):
    """Over a limit (bytes, pixels, duration, sample rate, channels, JPEG scans).

    The message names the limit and the offending value.
    """


class EmptyMediaError(MediaError):
    """Empty bytes, a zero-size image, or audio with no samples."""


# --------------------------------------------------------------------------- limits


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """Per-item limits. All checks happen before the expensive decode step.

    ``max_image_bytes`` / ``max_audio_bytes``: size of the encoded bytes.
    ``max_image_pixels``: width * height of the (first frame of the) image.
    ``max_audio_seconds``: duration, from the header and again from decoded samples.
    ``max_audio_sample_rate`` (Hz) and ``max_audio_channels``: cap the decoded sample
    count of highly compressible streams and reject channel-first arrays in
    :func:`normalize_audio`.
    Video (``epd.encoders.video``): ``max_video_bytes`` (encoded size),
    ``max_video_pixels`` (width * height of a frame), ``max_video_seconds`` (duration),
    ``max_video_stream_frames`` (frames in the stream) and ``max_video_decoded_pixels``
    (frames x width x height: what decoding costs; default 10 minutes of 1080p at 30 fps),
    all from the headers and again while decoding; ``max_video_frames``: most frames sampled
    from one video (a request may ask for fewer, never more); ``max_video_sample_pixels``:
    sampled frames larger than this are scaled down (aspect kept) as they are converted to
    RGB, so one video's frames hold at most max_video_frames x this x 3 bytes.
    ``max_item_bytes``: one item's processed tensor (a native-resolution image's
    ``pixel_values``, a video's ``pixel_values_videos``), computed from the header before
    processing (``epd.encoders.patch_grid``); at most ``epd.messages.MAX_TENSOR_BYTES``,
    the largest tensor a worker decodes (``--max-mm-item-mb``).
    """

    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 4096 * 4096
    max_audio_bytes: int = 50 * 2**20
    max_audio_seconds: float = 600.0
    max_audio_sample_rate: int = 192_000
    max_audio_channels: int = 64
    max_video_bytes: int = 50 * 2**20
    max_video_pixels: int = 3840 * 2160
    max_video_seconds: float = 600.0
    max_video_stream_frames: int = 36_000
    max_video_decoded_pixels: int = 600 * 30 * 1920 * 1080
    max_video_frames: int = 32
    max_video_sample_pixels: int = 1920 * 1080
    max_item_bytes: int = 256 * 2**20


def as_bytes(data: Any, modality: str, max_bytes: int) -> bytes:
    """Bytes-like -> bytes, with the empty and byte-size checks done before any copy.

    ``modality`` (``"image"``, ``"audio"`` or ``"video"``) names the item in messages and
    errors; ``max_bytes`` is the byte-size limit.

    Raises:
        TypeError: ``data`` is a ``str`` or not bytes-like.
        EmptyMediaError: ``data`` has 0 bytes.
        MediaTooLargeError: ``data`` has more than ``max_bytes`` bytes.
    """
    if isinstance(data, str) or not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"{modality} data must be bytes-like, got {type(data).__name__}")
    nbytes = data.nbytes if isinstance(data, memoryview) else len(data)
    if nbytes == 0:
        raise EmptyMediaError(f"{modality} data is empty (0 bytes)", modality=modality)
    if nbytes > max_bytes:
        raise MediaTooLargeError(
            f"{modality} is {nbytes} bytes; the limit is {max_bytes} bytes", modality=modality
        )
    return data if isinstance(data, bytes) else bytes(memoryview(data).cast("B"))
