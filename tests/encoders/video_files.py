"""Small videos built in the test run with PyAV (the library epd decodes with), and hostile variants."""

from __future__ import annotations

import io
import struct

import av
import numpy as np


def frame_pixels(i: int, height: int, width: int) -> np.ndarray:
    """Frame ``i``: a flat colour that changes with ``i`` ([H, W, 3] uint8), so the frame a
    sampler picked can be told from its pixels after lossy coding."""
    value = (40 + 50 * i) % 256
    return np.full((height, width, 3), (value, 255 - value, (value * 3) % 256), dtype=np.uint8)


def video(fmt: str = "mp4", codec: str = "libx264", frames: int = 8, fps: int = 4, size: tuple[int, int] = (24, 32),
          pixels=frame_pixels, faststart: bool = False) -> bytes:
    """An encoded video: ``frames`` frames of ``size`` (height, width) at ``fps``, each
    ``pixels(i, h, w)``; ``fmt`` mp4 or webm (``codec`` libx264, mpeg4, libvpx, libvpx-vp9, or
    mjpeg, which epd refuses). ``faststart``: MP4 with its index (moov) before the media data,
    as web servers stream it (FFmpeg rewrites the file for that, so it goes through a temp file)."""
    h, w = size
    if faststart:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            path = f"{d}/v.mp4"
            _write(path, fmt, codec, frames, fps, h, w, pixels, {"movflags": "faststart"})
            with open(path, "rb") as f:
                return f.read()
    buf = io.BytesIO()
    _write(buf, fmt, codec, frames, fps, h, w, pixels, {})
    return buf.getvalue()


def _write(target, fmt, codec, frames, fps, h, w, pixels, container_options) -> None:
    options = {"preset": "ultrafast"} if codec == "libx264" else {}
    with av.open(target, "w", format=fmt, options=container_options) as c:
        s = c.add_stream(codec, rate=fps, options=options)
        s.width, s.height, s.pix_fmt = w, h, "yuvj420p" if codec == "mjpeg" else "yuv420p"
        for i in range(frames):
            for p in s.encode(av.VideoFrame.from_ndarray(pixels(i, h, w), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def audio_only_mp4() -> bytes:
    """An MP4 holding one AAC stream and no video."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def with_declared_frames(mp4: bytes, frames: int) -> bytes:
    """``mp4`` with its ``stts`` (time-to-sample) table claiming ``frames`` samples (FFmpeg's
    frame count), while the file still holds only its real ones."""
    i = mp4.find(b"stts")
    entries = struct.unpack(">I", mp4[i + 8:i + 12])[0]
    assert entries == 1, "expected a constant-rate stts table"
    return mp4[:i + 12] + struct.pack(">I", frames) + mp4[i + 16:]
