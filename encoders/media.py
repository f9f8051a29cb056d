"""Decode untrusted image and audio bytes under hard limits (runs in the API process).

A malicious client must not be able to make the server spend unbounded memory or time,
so every entry point checks cheap things first (byte size, header-declared dimensions or
duration) and only then decodes, in a bounded way:

* Images (Pillow): byte size -> format sniffed from the first bytes (only PNG, JPEG,
  WebP, GIF and BMP parsers are ever run) -> header width*height against
  ``max_image_pixels`` (and Pillow's ``Image.MAX_IMAGE_PIXELS``) -> ``load()`` of the
  first frame only -> EXIF orientation -> alpha composited on a background -> RGB.
* Audio (libsndfile via soundfile): byte size -> container sniffed (only WAV, FLAC, OGG
  and MP3 parsers are ever run) -> header-declared duration (including the WAV ``data``
  chunk size, which libsndfile silently clamps) -> samples read in fixed-size blocks and
  down-mixed per block, so memory follows the data actually decoded, never the header ->
  resampled with ``torchaudio.functional.resample`` under a kernel-size budget.

Every failure is a :class:`MediaError` (a ``ValueError``) whose subclass says what went
wrong; the API maps them to HTTP 400 (413 for :class:`MediaTooLargeError`).

This module never changes Pillow's global settings: ``ImageFile.LOAD_TRUNCATED_IMAGES``
must stay ``False`` (truncated images are rejected), and ``Image.MAX_IMAGE_PIXELS`` is
respected as an additional cap when it is lower than ``MediaLimits.max_image_pixels``.
"""

from __future__ import annotations

import io
import math
import struct
import zlib
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
from PIL import Image, ImageOps

__all__ = [
    "AUDIO_FORMATS",
    "IMAGE_FORMATS",
    "MAX_JPEG_SCANS",
    "CorruptMediaError",
    "EmptyMediaError",
    "MediaError",
    "MediaLimits",
    "MediaTooLargeError",
    "UnsupportedMediaError",
    "decode_audio",
    "decode_image",
    "normalize_audio",
    "normalize_image",
]


# --------------------------------------------------------------------------- errors


class MediaError(ValueError):
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


_DEFAULT_LIMITS = MediaLimits()

IMAGE_FORMATS = {"PNG", "JPEG", "WEBP", "GIF", "BMP"}
# Pillow formats that are variants of an accepted one (MPO: JPEG with extra pictures
# appended, written by many cameras; only the first picture is used).
_IMAGE_FORMAT_ALIASES = {"MPO": "JPEG"}
_PIL_OPEN_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

AUDIO_FORMATS = {"WAV", "FLAC", "OGG", "MP3"}
# libsndfile major formats accepted, mapped to the names above.
_SF_FORMATS = {"WAV": "WAV", "WAVEX": "WAV", "FLAC": "FLAC", "OGG": "OGG", "MP3": "MP3"}

#: Progressive JPEGs are decoded one full pass per scan; real files have ~10 scans, a
#: crafted one can carry hundreds of thousands of tiny scans (a CPU bomb).
MAX_JPEG_SCANS = 100

_IMAGE_ACCEPTED = "accepted image formats: " + ", ".join(_PIL_OPEN_FORMATS)
_AUDIO_ACCEPTED = "accepted audio formats: WAV, FLAC, OGG (Vorbis/Opus), MP3"

# Samples (frames * channels) per soundfile read: 1 MiB of float32.
_AUDIO_BLOCK_SAMPLES = 1 << 18
# Budget for torchaudio's sinc-resampling kernel ([new, 2*width + orig] after gcd
# reduction) and for its cost in multiply-adds per input sample.
_MAX_RESAMPLE_KERNEL = 1 << 22
_MAX_RESAMPLE_MACS_PER_SAMPLE = 1024

_PIL_ERRORS = (
    OSError,
    SyntaxError,
    ValueError,
    EOFError,
    IndexError,
    KeyError,
    TypeError,
    struct.error,
    zlib.error,
    NotImplementedError,
)
_BOMB_ERRORS = (Image.DecompressionBombError, Image.DecompressionBombWarning)


# --------------------------------------------------------------------------- helpers


def _as_bytes(data: Any, modality: str, max_bytes: int) -> bytes:
    """Bytes-like -> bytes, with the empty and byte-size checks done before any copy."""
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


def _check_background(background: Any) -> tuple[int, int, int]:
    try:
        bg = tuple(int(c) for c in background)
    except (TypeError, ValueError):
        bg = ()
    if len(bg) != 3 or not all(0 <= c <= 255 for c in bg):
        raise ValueError(f"background must be an (r, g, b) tuple of ints in 0..255, got {background!r}")
    return bg  # type: ignore[return-value]


def _pixel_limit(limits: MediaLimits) -> int:
    """The effective pixel cap: ours, or Pillow's global one when that is stricter."""
    limit = int(limits.max_image_pixels)
    pil_limit = Image.MAX_IMAGE_PIXELS
    if pil_limit is not None and pil_limit < limit:
        limit = int(pil_limit)
    return limit


def _check_image_size(width: int, height: int, limits: MediaLimits, what: str = "image") -> None:
    if width <= 0 or height <= 0:
        raise EmptyMediaError(f"{what} has zero size ({width}x{height})", modality="image")
    limit = _pixel_limit(limits)
    if width * height > limit:
        raise MediaTooLargeError(
            f"{what} is {width}x{height} = {width * height} pixels; the limit is {limit} pixels",
            modality="image",
        )


def _header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) declared by the header of an accepted format, or None.

    Read with a few slices (JPEG: a walk over the segments before the frame header), so
    zero-size and oversized images are rejected before any Pillow parser runs. This
    matters most for WebP, whose Pillow plugin allocates the whole canvas when the file
    is opened. Pillow's own size is checked again after opening.
    """
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return int.from_bytes(data[6:8], "little"), int.from_bytes(data[8:10], "little")
    if data[:2] == b"BM" and len(data) >= 26:
        header = int.from_bytes(data[14:18], "little")
        if header == 12:
            return int.from_bytes(data[18:20], "little"), int.from_bytes(data[20:22], "little")
        if header >= 40:
            w = int.from_bytes(data[18:22], "little", signed=True)
            h = int.from_bytes(data[22:26], "little", signed=True)
            return abs(w), abs(h)
        return None
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP" and len(data) >= 30:
        chunk = data[12:16]
        if chunk == b"VP8X":
            return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
        if chunk == b"VP8L" and data[20] == 0x2F:
            bits = int.from_bytes(data[21:25], "little")
            return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
        if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
            return (
                int.from_bytes(data[26:28], "little") & 0x3FFF,
                int.from_bytes(data[28:30], "little") & 0x3FFF,
            )
        return None
    if data[:3] == b"\xff\xd8\xff":
        return _jpeg_frame_size(data)
    return None


def _jpeg_segments(data: bytes):
    """Yield (position, marker) of the JPEG segments before the first scan, walking
    segment lengths (so EXIF thumbnails inside APP segments are skipped); the last
    marker yielded is SOS (0xDA) or EOI (0xD9) when the walk reaches one. Stops on
    malformed data or after 65536 segments."""
    pos, n = 2, len(data)
    for _ in range(65536):
        if pos + 4 > n or data[pos] != 0xFF:
            return
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length
            pos += 2
            continue
        yield pos, marker
        if marker in (0xD9, 0xDA):
            return
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")


def _jpeg_frame_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the first SOFn segment of a JPEG, or None."""
    for pos, marker in _jpeg_segments(data):
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC) and pos + 9 <= len(data):
            return int.from_bytes(data[pos + 7 : pos + 9], "big"), int.from_bytes(data[pos + 5 : pos + 7], "big")
    return None


def _jpeg_scan_count(data: bytes) -> int:
    """Upper bound on the number of scans (SOS markers) of the first JPEG picture.

    After the first SOS, entropy-coded data cannot contain 0xFFDA (0xFF is byte-stuffed),
    so counting the marker up to the first EOI is exact up to odd COM/APP payloads
    (which can only make the count higher). Before the first SOS, segments are skipped
    by their lengths so an EXIF thumbnail is not counted.
    """
    first_sos = next((pos for pos, marker in _jpeg_segments(data) if marker == 0xDA), -1)
    if first_sos < 0:
        return 0
    end = data.find(b"\xff\xd9", first_sos)
    return 1 + data.count(b"\xff\xda", first_sos + 2, end if end >= 0 else len(data))


def _identify_other_image_format(data: bytes) -> str | None:
    """Name of a Pillow-known but not accepted format, from magic bytes only.

    Only the plugins' ``accept`` prefix checks run; their parsers never see the data.
    """
    prefix = data[:16]
    if data[4:12] in (b"ftypavif", b"ftypavis", b"ftypheic", b"ftypheix", b"ftypmif1", b"ftypmsf1"):
        return "AVIF/HEIF"
    if prefix.lstrip()[:5] in (b"<?xml", b"<svg ") or prefix[:4] == b"<svg":
        return "SVG"
    if prefix[:4] == b"%PDF":
        return "PDF"
    Image.init()
    for fmt, (_factory, accept) in Image.OPEN.items():
        if fmt in IMAGE_FORMATS or accept is None:
            continue
        try:
            result = accept(prefix)
        except Exception:  # noqa: BLE001 - a plugin's sniffer must not decide our error
            continue
        if result is True or (result and not isinstance(result, str)):
            return fmt
    return None


# --------------------------------------------------------------------------- images


def decode_image(
    data: bytes,
    *,
    limits: MediaLimits = _DEFAULT_LIMITS,
    background: tuple[int, int, int] = (255, 255, 255),
) -> Image.Image:
    """Decode untrusted image bytes into an RGB ``PIL.Image.Image`` (mode ``"RGB"``, uint8).

    Accepted formats: :data:`IMAGE_FORMATS` (PNG/APNG, JPEG incl. MPO, WebP, GIF, BMP).
    Animated images (GIF, APNG, WebP, MPO) yield their first frame only; later frames are
    never read. EXIF orientation is applied (so width/height may be swapped relative to
    the header). Transparency (RGBA, LA, PA, palette or single-colour ``tRNS``) is
    composited onto ``background`` (an ``(r, g, b)`` tuple of ints in 0..255). 16-bit
    greyscale is scaled to 8 bits.

    Checks, in order, each before any costlier work: byte size (``max_image_bytes``),
    width*height declared by the header, read with plain slicing before any Pillow
    parser runs (``max_image_pixels``, capped by ``PIL.Image.MAX_IMAGE_PIXELS``),
    format (``Image.open`` restricted to the accepted plugins), Pillow's own size (same
    limit; also catches a GIF frame larger than its screen), JPEG scan count
    (:data:`MAX_JPEG_SCANS`), then ``load()`` of the first frame.

    Raises:
        EmptyMediaError: ``data`` is empty or the image has zero width/height.
        MediaTooLargeError: over ``max_image_bytes``, the pixel limit (including Pillow's
            decompression-bomb error or warning), or the JPEG scan limit.
        UnsupportedMediaError: a recognised but not accepted format (TIFF, ICO, ...).
        CorruptMediaError: unrecognisable, truncated or undecodable data.
        TypeError / ValueError: ``data`` is not bytes-like / ``background`` is invalid.
    """
    bg = _check_background(background)
    buf = _as_bytes(data, "image", limits.max_image_bytes)

    declared = _header_size(buf)
    if declared is not None:
        _check_image_size(*declared, limits, what="image header")

    try:
        img = Image.open(io.BytesIO(buf), formats=_PIL_OPEN_FORMATS)
    except _BOMB_ERRORS as e:
        raise MediaTooLargeError(
            f"image exceeds the pixel limit of {_pixel_limit(limits)} pixels ({e})", modality="image"
        ) from e
    except Image.UnidentifiedImageError as e:
        other = _identify_other_image_format(buf)
        if other is not None:
            raise UnsupportedMediaError(
                f"image format {other} is not accepted; {_IMAGE_ACCEPTED}", modality="image"
            ) from e
        raise CorruptMediaError(
            f"cannot identify image data (not a valid image file); {_IMAGE_ACCEPTED}",
            modality="image",
        ) from e
    except _PIL_ERRORS as e:
        raise CorruptMediaError(f"invalid image header: {e}", modality="image") from e

    with img:
        if (img.format or "").upper() == "JPEG" or img.format == "MPO":
            scans = _jpeg_scan_count(buf)
            if scans > MAX_JPEG_SCANS:
                raise MediaTooLargeError(
                    f"JPEG has {scans} scans; the limit is {MAX_JPEG_SCANS}", modality="image"
                )
        return _finish_image(img, limits, bg, require_format=True)


def normalize_image(
    image: Image.Image,
    *,
    limits: MediaLimits = _DEFAULT_LIMITS,
    background: tuple[int, int, int] = (255, 255, 255),
) -> Image.Image:
    """Apply :func:`decode_image`'s checks and transforms to a ``PIL.Image.Image``.

    For images handed over by offline-API users. Returns a new RGB image (the input is
    not modified). An image that still carries a file format (``image.format`` set, e.g.
    from ``Image.open``) must be one of :data:`IMAGE_FORMATS`; images built in memory
    (``format is None``, e.g. after ``convert``) are accepted whatever their origin. A
    multi-frame image contributes its current frame (frame 0 unless the caller seeked).
    Lazily opened images are loaded here, after the pixel check.

    Raises the same :class:`MediaError` subclasses as :func:`decode_image`, and
    ``TypeError`` if ``image`` is not a PIL image.
    """
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL.Image.Image, got {type(image).__name__}")
    bg = _check_background(background)
    return _finish_image(image, limits, bg, require_format=image.format is not None)


def _finish_image(
    img: Image.Image, limits: MediaLimits, bg: tuple[int, int, int], *, require_format: bool
) -> Image.Image:
    if require_format:
        fmt = (img.format or "").upper()
        fmt = _IMAGE_FORMAT_ALIASES.get(fmt, fmt)
        if fmt not in IMAGE_FORMATS:
            raise UnsupportedMediaError(
                f"image format {img.format} is not accepted; {_IMAGE_ACCEPTED}", modality="image"
            )
    # Header size, before any pixel data is decoded (``load`` allocates w*h*bands).
    _check_image_size(*img.size, limits)
    try:
        img.load()  # current (first) frame only
    except _BOMB_ERRORS as e:
        raise MediaTooLargeError(
            f"image exceeds the pixel limit of {_pixel_limit(limits)} pixels ({e})", modality="image"
        ) from e
    except _PIL_ERRORS as e:
        raise CorruptMediaError(f"image data is truncated or corrupt: {e}", modality="image") from e
    _check_image_size(*img.size, limits)

    try:
        oriented = ImageOps.exif_transpose(img)
    except _PIL_ERRORS:
        # Unreadable EXIF must not reject otherwise valid pixels: keep the stored orientation.
        oriented = img
    try:
        return _to_rgb(oriented, bg)
    except _PIL_ERRORS as e:
        raise UnsupportedMediaError(
            f"image mode {oriented.mode} cannot be converted to RGB: {e}", modality="image"
        ) from e


_HIGH_DEPTH_MODES = {"I;16", "I;16L", "I;16B", "I;16N", "I"}
_ALPHA_MODES = {"RGBA", "RGBa", "LA", "La", "PA"}


def _to_rgb(img: Image.Image, bg: tuple[int, int, int]) -> Image.Image:
    """Any Pillow mode -> a new ``RGB`` image, alpha composited onto ``bg``."""
    mode = img.mode
    transparency = img.info.get("transparency")
    if mode in _HIGH_DEPTH_MODES:
        # Pillow's convert() clips 16-bit values to 255 (all white); scale instead.
        arr = np.asarray(img)
        if mode == "I" and arr.size and int(arr.max()) <= 255 and int(arr.min()) >= 0:
            gray = arr.astype(np.uint8)
        else:
            gray = (np.clip(arr, 0, 65535).astype(np.uint32) >> 8).astype(np.uint8)
        if isinstance(transparency, int):
            alpha = np.where(arr == transparency, 0, 255).astype(np.uint8)
            img = Image.fromarray(np.stack([gray, alpha], axis=-1), mode="LA")
        else:
            img = Image.fromarray(gray, mode="L")
        mode = img.mode
        transparency = None
    if mode in _ALPHA_MODES or transparency is not None:
        rgba = img.convert("RGBA")
        out = Image.new("RGB", rgba.size, bg)
        out.paste(rgba, (0, 0), rgba.getchannel("A"))
        return out
    out = img.convert("RGB")
    if out is img:  # pragma: no cover - convert() copies, but never hand back the input
        out = img.copy()
    return out


# --------------------------------------------------------------------------- audio


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
    buf = _as_bytes(data, "audio", limits.max_audio_bytes)

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
        raise CorruptMediaError(f"cannot decode audio header: {e}; {_AUDIO_ACCEPTED}", modality="audio") from e
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
