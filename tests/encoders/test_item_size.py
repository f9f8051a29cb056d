"""A media item's processed size, from its header, against ``MediaLimits.max_item_bytes``:
Qwen-VL images over it are processed smaller, videos sampled with fewer frames (or refused
when the frame count is pinned), before any pixel is processed."""

from __future__ import annotations

import io

import pytest
from PIL import Image
from transformers import AutoConfig

from epd.encoders.media_limits import MediaLimits, MediaTooLargeError, UnsupportedMediaError
from epd.encoders.processor import MultiModalProcessor
from epd.launch.config import WIRE_TENSOR_MB, LaunchConfig
from epd.launch.spec import LaunchSpecError
from epd.messages import MAX_TENSOR_BYTES
from epd.models.tiny import create_tiny_model
from tests.encoders.video_files import video

CLIP = video("webm", "libvpx-vp9", frames=16, fps=4, size=(48, 64))  # 4 s: 8 frames at 2 fps


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = str(create_tiny_model("qwen2.5-vl", tmp_path_factory.mktemp("size") / "qwen2.5-vl"))
    return path, AutoConfig.from_pretrained(path)


def _processor(qwen, limit: int | None = None) -> MultiModalProcessor:
    path, config = qwen
    return MultiModalProcessor(path, config, limits=MediaLimits() if limit is None else MediaLimits(
        max_item_bytes=limit))


def _png(size) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buf, "PNG")
    return buf.getvalue()


def test_the_api_limit_is_what_a_worker_decodes():
    assert MediaLimits().max_item_bytes == MAX_TENSOR_BYTES
    assert LaunchConfig().max_mm_item_mb * 2**20 == WIRE_TENSOR_MB * 2**20 == MAX_TENSOR_BYTES
    with pytest.raises(LaunchSpecError, match="max_mm_item_mb"):
        LaunchConfig(max_mm_item_mb=257)
    with pytest.raises(LaunchSpecError, match="max_inflight_body_mb"):
        LaunchConfig(max_body_mb=64, max_inflight_body_mb=32)


def test_the_predicted_size_is_the_processed_size(qwen):
    p = _processor(qwen)
    for size in ((256, 128), (30, 40), (64, 20), (300, 300)):
        item = p.image_item(_png(size))
        assert p.patch_grid.image_bytes(*size) == item.data["pixel_values"].nbytes, size
    item = p.video_item(CLIP)
    assert 8 * p.patch_grid.frame_bytes(64, 48) == item.data["pixel_values_videos"].nbytes


def test_an_image_over_the_limit_is_processed_smaller(qwen):
    full = _processor(qwen).image_item(_png((256, 256)))
    limit = full.data["pixel_values"].nbytes // 2
    p = _processor(qwen, limit)
    p.check_image(_png((256, 256)), "messages[0].content[0]")  # fits once scaled: no error
    small = p.image_item(_png((256, 256)))
    assert 0 < small.data["pixel_values"].nbytes <= limit and small.num_tokens < full.num_tokens
    with pytest.raises(UnsupportedMediaError, match="aspect ratio"):  # the processor's own refusal, as a 400
        p.check_image(_png((1000, 2)), "messages[0].content[0]")


def test_a_video_over_the_limit_is_sampled_with_fewer_frames_unless_pinned(qwen):
    full = _processor(qwen).video_item(CLIP).data["pixel_values_videos"].nbytes
    p = _processor(qwen, full // 2)
    sampling = p.video_sampling()
    fitted = p.fit_video(CLIP, sampling)
    assert fitted.max_frames == 4 and fitted.fps == sampling.fps
    assert p.video_item(CLIP).data["pixel_values_videos"].nbytes <= full // 2  # the offline path fits it too
    with pytest.raises(MediaTooLargeError, match=r"messages\[0\]\.content\[1\]: 8 frames .* at most 4 frames"):
        p.fit_video(CLIP, p.video_sampling(num_frames=8), True, "messages[0].content[1]")
    assert p.fit_video(CLIP, p.video_sampling(num_frames=4), True) == p.video_sampling(num_frames=4)
    tiny = _processor(qwen, 100)  # not even one temporal patch fits
    with pytest.raises(MediaTooLargeError, match="--max-mm-item-mb"):
        tiny.fit_video(CLIP, sampling)
