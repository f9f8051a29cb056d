"""Decode untrusted image bytes under hard limits (runs in the API process).

Each step is checked before the costlier next one (Pillow): byte size -> format sniffed
from the first bytes (only PNG, JPEG, WebP, GIF and BMP parsers are ever run) -> header
width*height against ``max_image_pixels`` (and Pillow's ``Image.MAX_IMAGE_PIXELS``) ->
``load()`` of the first frame only -> EXIF orientation -> alpha composited on a
background -> RGB. Failures are :class:`~epd.encoders.media_limits.MediaError` subclasses.

This module never changes Pillow's global settings: ``ImageFile.LOAD_TRUNCATED_IMAGES``
must stay ``False`` (truncated images are rejected), and ``Image.MAX_IMAGE_PIXELS`` is
respected as an additional cap when it is lower than ``MediaLimits.max_image_pixels``.
"""

from __future__ import annotations

import io
import struct
import zlib
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from epd.encoders.media_limits import (
    CorruptMediaError,
    EmptyMediaError,
    MediaLimits,
    MediaTooLargeError,
    UnsupportedMediaError,
    as_bytes,
)

__all__ = ["IMAGE_FORMATS", "MAX_JPEG_SCANS", "decode_image", "header_size", "normalize_image"]

_DEFAULT_LIMITS = MediaLimits()

IMAGE_FORMATS = {"PNG", "JPEG", "WEBP", "GIF", "BMP"}
# Pillow formats that are variants of an accepted one (MPO: JPEG with extra pictures
# appended, written by many cameras; only the first picture is used).
_IMAGE_FORMAT_ALIASES = {"MPO": "JPEG"}
_PIL_OPEN_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

#: Progressive JPEGs are decoded one full pass per scan; real files have ~10 scans, a
#: crafted one can carry hundreds of thousands of tiny scans (a CPU bomb).
MAX_JPEG_SCANS = 100

_IMAGE_ACCEPTED = "accepted image formats: " + ", ".join(_PIL_OPEN_FORMATS)

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


def header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) an accepted image's header declares, read without decoding a pixel
    (a few slices, else Pillow's lazy open); None when neither can tell (the decode that
    follows then finds out why)."""
    size = _header_size(data)
    if size is not None:
        return size
    try:
        with Image.open(io.BytesIO(data), formats=("PNG", "JPEG", "GIF", "BMP")) as img:  # WebP: sliced above
            return img.size
    except (*_PIL_ERRORS, *_BOMB_ERRORS):
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
        except Exception:  # a plugin's sniffer must not decide our error
            continue
        if result is True or (result and not isinstance(result, str)):
            return fmt
    return None


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
    buf = as_bytes(data, "image", limits.max_image_bytes)

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
