"""epd.encoders.video: sampling frames from untrusted video bytes under limits.

Videos are made here with PyAV; each frame is a flat colour that names its index, so a
test can tell which source frame the sampler returned, even after lossy coding.
"""

from __future__ import annotations

import numpy as np
import pytest

from epd.encoders.media_limits import (
    CorruptMediaError,
    EmptyMediaError,
    MediaLimits,
    MediaTooLargeError,
    UnsupportedMediaError,
)
from epd.encoders.video import VideoSampling, decode_video, normalize_video
from tests.encoders.video_files import audio_only_mp4, frame_pixels, video, with_declared_frames


def _source_index(frame: np.ndarray, count: int) -> int:
    """The index i whose frame_pixels(i) is nearest to ``frame`` (mean over pixels)."""
    mean = frame.reshape(-1, 3).mean(0)
    refs = [frame_pixels(i, 1, 1)[0, 0].astype(float) for i in range(count)]
    return int(np.argmin([np.abs(mean - r).sum() for r in refs]))


@pytest.mark.parametrize("fmt,codec", [("mp4", "libx264"), ("mp4", "mpeg4"), ("webm", "libvpx"),
                                       ("webm", "libvpx-vp9")])
def test_frames_sampled_at_the_requested_fps(fmt, codec):
    data = video(fmt, codec, frames=8, fps=4)  # 2 s
    out = decode_video(data, sampling=VideoSampling(fps=2.0, max_frames=32))
    assert out.frames.shape == (4, 24, 32, 3) and out.frames.dtype == np.uint8
    np.testing.assert_allclose(out.timestamps_s, [0.0, 0.5, 1.0, 1.5])
    assert [_source_index(f, 8) for f in out.frames] == [0, 2, 4, 6]
    assert out.header.codec in ("h264", "mpeg4", "vp8", "vp9") and out.header.frames == 8


def test_max_frames_spreads_samples_over_the_whole_video():
    data = video(frames=8, fps=4)
    out = decode_video(data, sampling=VideoSampling(fps=4.0, max_frames=2))
    np.testing.assert_allclose(out.timestamps_s, [0.0, 1.0])
    assert [_source_index(f, 8) for f in out.frames] == [0, 4]


def test_fps_above_the_stream_rate_never_repeats_frames():
    out = decode_video(video(frames=8, fps=4), sampling=VideoSampling(fps=30.0, max_frames=32))
    assert [_source_index(f, 8) for f in out.frames] == list(range(8))


def test_a_clip_shorter_than_one_sample_interval_gives_its_first_frame():
    out = decode_video(video(frames=1, fps=4), sampling=VideoSampling(fps=1.0))
    assert out.frames.shape[0] == 1 and _source_index(out.frames[0], 8) == 0


def test_digest_covers_bytes_and_sampling():
    data = video(frames=8, fps=4)
    a = decode_video(data, sampling=VideoSampling(fps=2.0))
    assert decode_video(data, sampling=VideoSampling(fps=2.0)).digest == a.digest
    assert decode_video(data, sampling=VideoSampling(fps=1.0)).digest != a.digest
    assert decode_video(data, sampling=VideoSampling(fps=2.0, max_frames=3)).digest != a.digest
    assert decode_video(video(frames=8, fps=4, size=(24, 48)), sampling=VideoSampling(fps=2.0)).digest != a.digest


def test_zero_length_and_garbage():
    with pytest.raises(EmptyMediaError):
        decode_video(b"")
    with pytest.raises(CorruptMediaError):
        decode_video(b"\x00\x00\x00\x20ftypisom" + b"\xab" * 400)
    with pytest.raises(CorruptMediaError):
        decode_video(b"not a video at all")


def test_truncated_files_are_rejected():
    mp4 = video(frames=30, fps=4)  # moov at the end: cut anywhere, the index is gone
    with pytest.raises(CorruptMediaError, match="truncated, damaged or not a video") as e:
        decode_video(mp4[: len(mp4) // 2])
    assert "Errno" not in str(e.value)  # FFmpeg's reason, not its error number
    streamable = video(frames=30, fps=4, faststart=True)  # index first: the demuxer finds the media data cut
    assert streamable.find(b"moov") < streamable.find(b"mdat")
    for cut in (len(streamable) // 2, len(streamable) - 200):
        with pytest.raises(CorruptMediaError, match="truncated"):
            decode_video(streamable[:cut], sampling=VideoSampling(fps=1.0))
    assert decode_video(streamable, sampling=VideoSampling(fps=1.0)).frames.shape[0] == 7
    webm = video("webm", "libvpx-vp9", frames=30, fps=4)  # 7.5 s; cut in half, the stream ends near 3.5 s
    with pytest.raises(CorruptMediaError, match="truncated"):
        decode_video(webm[: len(webm) // 2], sampling=VideoSampling(fps=1.0))


def test_bytes_limit_checked_first():
    data = video()
    with pytest.raises(MediaTooLargeError, match=f"limit is {len(data) - 1} bytes"):
        decode_video(data, limits=MediaLimits(max_video_bytes=len(data) - 1))


def test_resolution_limit_from_the_header():
    data = video(frames=1, size=(64, 64))
    with pytest.raises(MediaTooLargeError, match="64x64 = 4096 pixels; the limit is 4095"):
        decode_video(data, limits=MediaLimits(max_video_pixels=4095))


def test_huge_resolution_header_rejected_before_decoding(monkeypatch):
    """A 4096x4096 H.264 stream (a few KB of flat colour) over the default 3840x2160 cap:
    refused from the header, no frame decoded (the decoder is never asked)."""
    import av

    data = video(frames=1, size=(4096, 4096))
    assert len(data) < 200_000
    calls = []
    real = av.container.InputContainer.decode
    monkeypatch.setattr(av.container.InputContainer, "decode",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    with pytest.raises(MediaTooLargeError, match="4096x4096"):
        decode_video(data)
    assert calls == []


def test_declared_frame_count_over_the_limit():
    data = with_declared_frames(video(frames=10, fps=1000), 100_000)  # 10^5 frames in the header
    with pytest.raises(MediaTooLargeError, match="100000 frames"):
        decode_video(data)


def test_duration_limit_from_the_header():
    data = video(frames=8, fps=4)  # 2 s
    with pytest.raises(MediaTooLargeError, match="2.0 s; the limit is 1.5 s"):
        decode_video(data, limits=MediaLimits(max_video_seconds=1.5))


def test_audio_only_container():
    with pytest.raises(UnsupportedMediaError, match="no video stream"):
        decode_video(audio_only_mp4())


def test_other_containers_and_image_brands_are_refused():
    with pytest.raises(UnsupportedMediaError, match="AVI"):
        decode_video(b"RIFF\x00\x00\x00\x00AVI LIST" + b"\x00" * 64)
    with pytest.raises(UnsupportedMediaError, match="avif"):
        decode_video(b"\x00\x00\x00\x1cftypavif" + b"\x00" * 64)


def test_unknown_codec_tags_are_refused():
    mp4 = video()
    i = mp4.find(b"avc1", 40)  # the sample entry, past the ftyp brands
    with pytest.raises(UnsupportedMediaError, match="codec is unknown"):
        decode_video(mp4[:i] + b"zzzz" + mp4[i + 4:])
    webm = video("webm", "libvpx")
    i = webm.find(b"V_VP8")
    with pytest.raises(UnsupportedMediaError, match="codec is unknown"):
        decode_video(webm[:i] + b"V_ZZ8" + webm[i + 5:])
    with pytest.raises(UnsupportedMediaError, match="codec mjpeg is not accepted"):
        decode_video(video(codec="mjpeg", fmt="mp4"))


def test_normalize_video_takes_frames_as_given():
    frames = np.stack([frame_pixels(i, 8, 8) for i in range(3)])
    out = normalize_video(frames, sampling=VideoSampling(fps=2.0, max_frames=4))
    assert np.array_equal(out.frames, frames) and out.frames is not frames
    np.testing.assert_allclose(out.timestamps_s, [0.0, 0.5, 1.0])
    assert normalize_video(frames, sampling=VideoSampling(fps=1.0)).digest != out.digest
    with pytest.raises(MediaTooLargeError, match="limit is 2"):
        normalize_video(frames, sampling=VideoSampling(max_frames=2))
    with pytest.raises(UnsupportedMediaError):
        normalize_video(frames.astype(np.float32))


@pytest.mark.parametrize("fmt,codec", [("mp4", "libx264"), ("webm", "libvpx-vp9")])
def test_damaged_files_give_media_errors_only(fmt, codec):
    """Seeded byte damage anywhere in a valid file: decoded, or a MediaError (a 400), never
    another exception (a 500 and a dead request handler)."""
    from epd.encoders.media_limits import MediaError

    data = video(fmt, codec, frames=8)
    rng = np.random.default_rng(0)
    outcomes = set()
    for _ in range(150):
        damaged = bytearray(data)
        for pos in rng.integers(0, len(data), size=int(rng.integers(1, 8))):
            damaged[pos] = int(rng.integers(0, 256))
        cut = len(damaged) if rng.random() < 0.7 else int(rng.integers(1, len(damaged)))
        try:
            out = decode_video(bytes(damaged[:cut]), sampling=VideoSampling(fps=2.0))
            assert 1 <= out.frames.shape[0] <= 32 and out.frames.dtype == np.uint8
            outcomes.add("decoded")
        except MediaError as e:
            outcomes.add(type(e).__name__)
    assert "decoded" in outcomes and len(outcomes) > 1


def test_large_sampled_frames_are_scaled_down_to_the_sample_budget():
    data = video(frames=4, fps=4, size=(48, 64))
    out = decode_video(data, sampling=VideoSampling(fps=4.0), limits=MediaLimits(max_video_sample_pixels=768))
    assert out.frames.shape == (4, 24, 32, 3)  # 64x48 -> 32x24 (768 pixels), aspect kept
    assert [_source_index(f, 4) for f in out.frames] == [0, 1, 2, 3]
    assert decode_video(data, sampling=VideoSampling(fps=4.0)).frames.shape == (4, 48, 64, 3)


def test_memory_follows_the_sample_budget_not_the_stream():
    """Four 1920x1080 frames (24.9 MB as RGB) sampled under a 64x36 budget: the Python heap
    (numpy included) never holds a full-size RGB frame."""
    import tracemalloc

    data = video(frames=4, fps=4, size=(1080, 1920))
    tracemalloc.start()
    try:
        out = decode_video(data, sampling=VideoSampling(fps=4.0), limits=MediaLimits(max_video_sample_pixels=64 * 36))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.frames.shape == (4, 36, 64, 3)
    assert peak < 1920 * 1080 * 3 // 2, peak


def test_decoding_work_is_bounded_from_the_header_and_while_decoding(monkeypatch):
    from epd.encoders import video as video_mod

    data = video(frames=8, fps=4)  # 8 frames of 32x24 = 6144 pixels to decode
    with pytest.raises(MediaTooLargeError, match="8 frames of 32x24 = 6144 pixels to decode; the limit is 6143"):
        decode_video(data, limits=MediaLimits(max_video_decoded_pixels=6143))
    assert decode_video(data, sampling=VideoSampling(fps=4.0),
                        limits=MediaLimits(max_video_decoded_pixels=6144)).frames.shape[0] == 8
    # A header that under-declares its frames: the budget still holds while decoding.
    real = video_mod._header

    def lying(container, kind, limits):
        h = real(container, kind, MediaLimits())  # checks pass on the declared count of 2
        return video_mod.VideoHeader(h.container, h.codec, h.width, h.height, h.duration_s, h.frame_rate, 2, h.start_s)

    monkeypatch.setattr(video_mod, "_header", lying)
    with pytest.raises(MediaTooLargeError, match="more than 3072 pixels decoded"):
        decode_video(data, sampling=VideoSampling(fps=4.0), limits=MediaLimits(max_video_decoded_pixels=3072))
