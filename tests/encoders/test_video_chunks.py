"""A long Qwen2.5-VL video encoded in chunks of temporal patches equals encoding it whole:
transformers' vision tower (5.24) attends within one temporal patch (``cu_seqlens`` from
``get_vision_cu_seqlens`` without ``merge_temporal``: a sequence per patch of ``h x w``
patches, windows inside it, rotary positions over height and width only), so the rows of
patches ``a..b`` of the whole video are the tower's output for grid ``(b - a, h, w)`` alone.
What lets epd split a long video across encode instances exactly (tiny random
checkpoint built here, a 16-frame clip: 8 temporal patches); the encode runner encodes
such a chunk (``EncodeRequest.temporal_ranges``), caches it under the item hash and the
range, and refuses a range or pixel rows that do not fit the item."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from epd.encoders.encoder_runner import EncoderRunner
from epd.encoders.processor import MultiModalProcessor
from epd.encoders.video import VideoSampling
from epd.messages import MessageError
from epd.models.tiny import create_tiny_model
from epd.router.encode_split import chunk_item
from tests.encoders.video_files import video

CLIP = video(frames=16, fps=4, size=(40, 56),
             pixels=lambda i, h, w: np.random.default_rng(300 + i).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return str(create_tiny_model("qwen2.5-vl", tmp_path_factory.mktemp("chunks") / "qwen2.5-vl"))


@pytest.fixture(scope="module")
def encoded(qwen_dir):
    """(processor's video item, the runner's tower)."""
    cfg = AutoConfig.from_pretrained(qwen_dir)
    item = MultiModalProcessor(qwen_dir, cfg).video_item(CLIP, VideoSampling(fps=4.0, max_frames=32))
    return item, EncoderRunner(qwen_dir, cfg, cache_bytes=0).vision


@pytest.mark.parametrize("cuts", [[4], [1, 3, 6], list(range(1, 8))], ids=["halves", "uneven", "every patch"])
def test_chunks_at_temporal_patch_boundaries_equal_the_whole(encoded, cuts):
    item, tower = encoded
    pixels, grid = item.data["pixel_values_videos"], item.data["video_grid_thw"]
    t, h, w = grid.tolist()
    assert t == 8
    per_patch, merge = h * w, 4  # pixel rows per temporal patch; 2x2 merge
    with torch.inference_mode():
        whole = tower.encode(pixels, grid[None])[0]
        bounds = [0, *cuts, t]
        chunks = [tower.encode(pixels[a * per_patch:b * per_patch], torch.tensor([[b - a, h, w]]))[0]
                  for a, b in zip(bounds, bounds[1:])]
    assert [c.shape[0] for c in chunks] == [(b - a) * per_patch // merge for a, b in zip(bounds, bounds[1:])]
    torch.testing.assert_close(torch.cat(chunks), whole, rtol=0, atol=1e-6)
    # not trivially equal: the temporal patches (different frames) encode differently
    rows = per_patch // merge
    assert not torch.allclose(whole[:rows], whole[rows:2 * rows], atol=1e-3)


def test_a_chunk_is_not_the_same_rows_of_a_wider_grid(encoded):
    """The control: the same patches encoded under another spatial grid (a wrong split)
    do not give those rows, so the equality above is the tower's temporal independence."""
    item, tower = encoded
    pixels, grid = item.data["pixel_values_videos"], item.data["video_grid_thw"]
    t, h, w = grid.tolist()
    with torch.inference_mode():
        whole = tower.encode(pixels, grid[None])[0]
        wrong = tower.encode(pixels, torch.tensor([[t // 2, 2 * h, w]]))[0]  # two patches read as one taller one
    assert wrong.shape == whole.shape
    assert not torch.allclose(wrong, whole, atol=1e-3)


def test_the_runner_encodes_a_chunk_and_caches_it_under_its_range(qwen_dir, encoded):
    item, tower = encoded
    runner = EncoderRunner(qwen_dir, AutoConfig.from_pretrained(qwen_dir))
    rows = item.num_tokens // 8  # per temporal patch
    whole = runner.encode([item])[0]
    assert (runner.cache.hits, runner.cache.misses) == (0, 1)
    chunks = runner.encode([chunk_item(item, (0, 3)), chunk_item(item, (3, 8))], [(0, 3), (3, 8)])
    assert (runner.cache.hits, runner.cache.misses) == (0, 3)  # a chunk is not the whole item's entry
    assert [c.shape[0] for c in chunks] == [3 * rows, 5 * rows]
    torch.testing.assert_close(torch.cat(chunks), whole, rtol=0, atol=1e-6)
    again = runner.encode([chunk_item(item, (3, 8))], [(3, 8)])[0]
    assert (runner.cache.hits, runner.cache.misses) == (1, 3) and torch.equal(again, chunks[1])  # same range: a hit
    runner.encode([chunk_item(item, (3, 7))], [(3, 7)])
    assert (runner.cache.hits, runner.cache.misses) == (1, 4)  # another range: a miss


@pytest.mark.parametrize("rng,rows_of,match", [
    ((0, 9), (0, 8), "not within the video's 8 temporal patches"),
    ((5, 5), (5, 6), "not within"),
    ((-1, 2), (0, 2), "not within"),
    ((0, 2), (0, 3), "carries 420 pixel rows, expected 280 .2 patches of 10x14."),
    ((True, 2), (1, 2), "two integers"),
    ((0, 2, 4), (0, 2), "two integers"),
], ids=["past the end", "empty", "negative", "rows", "bool", "three"])
def test_the_runner_refuses_a_range_that_does_not_fit(qwen_dir, encoded, rng, rows_of, match):
    item, _ = encoded
    runner = EncoderRunner(qwen_dir, AutoConfig.from_pretrained(qwen_dir), cache_bytes=0)
    with pytest.raises(MessageError, match=match):
        runner.encode([chunk_item(item, rows_of)], [rng])


def test_the_runner_refuses_a_range_on_an_image_or_a_lying_grid(qwen_dir, encoded):
    item, _ = encoded
    runner = EncoderRunner(qwen_dir, AutoConfig.from_pretrained(qwen_dir), cache_bytes=0)
    image = type(item)("image", item.item_hash, {"pixel_values": item.data["pixel_values_videos"]}, item.num_tokens)
    with pytest.raises(MessageError, match="not image"):
        runner.encode([image], [(0, 1)])
    lying = type(item)("video", item.item_hash, dict(item.data), item.num_tokens + 1)
    with pytest.raises(MessageError, match="does not give the item's"):
        runner.encode([chunk_item(lying, (0, 2))], [(0, 2)])
    with pytest.raises(MessageError, match="2 temporal ranges for 1 items"):
        runner.encode([item], [None, None])
