"""Decode untrusted video bytes under hard limits and sample frames (runs in the API process).

PyAV (FFmpeg's libavformat / libavcodec, bundled in the ``av`` wheel) does the parsing
and decoding; this module decides what it may parse and how much it may decode:

1. byte size (``max_video_bytes``), then the container sniffed from its magic bytes
   (MP4/MOV ``ftyp``, WebM/Matroska EBML): only those two demuxers ever run, forced by
   name, so FFmpeg's format probing never sees the data; nested opens (MP4 external data
   references, playlists) are refused by an ``io_open`` hook that raises.
2. from the headers, before any frame is decoded: a video stream exists, its codec is in
   :data:`VIDEO_CODECS`, width * height (``max_video_pixels``), the declared duration
   (``max_video_seconds``) and the declared frame count, or duration x frame rate when
   the container declares none (``max_video_stream_frames``), and frames x pixels, the
   decoding work (``max_video_decoded_pixels``).
3. the decoder is opened with FFmpeg's ``max_pixels`` (so a bitstream that declares a
   larger picture than its container fails inside the decoder, before allocating it),
   and decoding stops as soon as the last sampled frame is reached. Every decoded frame
   is checked again: its size, its timestamp against ``max_video_seconds``, the count
   against ``max_video_stream_frames`` and the pixels so far against
   ``max_video_decoded_pixels`` (headers can lie). A sampled frame is converted to
   RGB when it is picked, scaled down to ``max_video_sample_pixels`` when larger, so
   memory follows the sampled frames, not the stream.

Frames are sampled uniformly in time: ``n = min(max_frames, floor(duration * fps))``
(at least 1) at ``t_k = start + k * duration / n``, each the frame on screen at that time
(the last one whose presentation time is <= t_k); ``fps`` is capped at the stream's own
frame rate. A stream that ends before the frame shown at the last ``t_k`` (a truncated
file) is rejected.

Every failure is a :class:`epd.encoders.media_limits.MediaError` with ``modality="video"``; the
API answers 400 (``MediaError`` is an ``epd.errors.InvalidRequestError``).
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from epd.encoders.media_limits import (
    CorruptMediaError,
    EmptyMediaError,
    MediaError,
    MediaLimits,
    MediaTooLargeError,
    UnsupportedMediaError,
    as_bytes,
)

__all__ = ["VIDEO_CODECS", "VIDEO_CONTAINERS", "VIDEO_PLACEHOLDER", "DecodedVideo", "VideoFrame", "VideoHeader",
           "VideoSampling", "decode_video", "normalize_video", "probe_video", "sample_size", "sampled_frames",
           "sniff_video"]

#: sniffed container -> the FFmpeg demuxer forced for it
VIDEO_CONTAINERS = {"MP4": "mp4", "WEBM": "matroska"}
#: decoders allowed to run (FFmpeg codec names)
VIDEO_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4"})
#: where a video goes in an offline text prompt for a model without a video token (LLaVA):
#: each is replaced by the video's sampled frames as image placeholders
VIDEO_PLACEHOLDER = "<video>"

_ACCEPTED = "accepted video: MP4/MOV or WebM/Matroska with H.264, HEVC, VP8, VP9, AV1 or MPEG-4 video"
# ISO-BMFF brands that are still images or audio, not video
_IMAGE_BRANDS = (b"avif", b"avis", b"heic", b"heix", b"heim", b"heis", b"mif1", b"msf1")
# FFmpeg's probing of an opened container: bounded (bytes read, microseconds analysed)
_CONTAINER_OPTIONS = {"probesize": str(1 << 20), "analyzeduration": str(2_000_000)}


# What PyAV's bindings raise on malformed input besides av.FFmpegError (checked after MediaError)
_PYAV_ERRORS = (ArithmeticError, AttributeError, IndexError, KeyError, OSError, TypeError, ValueError)


def _too_large(message: str) -> MediaTooLargeError:
    return MediaTooLargeError(message, modality="video")


@dataclass(frozen=True, slots=True)
class VideoSampling:
    """How frames are taken from a video.

    ``fps``: frames per second of video time to sample (> 0; capped at the stream's rate).
    ``max_frames``: at most this many frames; longer videos are sampled more sparsely,
    uniformly over their whole duration.

    Raises:
        ValueError: ``fps`` not a positive finite number or ``max_frames`` < 1.
    """

    fps: float = 2.0
    max_frames: int = 32

    def __post_init__(self) -> None:
        if isinstance(self.fps, bool) or not isinstance(self.fps, (int, float)) or not (
                math.isfinite(self.fps) and self.fps > 0):
            raise ValueError(f"video fps must be a positive number, got {self.fps!r}")
        if isinstance(self.max_frames, bool) or not isinstance(self.max_frames, int) or self.max_frames < 1:
            raise ValueError(f"video max_frames must be an integer >= 1, got {self.max_frames!r}")

    def params(self) -> dict:
        """The sampling as hash parameters (what a cache key must cover)."""
        return {"fps": float(self.fps), "max_frames": int(self.max_frames)}


@dataclass(frozen=True, slots=True)
class VideoHeader:
    """What the headers declare. ``duration_s``: seconds; ``frame_rate``: frames/s (0: unknown);
    ``frames``: declared frame count, else estimated as duration x rate; ``start_s``: first
    presentation time."""

    container: str
    codec: str
    width: int
    height: int
    duration_s: float
    frame_rate: float
    frames: int
    start_s: float = 0.0


@dataclass(frozen=True, slots=True)
class VideoFrame:
    """One sampled frame, handed to a model that takes video as images (LLaVA).

    ``pixels``: [H, W, 3] uint8 RGB; ``video_digest``: :attr:`DecodedVideo.digest` of its
    video; ``index``: position among the sampled frames; ``timestamp_s``: presentation time.
    """

    pixels: np.ndarray
    video_digest: str
    index: int
    timestamp_s: float


@dataclass(frozen=True, slots=True)
class DecodedVideo:
    """Sampled frames of one video.

    ``frames``: [T, H, W, 3] uint8 RGB (1 <= T <= ``sampling.max_frames``);
    ``timestamps_s``: [T] float64 presentation times; ``digest``: sha256 hex of the encoded
    bytes (or of the given frame array) together with ``sampling.params()``, so the same
    bytes sampled at another fps or frame cap has another digest; ``header``: None for frames
    given as an array.
    """

    frames: np.ndarray
    timestamps_s: np.ndarray
    digest: str
    sampling: VideoSampling
    header: VideoHeader | None = None

    def as_images(self) -> list[VideoFrame]:
        """The frames as :class:`VideoFrame` items, in time order."""
        return [VideoFrame(self.frames[i], self.digest, i, float(self.timestamps_s[i]))
                for i in range(self.frames.shape[0])]


def _digest(source: bytes | memoryview, kind: str, sampling: VideoSampling, extra: str = "") -> str:
    h = hashlib.sha256()
    h.update(f"{kind}|{sorted(sampling.params().items())}|{extra}|".encode())
    h.update(source)
    return h.hexdigest()


def sniff_video(data: bytes) -> str | None:
    """The accepted container of ``data`` from its magic bytes (a key of
    :data:`VIDEO_CONTAINERS`), or None.

    Raises:
        UnsupportedMediaError: an ISO-BMFF file whose brand is a still image (AVIF, HEIF).
    """
    if data[4:8] == b"ftyp":
        if data[8:12] in _IMAGE_BRANDS:
            raise UnsupportedMediaError(f"{data[8:12].decode('latin-1')} is an image format, not video; {_ACCEPTED}",
                                        modality="video")
        return "MP4"
    if data[:4] == b"\x1aE\xdf\xa3":
        return "WEBM"
    return None


def _other_format(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "AVI"
    if data[:1] == b"\x47" and len(data) > 188 and data[188:189] == b"\x47":
        return "MPEG-TS"
    if data[:4] == b"\x00\x00\x01\xba":
        return "MPEG-PS"
    if data[:3] == b"FLV":
        return "FLV"
    if data[:4] == b"OggS":
        return "Ogg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF (send it as an image)"
    return None


def _refuse_nested_open(url: str, flags: int, options: dict):
    raise PermissionError(f"the video references another file ({url!r}); only self-contained files are accepted")


def _header(container, kind: str, limits: MediaLimits) -> VideoHeader:
    """Checks every header-declared quantity against ``limits``; decodes nothing."""
    if not container.streams.video:
        what = "an audio-only file" if container.streams.audio else "no streams"
        raise UnsupportedMediaError(f"the video has no video stream ({what}); {_ACCEPTED}", modality="video")
    stream = container.streams.video[0]
    cc = stream.codec_context
    if cc is None or cc.codec is None:  # FFmpeg knows no decoder for the stream's codec tag
        raise UnsupportedMediaError(f"the video's codec is unknown; {_ACCEPTED}", modality="video")
    codec = getattr(cc.codec, "canonical_name", None) or cc.codec.name
    if codec not in VIDEO_CODECS:
        raise UnsupportedMediaError(f"video codec {codec} is not accepted; {_ACCEPTED}", modality="video")
    width, height = int(cc.width or stream.width or 0), int(cc.height or stream.height or 0)
    if width <= 0 or height <= 0:
        raise EmptyMediaError(f"video header declares a zero size ({width}x{height})", modality="video")
    if width * height > limits.max_video_pixels:
        raise _too_large(f"video frames are {width}x{height} = {width * height} pixels; the limit is "
                         f"{limits.max_video_pixels} pixels")
    duration = None
    if stream.duration is not None and stream.time_base is not None:
        duration = float(stream.duration * stream.time_base)
    if (duration is None or duration <= 0) and container.duration is not None:
        duration = container.duration / 1e6
    if duration is None or not math.isfinite(duration) or duration <= 0:
        raise UnsupportedMediaError("the video declares no duration (e.g. a live WebM recording): remux it "
                                    f"into a file with a duration; {_ACCEPTED}", modality="video")
    if duration > limits.max_video_seconds:
        raise _too_large(f"video header declares {duration:.1f} s; the limit is {limits.max_video_seconds:g} s "
                         f"(--max-video-seconds)")
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    rate = float(rate) if rate else 0.0
    frames = int(stream.frames or 0) or (math.ceil(duration * rate) if rate else 0)
    if frames > limits.max_video_stream_frames:
        raise _too_large(f"video header declares {frames} frames; the limit is {limits.max_video_stream_frames} "
                         f"frames in a stream")
    if frames * width * height > limits.max_video_decoded_pixels:
        raise _too_large(f"video header declares {frames} frames of {width}x{height} = {frames * width * height} "
                         f"pixels to decode; the limit is {limits.max_video_decoded_pixels}")
    start = float(stream.start_time * stream.time_base) if stream.start_time is not None and stream.time_base else 0.0
    return VideoHeader(kind, codec, width, height, duration, rate, frames, start)


def _targets(header: VideoHeader, sampling: VideoSampling) -> np.ndarray:
    """Sample times [n] float64, seconds (see the module docstring)."""
    fps = min(sampling.fps, header.frame_rate) if header.frame_rate > 0 else sampling.fps
    n = max(1, min(sampling.max_frames, math.floor(header.duration_s * fps + 1e-9)))
    return header.start_s + np.arange(n, dtype=np.float64) * (header.duration_s / n)


def decode_video(data: bytes, *, sampling: VideoSampling = VideoSampling(),
                 limits: MediaLimits = MediaLimits()) -> DecodedVideo:
    """Decode untrusted video bytes into sampled RGB frames (see the module docstring).

    Returns a :class:`DecodedVideo`: ``frames`` [T, H, W, 3] uint8 RGB, ``timestamps_s`` [T]
    seconds, T = min(``sampling.max_frames``, floor(duration * fps)) (at least 1).

    Raises:
        EmptyMediaError: empty bytes, a zero-size picture, or a stream without frames.
        MediaTooLargeError: over ``max_video_bytes``, ``max_video_pixels``,
            ``max_video_seconds``, ``max_video_stream_frames`` or ``max_video_decoded_pixels``
            (from the headers, or found while decoding); the message names the limit.
        UnsupportedMediaError: a container or codec that is not accepted, no video stream
            (e.g. audio only), no declared duration.
        CorruptMediaError: unparseable, damaged or truncated data.
        TypeError: ``data`` is not bytes-like.
    """
    buf = as_bytes(data, "video", limits.max_video_bytes)
    container, kind = _open(buf, limits)
    try:
        with container:
            header = _header(container, kind, limits)
            frames, times = _decode_sampled(container, header, _targets(header, sampling), limits)
    except MediaError:
        raise
    except _PYAV_ERRORS as e:  # whatever else a hostile file makes the bindings raise is the file's fault
        raise CorruptMediaError(f"cannot decode the video: {type(e).__name__}: {e}", modality="video") from None
    return DecodedVideo(frames, times, _digest(buf, "bytes", sampling), sampling, header)


def probe_video(data: bytes, *, limits: MediaLimits = MediaLimits()) -> VideoHeader:
    """The checked header of untrusted video bytes (the container's and the stream's
    headers only: no frame is decoded). Raises as :func:`decode_video`."""
    buf = as_bytes(data, "video", limits.max_video_bytes)
    container, kind = _open(buf, limits)
    try:
        with container:
            return _header(container, kind, limits)
    except MediaError:
        raise
    except _PYAV_ERRORS as e:
        raise CorruptMediaError(f"cannot read the video header: {type(e).__name__}: {e}", modality="video") from None


def sampled_frames(header: VideoHeader, sampling: VideoSampling) -> int:
    """How many frames :func:`decode_video` samples from a video of ``header``."""
    return len(_targets(header, sampling))


def _open(buf: bytes, limits: MediaLimits):
    """(the opened PyAV container, its sniffed kind) of checked video bytes."""
    import av

    kind = sniff_video(buf)
    if kind is None:
        other = _other_format(buf)
        raise (UnsupportedMediaError(f"video format {other} is not accepted; {_ACCEPTED}", modality="video")
               if other else CorruptMediaError(f"cannot identify video data; {_ACCEPTED}", modality="video"))
    try:
        container = av.open(io.BytesIO(buf), format=VIDEO_CONTAINERS[kind], container_options=_CONTAINER_OPTIONS,
                            options={"max_pixels": str(limits.max_video_pixels)}, io_open=_refuse_nested_open)
    except (av.FFmpegError, PermissionError, ValueError, OSError) as e:
        why = getattr(e, "strerror", None) or str(e)  # FFmpeg's reason, without its errno
        raise CorruptMediaError(f"cannot read the video container (truncated, damaged or not a video: {why}); "
                                f"{_ACCEPTED}", modality="video") from None
    return container, kind


def sample_size(width: int, height: int, limits: MediaLimits) -> tuple[int, int]:
    """(width, height) a sampled frame is converted at: as decoded, or scaled down (aspect
    kept, even sizes) to at most ``max_video_sample_pixels``."""
    budget = limits.max_video_sample_pixels
    if width * height <= budget:
        return width, height
    scale = math.sqrt(budget / (width * height))
    return max(2, int(width * scale) // 2 * 2), max(2, int(height * scale) // 2 * 2)


def _to_rgb(frame, limits: MediaLimits) -> np.ndarray:
    """[H, W, 3] uint8 RGB of a decoded frame, scaled down per :func:`sample_size`."""
    w, h = sample_size(frame.width, frame.height, limits)
    if (w, h) != (frame.width, frame.height):
        frame = frame.reformat(width=w, height=h, format="rgb24", interpolation="AREA")
    return frame.to_ndarray(format="rgb24")


def _decode_sampled(container, header: VideoHeader, targets: np.ndarray,
                    limits: MediaLimits) -> tuple[np.ndarray, np.ndarray]:
    """Decode until the frame on screen at every target time is known; returns
    ([T, H, W, 3] uint8, [T] float64). Memory: the T sampled frames in RGB (each at most
    ``max_video_sample_pixels``) plus the decoder's own frames."""
    import av

    stream = container.streams.video[0]
    stream.codec_context.options = {"max_pixels": str(limits.max_video_pixels)}
    picked: list[tuple[np.ndarray, float]] = []
    prev = None  # (frame, time) of the latest decoded frame
    prev_rgb = None  # (frame, its RGB) once converted: a frame picked for two targets is converted once
    decoded = decoded_pixels = 0
    interval = 1.0 / header.frame_rate if header.frame_rate > 0 else 0.0
    eps = 1e-6

    def pick(entry) -> None:
        nonlocal prev_rgb
        frame, t = entry
        if prev_rgb is None or prev_rgb[0] is not frame:
            prev_rgb = (frame, _to_rgb(frame, limits))
        picked.append((prev_rgb[1], t))

    try:
        for frame in container.decode(stream):
            decoded += 1
            if decoded > limits.max_video_stream_frames:
                raise _too_large(f"video holds more than {limits.max_video_stream_frames} frames (its header "
                                 f"declared {header.frames}); the limit is {limits.max_video_stream_frames}")
            if frame.width * frame.height > limits.max_video_pixels:
                raise _too_large(f"a video frame is {frame.width}x{frame.height} pixels; the limit is "
                                 f"{limits.max_video_pixels} pixels")
            decoded_pixels += frame.width * frame.height
            if decoded_pixels > limits.max_video_decoded_pixels:
                raise _too_large(f"video needs more than {limits.max_video_decoded_pixels} pixels decoded (its header "
                                 f"declared {header.frames} frames of {header.width}x{header.height})")
            t = float(frame.time) if frame.time is not None else (prev[1] + interval if prev else header.start_s)
            if t - header.start_s > limits.max_video_seconds + 1.0:
                raise _too_large(f"video runs past {limits.max_video_seconds:g} s (its header declared "
                                 f"{header.duration_s:.1f} s); the limit is {limits.max_video_seconds:g} s")
            while len(picked) < len(targets) and t > targets[len(picked)] + eps:
                pick(prev if prev is not None else (frame, t))  # the frame on screen at the target
            if len(picked) == len(targets):
                break
            prev = (frame, t)
        if prev is None and not picked:
            raise EmptyMediaError("the video stream has no decodable frames", modality="video")
        if len(picked) < len(targets):
            # End of stream: the last frame is on screen from its time on, if nothing is missing after it.
            last_t = prev[1]
            if interval and last_t + interval < targets[-1] - eps:
                raise CorruptMediaError(f"the video is truncated: it ends at {last_t:.2f} s of the "
                                        f"{header.duration_s:.2f} s its header declares", modality="video")
            while len(picked) < len(targets):
                pick(prev)
    except av.FFmpegError as e:
        why = getattr(e, "strerror", None) or str(e)
        raise CorruptMediaError(f"the video stream is truncated or corrupt after {decoded} frames ({why}; a picture "
                                f"over the {limits.max_video_pixels}-pixel limit also stops decoding here)",
                                modality="video") from None
    frames = np.stack([rgb for rgb, _ in picked])
    return frames, np.array([t for _, t in picked], dtype=np.float64)


def normalize_video(frames: Any, *, sampling: VideoSampling = VideoSampling(),
                    limits: MediaLimits = MediaLimits()) -> DecodedVideo:
    """Frames an offline user already decoded: ``[T, H, W, 3]`` uint8 RGB (array-like, e.g. a
    CPU tensor), taken as given (no sampling: T <= ``sampling.max_frames``); timestamps are
    ``k / sampling.fps``.

    Raises:
        EmptyMediaError: T, H or W is 0.
        MediaTooLargeError: T > ``sampling.max_frames`` or H * W > ``max_video_pixels``.
        UnsupportedMediaError: another shape or dtype.
    """
    arr = np.asarray(frames)
    if arr.ndim != 4 or arr.shape[-1] != 3 or arr.dtype != np.uint8:
        raise UnsupportedMediaError(f"video frames must be a [T, H, W, 3] uint8 RGB array, got shape {arr.shape} "
                                    f"{arr.dtype}", modality="video")
    t, h, w, _ = arr.shape
    if t == 0 or h == 0 or w == 0:
        raise EmptyMediaError(f"video frame array is empty (shape {arr.shape})", modality="video")
    if t > sampling.max_frames:
        raise _too_large(f"video has {t} frames; the limit is {sampling.max_frames} (--max-video-frames)")
    if h * w > limits.max_video_pixels:
        raise _too_large(f"video frames are {w}x{h} = {w * h} pixels; the limit is {limits.max_video_pixels} pixels")
    arr = np.ascontiguousarray(arr)
    return DecodedVideo(arr.copy(), np.arange(t, dtype=np.float64) / sampling.fps,
                        _digest(memoryview(arr).cast("B"), "frames", sampling, str(arr.shape)), sampling)
