"""epd.encoders.image / audio / media_limits: decoding untrusted image/audio bytes under limits.

The hostile inputs are built so that a naive decoder would visibly misbehave (allocate
hundreds of MB, walk every frame, return the wrong frame, or raise a different error),
and each test checks the typed error, a spy, or a tracemalloc peak instead of timing.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import struct
import tracemalloc
import warnings
import zlib

import numpy as np
import pytest
import soundfile as sf
from PIL import GifImagePlugin, Image, ImageFile

from epd.encoders import audio, image
from epd.encoders.audio import decode_audio, normalize_audio
from epd.encoders.image import decode_image, normalize_image
from epd.encoders.media_limits import (
    CorruptMediaError,
    EmptyMediaError,
    MediaError,
    MediaLimits,
    MediaTooLargeError,
    UnsupportedMediaError,
)

# --------------------------------------------------------------------------- helpers


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR says width x height RGB but whose IDAT holds a few rows at most."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + png_chunk(b"IEND", b"")
    )


@pytest.fixture(scope="module")
def astronaut() -> np.ndarray:
    data = pytest.importorskip("skimage.data")
    return data.astronaut()  # 512x512x3 uint8


@pytest.fixture(scope="module")
def coffee() -> np.ndarray:
    data = pytest.importorskip("skimage.data")
    return data.coffee()  # 400x600x3 uint8


def sine(freq: float, rate: int, seconds: float, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(round(rate * seconds))) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def write_audio(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def wav_bytes(payload: bytes, *, rate: int = 16000, channels: int = 1, bits: int = 16,
              data_size: int | None = None) -> bytes:
    """A hand-made PCM RIFF/WAVE file; ``data_size`` may lie about the payload length."""
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * block, block, bits)
    size = len(payload) if data_size is None else data_size
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", size) + payload
    return b"RIFF" + struct.pack("<I", len(body)) + body


def flac_with_total_frames(samples: np.ndarray, rate: int, total_frames: int) -> bytes:
    """A real FLAC whose STREAMINFO total-samples field is overwritten."""
    data = bytearray(write_audio(samples, rate, "FLAC"))
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # STREAMINFO first
    field = int.from_bytes(data[8 + 13 : 8 + 18], "big")
    field = (field & ~((1 << 36) - 1)) | total_frames
    data[8 + 13 : 8 + 18] = field.to_bytes(5, "big")
    return bytes(data)


def peak_hz(x: np.ndarray, rate: int) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spec) * rate / len(x))


# --------------------------------------------------------------------------- errors / API


def test_error_hierarchy_and_modality():
    for cls in (UnsupportedMediaError, CorruptMediaError, MediaTooLargeError, EmptyMediaError):
        assert issubclass(cls, MediaError) and issubclass(cls, ValueError)
    err = MediaTooLargeError("too big", modality="audio")
    assert err.modality == "audio"
    for clone in (copy.copy(err), pickle.loads(pickle.dumps(err))):
        assert type(clone) is MediaTooLargeError and clone.modality == "audio" and str(clone) == "too big"


def test_limits_defaults_and_frozen():
    lim = MediaLimits()
    assert lim.max_image_bytes == 20 * 2**20 and lim.max_image_pixels == 4096 * 4096
    assert lim.max_audio_bytes == 50 * 2**20 and lim.max_audio_seconds == 600.0
    with pytest.raises(AttributeError):
        lim.max_image_pixels = 1  # type: ignore[misc]
    assert image.IMAGE_FORMATS == {"PNG", "JPEG", "WEBP", "GIF", "BMP"}


def test_module_leaves_pillow_globals_alone():
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    assert Image.MAX_IMAGE_PIXELS is not None


# --------------------------------------------------------------------------- real images


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP", "GIF"])
def test_real_images_decode_to_rgb(fmt, astronaut, coffee):
    for arr in (astronaut, coffee):
        img = decode_image(encode(Image.fromarray(arr), fmt))
        assert img.mode == "RGB"
        assert img.size == (arr.shape[1], arr.shape[0])
        out = np.asarray(img)
        if fmt in ("PNG", "BMP"):
            np.testing.assert_array_equal(out, arr)
        elif fmt in ("JPEG", "WEBP"):
            assert np.abs(out.astype(int) - arr).mean() < 8
        else:  # GIF: 256-colour quantised
            assert np.abs(out.astype(int) - arr).mean() < 20


def test_lossless_webp_and_grace_hopper(astronaut):
    img = decode_image(encode(Image.fromarray(astronaut), "WEBP", lossless=True))
    np.testing.assert_array_equal(np.asarray(img), astronaut)

    cbook = pytest.importorskip("matplotlib.cbook")
    with cbook.get_sample_data("grace_hopper.jpg") as fh:
        data = fh.read()
    ref = Image.open(io.BytesIO(data))
    img = decode_image(data)
    assert img.mode == "RGB" and img.size == ref.size == (512, 600)


def test_accepts_bytearray_and_memoryview(coffee):
    data = encode(Image.fromarray(coffee), "PNG")
    for view in (bytearray(data), memoryview(data)):
        assert decode_image(view).size == (600, 400)
    with pytest.raises(TypeError):
        decode_image("not bytes")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- transforms


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_exif_orientation_applied(fmt):
    stored = Image.new("RGB", (64, 32), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 16, 16))  # red block at the stored top-left
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    data = encode(stored, fmt, exif=exif.tobytes(), **({"quality": 95} if fmt != "PNG" else {}))
    img = decode_image(data)
    assert img.size == (32, 64)
    arr = np.asarray(img).astype(int)
    assert arr[4, 27, 0] > 200 and arr[4, 27, 2] < 60  # top-left went to the top-right
    assert arr[60, 4, 2] > 200


def test_alpha_composited_onto_background():
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 255))
    rgba.putpixel((0, 0), (200, 100, 50, 0))  # fully transparent
    rgba.putpixel((1, 0), (200, 100, 50, 128))  # half transparent
    data = encode(rgba, "PNG")
    out = np.asarray(decode_image(data)).astype(int)
    assert tuple(out[0, 0]) == (255, 255, 255)
    assert tuple(out[0, 2]) == (10, 20, 30)
    assert np.allclose(out[0, 1], [(200 * 128 + 255 * 127) / 255, (100 * 128 + 255 * 127) / 255,
                                   (50 * 128 + 255 * 127) / 255], atol=2)
    out = np.asarray(decode_image(data, background=(0, 0, 255)))
    assert tuple(out[0, 0]) == (0, 0, 255)
    out = np.asarray(decode_image(encode(rgba, "WEBP", lossless=True), background=(0, 255, 0)))
    assert tuple(out[0, 0]) == (0, 255, 0)
    with pytest.raises(ValueError):
        decode_image(data, background=(0, 0, 256))


def test_la_and_palette_transparency():
    la = Image.new("LA", (3, 1), (80, 255))
    la.putpixel((0, 0), (80, 0))
    out = np.asarray(decode_image(encode(la, "PNG"), background=(1, 2, 3)))
    assert tuple(out[0, 0]) == (1, 2, 3) and tuple(out[0, 1]) == (80, 80, 80)

    pal = Image.new("P", (3, 1), 1)
    pal.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0] + [0] * (256 * 3 - 9))
    pal.putpixel((0, 0), 2)
    for fmt in ("PNG", "GIF"):
        out = np.asarray(decode_image(encode(pal, fmt, transparency=2), background=(9, 9, 9)))
        assert tuple(out[0, 0]) == (9, 9, 9), fmt
        assert tuple(out[0, 1]) == (255, 0, 0), fmt

    rgb = Image.new("RGB", (2, 1), (1, 2, 3))  # single-colour tRNS on a truecolour PNG
    rgb.putpixel((1, 0), (4, 5, 6))
    out = np.asarray(decode_image(encode(rgb, "PNG", transparency=(1, 2, 3)), background=(0, 0, 0)))
    assert tuple(out[0, 0]) == (0, 0, 0) and tuple(out[0, 1]) == (4, 5, 6)


def test_16bit_greyscale_is_scaled_not_clipped():
    ramp = (np.arange(256, dtype=np.uint16) * 257).reshape(16, 16)
    img = decode_image(encode(Image.fromarray(ramp), "PNG"))
    out = np.asarray(img)
    assert img.mode == "RGB"
    np.testing.assert_array_equal(out[..., 0], np.arange(256).reshape(16, 16))


def test_cmyk_jpeg_and_1bit_and_greyscale():
    assert decode_image(encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG")).mode == "RGB"
    assert np.asarray(decode_image(encode(Image.new("1", (8, 8), 1), "BMP"))).min() == 255
    assert tuple(np.asarray(decode_image(encode(Image.new("L", (8, 8), 77), "PNG")))[0, 0]) == (77, 77, 77)


# --------------------------------------------------------------------------- bad images


def test_truncated_images_are_corrupt(astronaut):
    png = encode(Image.fromarray(astronaut), "PNG")
    jpg = encode(Image.fromarray(astronaut), "JPEG")
    for data in (png[: len(png) // 2], png[:40], jpg[: len(jpg) // 2]):
        with pytest.raises(CorruptMediaError) as ei:
            decode_image(data)
        assert ei.value.modality == "image"


def test_flipped_bits_are_corrupt(astronaut):
    png = bytearray(encode(Image.fromarray(astronaut), "PNG"))
    png[len(png) // 2 : len(png) // 2 + 64] = b"\x00" * 64  # IDAT CRC mismatch / bad zlib
    with pytest.raises(CorruptMediaError):
        decode_image(bytes(png))


def test_random_and_non_image_bytes():
    rng = np.random.default_rng(0)
    for _ in range(20):
        with pytest.raises((CorruptMediaError, UnsupportedMediaError)):
            decode_image(rng.bytes(1000))
    with pytest.raises(CorruptMediaError, match="PNG, JPEG"):
        decode_image(b"hello, this is definitely text and not an image")


@pytest.mark.parametrize("fmt", ["TIFF", "ICO", "PPM", "PCX", "TGA"])
def test_other_formats_unsupported(fmt):
    data = encode(Image.new("RGB", (8, 8), (1, 2, 3)), fmt)
    exc = UnsupportedMediaError if fmt != "TGA" else (UnsupportedMediaError, CorruptMediaError)  # TGA has no magic
    with pytest.raises(exc) as ei:
        decode_image(data)
    assert "PNG" in str(ei.value)
    if fmt != "TGA":
        assert fmt in str(ei.value)


def test_empty_and_zero_size():
    with pytest.raises(EmptyMediaError):
        decode_image(b"")
    ihdr = struct.pack(">IIBBBBB", 0, 10, 8, 2, 0, 0, 0)
    zero_png = b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IEND", b"")
    with pytest.raises(EmptyMediaError):
        decode_image(zero_png)
    zero_gif = b"GIF89a" + struct.pack("<HHBBB", 7, 0, 0, 0, 0) + b";"
    with pytest.raises(EmptyMediaError):
        decode_image(zero_gif)
    with pytest.raises(EmptyMediaError):
        normalize_image(Image.new("RGB", (0, 3)))


def test_byte_limit():
    data = encode(Image.new("RGB", (64, 64)), "BMP")
    with pytest.raises(MediaTooLargeError, match=str(len(data))):
        decode_image(data, limits=MediaLimits(max_image_bytes=len(data) - 1))


# --------------------------------------------------------------------------- bombs


def test_20000x20000_png_rejected_before_decoding():
    data = png_header_only(20000, 20000)  # 400M pixels would be 1.2 GB of RGB
    assert len(data) < 200
    with pytest.raises(MediaTooLargeError, match="400000000"):
        decode_image(data)


def test_pixel_limit_checked_before_load():
    # 5000x5000 is below Pillow's own bomb threshold, so only our check stands between
    # this file and a 75 MB allocation; decoding first would report truncation instead.
    data = png_header_only(5000, 5000)
    with pytest.raises(MediaTooLargeError, match="16777216"):
        decode_image(data)
    with pytest.raises(CorruptMediaError):  # with a big enough limit it is just truncated
        decode_image(data, limits=MediaLimits(max_image_pixels=5000 * 5000))


def test_pixel_limit_checked_before_any_pillow_parser(monkeypatch, astronaut):
    def no_open(*a, **k):
        raise AssertionError("Image.open must not run for an oversized image")

    small = MediaLimits(max_image_pixels=512 * 512 - 1)
    variants = {
        "PNG": encode(Image.fromarray(astronaut), "PNG"),
        "GIF": encode(Image.fromarray(astronaut), "GIF"),
        "BMP": encode(Image.fromarray(astronaut), "BMP"),
        "JPEG": encode(Image.fromarray(astronaut), "JPEG"),
        "WEBP-VP8": encode(Image.fromarray(astronaut), "WEBP"),
        "WEBP-VP8L": encode(Image.fromarray(astronaut), "WEBP", lossless=True),
        "WEBP-VP8X": encode(Image.fromarray(astronaut).convert("RGBA"), "WEBP"),
    }
    monkeypatch.setattr(Image, "open", no_open)
    for _name, data in variants.items():
        with pytest.raises(MediaTooLargeError):
            decode_image(data, limits=small)


def test_huge_webp_canvas_never_reaches_pillow(monkeypatch):
    # Pillow's WebP plugin allocates the canvas (12000^2 * 4 = 576 MB) inside Image.open.
    vp8x = bytes([0x02, 0, 0, 0]) + (12000 - 1).to_bytes(3, "little") + (12000 - 1).to_bytes(3, "little")
    body = b"WEBP" + b"VP8X" + struct.pack("<I", len(vp8x)) + vp8x
    data = b"RIFF" + struct.pack("<I", len(body)) + body
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("Image.open called"))
    with pytest.raises(MediaTooLargeError, match="144000000"):
        decode_image(data)


@pytest.mark.parametrize("action", ["error", "default", "ignore"])
def test_pillow_bomb_warning_zone_is_an_error(action, monkeypatch):
    # Our limit raised above Pillow's MAX_IMAGE_PIXELS: Pillow only *warns* for
    # 10000x10000 (100M > 89M), which must still end in MediaTooLargeError.
    data = png_header_only(10000, 10000)
    lim = MediaLimits(max_image_pixels=10**9)
    with warnings.catch_warnings():
        warnings.simplefilter(action)
        with pytest.raises(MediaTooLargeError):
            decode_image(data, limits=lim)
    # ...and our own header check applies without any Pillow decision involved.
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("Image.open called"))
    with pytest.raises(MediaTooLargeError):
        decode_image(data, limits=lim)


def test_pixel_limit_holds_when_pillow_bomb_check_disabled(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    with pytest.raises(MediaTooLargeError):
        decode_image(png_header_only(20000, 20000))


def test_pillow_max_image_pixels_respected(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(MediaTooLargeError, match="limit is 100 pixels"):
        decode_image(encode(Image.new("RGB", (20, 20)), "PNG"))


def _gif_parts(colour_index: int, size: int = 64) -> tuple[bytes, bytes]:
    """(header incl. global palette, one frame's bytes) of a single-frame GIF."""
    img = Image.new("P", (size, size), colour_index)
    img.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * (252 * 3))
    data = encode(img, "GIF", optimize=False)
    flags = data[10]
    head_end = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    assert data[-1:] == b";"
    return data[:head_end], data[head_end:-1]


def test_gif_with_10000_frames_decodes_first_frame_only(monkeypatch):
    head, red = _gif_parts(1)
    head_g, green = _gif_parts(2)
    assert head == head_g
    data = head + red + green * 9_999 + b";"  # built by repetition: cheap
    assert len(data) < MediaLimits().max_image_bytes

    visited: list[int] = []
    real_seek = GifImagePlugin.GifImageFile._seek

    def spy(self, frame, update_image=True):
        visited.append(frame)
        return real_seek(self, frame, update_image)

    monkeypatch.setattr(GifImagePlugin.GifImageFile, "_seek", spy)
    img = decode_image(data)
    assert img.size == (64, 64)
    assert tuple(np.asarray(img)[10, 10]) == (255, 0, 0)  # frame 0, not the last one
    # n_frames / is_animated / seek / ImageSequence would all visit frame 1 or beyond.
    assert max(visited) == 0


def test_gif_later_frame_bomb_is_never_touched():
    head, red = _gif_parts(1, size=8)
    _, frame2 = _gif_parts(2, size=8)
    # Frame 2's descriptor claims 60000x60000 at (0, 0): Pillow raises a decompression
    # bomb error as soon as anything seeks to it.
    i = frame2.index(b"\x2c")
    bomb = frame2[: i + 5] + struct.pack("<HH", 60000, 60000) + frame2[i + 9 :]
    img = decode_image(head + red + bomb + b";")
    assert img.size == (8, 8) and tuple(np.asarray(img)[0, 0]) == (255, 0, 0)


def test_animated_png_and_webp_first_frame():
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    for fmt, kw in (("PNG", {}), ("WEBP", {"lossless": True})):
        data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=50, **kw)
        assert tuple(np.asarray(decode_image(data))[0, 0]) == (255, 0, 0), fmt


def test_mpo_first_picture():
    left, right = Image.new("RGB", (16, 8), (255, 0, 0)), Image.new("RGB", (16, 8), (0, 0, 255))
    data = encode(left, "MPO", save_all=True, append_images=[right])
    assert Image.open(io.BytesIO(data)).format == "MPO"
    out = np.asarray(decode_image(data)).astype(int)
    assert out.shape == (8, 16, 3) and out[4, 8, 0] > 200 and out[4, 8, 2] < 60


def test_jpeg_scan_bomb_rejected(astronaut):
    data = encode(Image.fromarray(astronaut), "JPEG", progressive=True, quality=90)
    assert decode_image(data).size == (512, 512)  # a normal progressive JPEG is fine
    sos = [i for i in range(len(data) - 1) if data[i] == 0xFF and data[i + 1] == 0xDA]
    scans = [data[a:b] for a, b in zip(sos, sos[1:] + [len(data) - 2])]
    smallest = min(scans, key=len)
    bomb = data[:-2] + smallest * 1000 + data[-2:]
    with pytest.raises(MediaTooLargeError, match="scans"):
        decode_image(bomb)


# --------------------------------------------------------------------------- normalize_image


def test_normalize_image():
    rgba = Image.new("RGBA", (5, 4), (0, 0, 0, 0))
    out = normalize_image(rgba, background=(7, 8, 9))
    assert out.mode == "RGB" and out.size == (5, 4) and tuple(np.asarray(out)[0, 0]) == (7, 8, 9)
    assert rgba.mode == "RGBA"  # input untouched

    rgb = Image.new("RGB", (3, 3), (1, 2, 3))
    out = normalize_image(rgb)
    assert out is not rgb and out.tobytes() == rgb.tobytes()

    with pytest.raises(MediaTooLargeError):
        normalize_image(Image.new("RGB", (20, 20)), limits=MediaLimits(max_image_pixels=399))

    tiff = Image.open(io.BytesIO(encode(Image.new("RGB", (4, 4)), "TIFF")))
    with pytest.raises(UnsupportedMediaError):
        normalize_image(tiff)
    assert normalize_image(tiff.convert("RGB")).size == (4, 4)  # explicit conversion opts out

    exif = Image.Exif()
    exif[0x0112] = 8
    rotated = Image.open(io.BytesIO(encode(Image.new("RGB", (10, 4)), "JPEG", exif=exif.tobytes())))
    assert normalize_image(rotated).size == (4, 10)

    with pytest.raises(TypeError):
        normalize_image(np.zeros((4, 4, 3), np.uint8))  # type: ignore[arg-type]


def test_normalize_lazy_truncated_image(astronaut):
    png = encode(Image.fromarray(astronaut), "PNG")
    lazy = Image.open(io.BytesIO(png[: len(png) // 2]))
    with pytest.raises(CorruptMediaError):
        normalize_image(lazy)


# --------------------------------------------------------------------------- audio: formats


AUDIO_CASES = [
    ("WAV", "PCM_16", 44100),
    ("WAV", "PCM_24", 44100),
    ("WAV", "FLOAT", 44100),
    ("WAV", "PCM_U8", 24000),
    ("FLAC", "PCM_16", 44100),
    ("FLAC", "PCM_24", 24000),
    ("OGG", "VORBIS", 44100),
    ("OGG", "OPUS", 48000),
    ("MP3", "MPEG_LAYER_III", 44100),
]


@pytest.mark.parametrize(("fmt", "subtype", "rate"), AUDIO_CASES)
def test_audio_formats_stereo_downmixed_and_resampled(fmt, subtype, rate):
    if fmt not in sf.available_formats() or subtype not in sf.available_subtypes(fmt):
        pytest.skip(f"libsndfile lacks {fmt}/{subtype}")
    left = sine(440, rate, 1.5)
    stereo = np.stack([left, 0.5 * left], axis=1)
    data = write_audio(stereo, rate, fmt, subtype)
    out = decode_audio(data, target_sample_rate=16000)
    assert out.dtype == np.float32 and out.ndim == 1 and out.flags.c_contiguous
    with sf.SoundFile(io.BytesIO(data)) as f:
        frames = f.frames
    assert out.shape == (math.ceil(frames * 16000 / rate),)
    assert abs(frames / rate - 1.5) < 0.1
    assert abs(peak_hz(out, 16000) - 440) < 2
    rms = float(np.sqrt(np.mean(out[2000:-2000] ** 2)))
    assert abs(rms - 0.75 * 0.5 / math.sqrt(2)) < 0.05  # mean of 1.0x and 0.5x channels


def test_audio_downmix_exact_without_resampling():
    left = sine(300, 16000, 0.5)
    right = sine(700, 16000, 0.5, amp=0.25)
    data = write_audio(np.stack([left, right], 1), 16000, "WAV", "FLOAT")
    out = decode_audio(data, target_sample_rate=16000)
    np.testing.assert_allclose(out, (left + right) / 2, atol=1e-7)


@pytest.mark.parametrize(("rate", "seconds"), [(44100, 2.0), (24000, 1.5), (8000, 1.0), (47999, 1.0), (11025, 0.7)])
def test_resampled_length_and_pitch(rate, seconds):
    x = sine(1000, rate, seconds)
    out = decode_audio(write_audio(x, rate, "WAV", "PCM_16"), target_sample_rate=16000)
    assert out.shape == (math.ceil(len(x) * 16000 / rate),)
    assert abs(peak_hz(out, 16000) - 1000) < 3


def test_odd_sample_rate_uses_bounded_kernel():
    # 47999 -> 16000 is coprime: torchaudio's exact kernel would be 16000 x ~48000 floats
    # (3 GB). The resampler must approximate the ratio instead.
    kernel, _ = audio._resample_cost(47999, 16000)
    assert kernel > 10**8
    tracemalloc.start()
    try:
        out = normalize_audio(sine(1000, 47999, 0.5), 47999, target_sample_rate=16000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.shape == (math.ceil(int(round(47999 * 0.5)) * 16000 / 47999),)
    assert peak < 64 * 2**20


# --------------------------------------------------------------------------- audio: bad input


def test_zero_length_and_empty_audio():
    with pytest.raises(EmptyMediaError):
        decode_audio(wav_bytes(b""), target_sample_rate=16000)
    with pytest.raises(EmptyMediaError):
        decode_audio(write_audio(np.zeros((0, 2), np.float32), 16000, "WAV"), target_sample_rate=16000)
    with pytest.raises(EmptyMediaError) as ei:
        decode_audio(b"", target_sample_rate=16000)
    assert ei.value.modality == "audio"


def test_wav_header_claiming_two_hours():
    # The data chunk says 2 h of 16 kHz PCM16 (230 MB); only 2000 bytes follow.
    data = wav_bytes(b"\x01\x00" * 1000, data_size=2 * 3600 * 16000 * 2)
    assert len(data) < 3000
    with pytest.raises(MediaTooLargeError, match="7200"):
        decode_audio(data, target_sample_rate=16000)


def test_streaming_wav_with_unknown_length_is_accepted():
    payload = (sine(440, 16000, 1.0) * 32767).astype("<i2").tobytes()
    out = decode_audio(wav_bytes(payload, data_size=0xFFFFFFFF), target_sample_rate=16000)
    assert out.shape == (16000,)


def test_flac_header_claiming_two_hours():
    x = sine(440, 48000, 0.1)
    data = flac_with_total_frames(np.stack([x, x], 1), 48000, 2 * 3600 * 48000)
    with pytest.raises(MediaTooLargeError, match="7200"):
        decode_audio(data, target_sample_rate=16000)


def test_lying_flac_header_read_with_bounded_memory():
    # Header: 500 s of 48 kHz stereo (under the limit); data: 0.1 s. Reading the whole
    # declared length at once (sf.read) allocates 500*48000*2 float32 = 192 MB first.
    x = sine(440, 48000, 0.1)
    data = flac_with_total_frames(np.stack([x, x], 1), 48000, 500 * 48000)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptMediaError):
            decode_audio(data, target_sample_rate=16000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20


def test_duration_and_byte_limits():
    data = write_audio(sine(440, 16000, 2.0), 16000, "WAV", "PCM_16")
    with pytest.raises(MediaTooLargeError, match="limit is 1 s"):
        decode_audio(data, target_sample_rate=16000, limits=MediaLimits(max_audio_seconds=1.0))
    with pytest.raises(MediaTooLargeError, match=str(len(data))):
        decode_audio(data, target_sample_rate=16000, limits=MediaLimits(max_audio_bytes=1000))
    assert decode_audio(data, target_sample_rate=16000, limits=MediaLimits(max_audio_seconds=2.0)).shape == (32000,)


def test_sample_rate_and_channel_limits():
    with pytest.raises(MediaTooLargeError, match="384000"):
        decode_audio(write_audio(sine(440, 384000, 0.01), 384000, "WAV"), target_sample_rate=16000)
    many = np.zeros((100, 70), np.float32)
    with pytest.raises(MediaTooLargeError, match="70 channels"):
        decode_audio(write_audio(many, 16000, "WAV"), target_sample_rate=16000)


def test_non_audio_bytes_are_corrupt():
    with pytest.raises(CorruptMediaError):
        decode_audio(b"this is a text file someone called speech.wav" * 10, target_sample_rate=16000)
    # RIFF/WAVE magic but a garbage body
    fake = b"RIFF" + struct.pack("<I", 1000) + b"WAVE" + np.random.default_rng(0).bytes(1000)
    with pytest.raises(CorruptMediaError):
        decode_audio(fake, target_sample_rate=16000)
    # FLAC / OGG magic followed by junk
    for magic in (b"fLaC", b"OggS", b"ID3\x03\x00"):
        with pytest.raises(CorruptMediaError):
            decode_audio(magic + b"\x00\x11\x22" * 300, target_sample_rate=16000)
    rng = np.random.default_rng(1)
    for _ in range(10):
        with pytest.raises((CorruptMediaError, UnsupportedMediaError)):
            decode_audio(rng.bytes(2000), target_sample_rate=16000)


def test_truncated_flac_is_corrupt():
    data = write_audio(sine(440, 44100, 2.0), 44100, "FLAC")
    with pytest.raises(CorruptMediaError):
        decode_audio(data[: len(data) // 2], target_sample_rate=16000)


def test_other_audio_formats_unsupported():
    aiff = write_audio(sine(440, 16000, 0.1), 16000, "AIFF")
    with pytest.raises(UnsupportedMediaError, match="AIFF"):
        decode_audio(aiff, target_sample_rate=16000)
    m4a = b"\x00\x00\x00\x20ftypM4A \x00\x00\x00\x00" + b"\x00" * 200
    with pytest.raises(UnsupportedMediaError, match="MP4"):
        decode_audio(m4a, target_sample_rate=16000)


def test_nan_float_wav_is_corrupt():
    x = sine(440, 16000, 0.1)
    x[10] = np.nan
    with pytest.raises(CorruptMediaError, match="NaN"):
        decode_audio(write_audio(x, 16000, "WAV", "FLOAT"), target_sample_rate=16000)


def test_bad_target_rate():
    data = write_audio(sine(440, 16000, 0.1), 16000, "WAV")
    with pytest.raises(ValueError):
        decode_audio(data, target_sample_rate=0)
    with pytest.raises(TypeError):
        decode_audio(data, target_sample_rate=16000.0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- normalize_audio


def test_normalize_audio_stereo_float():
    x = sine(440, 44100, 1.0)
    out = normalize_audio(np.stack([x, 0.5 * x], 1), 44100, target_sample_rate=16000)
    assert out.dtype == np.float32 and out.shape == (16000,)
    ref = normalize_audio(0.75 * x, 44100, target_sample_rate=16000)
    np.testing.assert_allclose(out, ref, atol=1e-6)


def test_normalize_audio_integer_pcm():
    x = sine(440, 16000, 0.25, amp=0.9)
    i16 = np.round(x * 32767).astype(np.int16)
    out = normalize_audio(i16, 16000, target_sample_rate=16000)
    np.testing.assert_allclose(out, x, atol=1e-4)
    i32 = np.round(x.astype(np.float64) * 2**31 * 0.999).astype(np.int32)
    np.testing.assert_allclose(normalize_audio(i32, 16000, target_sample_rate=16000), x, atol=1e-3)
    u8 = np.clip(np.round(x * 128 + 128), 0, 255).astype(np.uint8)
    np.testing.assert_allclose(normalize_audio(u8, 16000, target_sample_rate=16000), x, atol=1e-2)
    with pytest.raises(UnsupportedMediaError, match="int64"):
        normalize_audio(i16.astype(np.int64), 16000, target_sample_rate=16000)
    with pytest.raises(UnsupportedMediaError):
        normalize_audio(i16 > 0, 16000, target_sample_rate=16000)


def test_normalize_audio_shapes_and_limits():
    x = sine(440, 16000, 0.5)
    with pytest.raises(MediaTooLargeError, match="transpose"):
        normalize_audio(np.stack([x, x]), 16000, target_sample_rate=16000)  # [2, n]
    with pytest.raises(UnsupportedMediaError):
        normalize_audio(x.reshape(1, -1, 1), 16000, target_sample_rate=16000)
    with pytest.raises(EmptyMediaError):
        normalize_audio(np.zeros(0, np.float32), 16000, target_sample_rate=16000)
    with pytest.raises(UnsupportedMediaError):
        normalize_audio(x, 0, target_sample_rate=16000)
    with pytest.raises(MediaTooLargeError):
        normalize_audio(x, 400_000, target_sample_rate=16000)
    y = x.copy()
    y[3] = np.inf
    with pytest.raises(CorruptMediaError):
        normalize_audio(y, 16000, target_sample_rate=16000)


def test_normalize_audio_duration_checked_before_conversion():
    # 10 hours of 16 kHz audio as a zero-stride view: converting it first would
    # allocate 2.3 GB of float32.
    ten_hours = np.broadcast_to(np.int16(0), (10 * 3600 * 16000,))
    tracemalloc.start()
    try:
        with pytest.raises(MediaTooLargeError, match="36000"):
            normalize_audio(ten_hours, 16000, target_sample_rate=16000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20


def test_normalize_audio_returns_fresh_array():
    x = sine(440, 16000, 0.1)
    x.setflags(write=False)
    out = normalize_audio(x, 16000, target_sample_rate=16000)
    assert not np.shares_memory(out, x) and out.flags.writeable
    np.testing.assert_array_equal(out, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's warning about read-only arrays
        out = normalize_audio(x, 16000, target_sample_rate=24000)
    assert out.shape == (math.ceil(len(x) * 1.5),)
    stereo = np.stack([x, x], 1)
    out = normalize_audio(stereo, 16000, target_sample_rate=24000)
    assert out.shape == (math.ceil(len(x) * 1.5),) and stereo.shape == (len(x), 2)
