"""Qwen2.5-VL images in the encode path (tiny random checkpoint built here): transformers'
processor picks the native-resolution grid (min_pixels..max_pixels), epd expands each
``<|image_pad|>`` to the grid's token count, and transformers' own vision tower run by
``EncoderRunner`` gives ``get_image_features``' embeddings; M-RoPE positions of the
processed prompt equal ``get_rope_index``'s."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoTokenizer

from epd.encoders.encoder_runner import EncoderRunner
from epd.encoders.processor import MultiModalProcessor
from epd.errors import InvalidRequestError
from epd.models.mrope import VisionSpan, mrope_positions, prompt_mrope_positions
from epd.models.tiny import QWEN_VL_MAX_PIXELS, QWEN_VL_MIN_PIXELS, create_tiny_model

# (height, width): different token counts; one below min_pixels, one above max_pixels
SIZES = [(30, 40), (64, 20), (6, 5), (300, 200)]


def _image(i: int, hw: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(i).integers(0, 256, (*hw, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return str(create_tiny_model("qwen2.5-vl", tmp_path_factory.mktemp("qvl") / "qwen2.5-vl"))


@pytest.fixture(scope="module")
def reference(qwen_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(qwen_dir):
    return MultiModalProcessor(qwen_dir, AutoConfig.from_pretrained(qwen_dir))


def test_dynamic_resolution_sets_the_token_count(processor):
    ip = processor.image_processor
    counts = []
    for i, (h, w) in enumerate(SIZES):
        item = processor.image_item(_image(i, (h, w)))
        t, gh, gw = item.data["image_grid_thw"].tolist()
        assert t == 1 and gh % 2 == 0 and gw % 2 == 0
        assert item.num_tokens == gh * gw // 4 == ip.get_number_of_image_patches(h, w) // 4
        assert item.data["pixel_values"].shape == (gh * gw, 3 * 2 * 4 * 4)
        assert QWEN_VL_MIN_PIXELS <= gh * gw * 16 <= QWEN_VL_MAX_PIXELS  # resized into the processor's range
        counts.append(item.num_tokens)
    assert len(set(counts)) == len(counts)  # every size its own count
    assert counts[2] == min(counts) and counts[3] == max(counts)  # upscaled to the floor, downscaled to the cap


def _prompt(qwen_dir, n_images: int) -> list[int]:
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    content = []
    for k in range(n_images):
        content += [{"type": "text", "text": f"picture {k}:"}, {"type": "image"}]
    text = tok.apply_chat_template([{"role": "user", "content": content + [{"type": "text", "text": " compare"}]}],
                                   add_generation_prompt=True, tokenize=False)
    return tok.encode(text)


def test_encoder_equals_transformers_and_positions_equal_get_rope_index(qwen_dir, processor, reference):
    images = [_image(i, hw) for i, hw in enumerate(SIZES[:2])]
    ids = _prompt(qwen_dir, 2)
    processed = processor.process(ids, {"image": images})
    cfg = reference.config
    grids = torch.stack([it.data["image_grid_thw"] for it in processed.items])
    assert [p.length for p in processed.placeholders] == (grids.prod(-1) // 4).tolist()
    n_image_tokens = sum(t == cfg.image_token_id for t in processed.prompt_token_ids)
    assert n_image_tokens == sum(p.length for p in processed.placeholders)

    runner = EncoderRunner(qwen_dir, AutoConfig.from_pretrained(qwen_dir))
    got = runner.encode(processed.items)
    pixels = torch.cat([it.data["pixel_values"] for it in processed.items])
    with torch.inference_mode():
        want = reference.model.get_image_features(pixels, grids).pooler_output
    assert len(got) == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # Each image alone gives its rows of the batch (cu_seqlens keeps images apart).
    alone = EncoderRunner(qwen_dir, AutoConfig.from_pretrained(qwen_dir)).encode(processed.items[1:])
    torch.testing.assert_close(alone[0], got[1], rtol=1e-5, atol=1e-5)
    hits = runner.cache.hits
    again = runner.encode(processed.items)  # the second time from the encoder cache
    assert runner.cache.hits == hits + 2 and torch.equal(again[0], got[0])

    ids_t = torch.tensor([processed.prompt_token_ids])
    want_pos, want_delta = reference.model.get_rope_index(ids_t, (ids_t == cfg.image_token_id).int(),
                                                          image_grid_thw=grids)
    spans = [VisionSpan(p.offset, tuple(it.data["image_grid_thw"].tolist()))
             for p, it in zip(processed.placeholders, processed.items)]
    pos, delta = mrope_positions(len(processed.prompt_token_ids), spans, spatial_merge_size=2,
                                 tokens_per_second=cfg.vision_config.tokens_per_second)
    assert torch.equal(pos, want_pos[:, 0]) and delta == int(want_delta)


def test_placeholders_must_match_images(qwen_dir, processor):
    ids = _prompt(qwen_dir, 1)
    with pytest.raises(InvalidRequestError, match="placeholder"):
        processor.process(ids, {"image": [_image(0, (30, 40)), _image(1, (30, 40))]})
    with pytest.raises(InvalidRequestError, match="placeholder"):  # pad tokens spelled with no image
        processor.process(ids, {})


def _clip(pixels, frames: int = 8, size=(30, 40)) -> bytes:
    from tests.encoders.video_files import video

    return video("webm", "libvpx-vp9", frames=frames, fps=4, size=size, pixels=pixels)


def test_a_still_video_is_its_image_in_temporal_patches(processor, qwen_dir):
    """Every frame the same picture: each temporal patch holds the image processor's patches of
    that picture (which repeats a still image over the temporal axis), and the tower gives the
    image's embedding for each temporal step."""
    from epd.encoders.video import VideoSampling

    still = np.random.default_rng(5).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    frames = np.stack([still] * 4)
    item = processor.video_item(frames, VideoSampling(fps=2.0, max_frames=4))
    image = processor.image_item(Image.fromarray(still))
    t, gh, gw = item.data["video_grid_thw"].tolist()
    assert (t, gh, gw) == (2, *image.data["image_grid_thw"].tolist()[1:])
    assert item.num_tokens == 2 * image.num_tokens
    torch.testing.assert_close(item.data["pixel_values_videos"], image.data["pixel_values"].repeat(2, 1))
    assert item.data["second_per_grid_t"].tolist() == [1.0]  # 2 frames per patch, 0.5 s apart
    runner = EncoderRunner(qwen_dir, AutoConfig.from_pretrained(qwen_dir))
    video_emb, image_emb = runner.encode([item, image])
    # Window attention and the merger see each temporal step as its own picture.
    torch.testing.assert_close(video_emb[: image.num_tokens], image_emb, rtol=1e-5, atol=1e-5)


def test_temporal_patches_stack_consecutive_frames(processor):
    """Frame 2k and 2k+1 of the sampled frames fill temporal slots 0 and 1 of grid step k,
    in the [C, temporal, patch, patch] layout of transformers' video patchify; an odd count
    repeats the last frame."""
    from epd.encoders.video import VideoSampling

    rng = np.random.default_rng(7)
    frames = rng.integers(0, 256, (3, 30, 40, 3), dtype=np.uint8)
    item = processor.video_item(frames, VideoSampling(fps=1.0, max_frames=3))
    t, gh, gw = item.data["video_grid_thw"].tolist()
    assert t == 2
    n = gh * gw
    slots = item.data["pixel_values_videos"].reshape(t, n, 3, 2, 4, 4)
    for k, f in enumerate([0, 1, 2, 2]):  # the odd last frame is repeated
        alone = processor.image_item(Image.fromarray(frames[f])).data["pixel_values"].reshape(n, 3, 2, 4, 4)
        torch.testing.assert_close(slots[k // 2, :, :, k % 2], alone[:, :, 0])
    assert item.data["second_per_grid_t"].tolist() == [2.0]


def test_video_prompt_positions_and_tower_equal_transformers(qwen_dir, processor, reference):

    data = _clip(lambda i, h, w: np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8))
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                                                 {"type": "text", "text": "what moved?"}]}],
                                   add_generation_prompt=True, tokenize=False)
    processor_4fps = MultiModalProcessor(qwen_dir, AutoConfig.from_pretrained(qwen_dir), video_fps=4.0)
    processed = processor_4fps.process(tok.encode(text), {"image": [_image(0, (30, 40))], "video": [data]})
    image, video = processed.items
    assert video.modality == "video" and video.data["video_grid_thw"].tolist()[0] == 4  # 8 frames at 4 fps
    assert video.data["second_per_grid_t"].tolist() == [0.5]
    cfg = reference.config
    ids = torch.tensor([processed.prompt_token_ids])
    types = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
    assert int((types == 2).sum()) == video.num_tokens
    want, want_delta = reference.model.get_rope_index(
        ids, types, image_grid_thw=image.data["image_grid_thw"][None],
        video_grid_thw=video.data["video_grid_thw"][None],
        second_per_grid_ts=video.data["second_per_grid_t"])
    pos, delta = prompt_mrope_positions(ids.shape[1], processed.placeholders)
    assert torch.equal(pos, want[:, 0]) and delta == int(want_delta)
    # The grids travel with the placeholders (router -> D, as -> P) exactly.
    from epd.messages import ReserveKV, decode, encode
    from epd.sampling_params import SamplingParams

    # 0.5 s per patch x 2 tokens per second
    assert processed.placeholders[1].time_interval == 1.0 and processed.placeholders[0].time_interval is None
    wire = decode(encode(ReserveKV("r", processed.prompt_token_ids, SamplingParams(), processed.placeholders)))
    assert wire.placeholders == processed.placeholders
    assert wire.placeholders[1].grid_thw == tuple(video.data["video_grid_thw"].tolist())
    assert prompt_mrope_positions(ids.shape[1], [type(processed.placeholders[0])(3, 4, "h")]) is None  # no grids
    with pytest.raises(ValueError, match="every media placeholder"):
        prompt_mrope_positions(ids.shape[1], [*processed.placeholders, type(processed.placeholders[0])(300, 4, "h")])
    got = EncoderRunner(qwen_dir, AutoConfig.from_pretrained(qwen_dir)).encode([video])[0]
    with torch.inference_mode():
        ref = reference.model.get_video_features(video.data["pixel_values_videos"],
                                                 video.data["video_grid_thw"][None]).pooler_output[0]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # Another fps: another item (hash), fewer temporal patches.
    again = processor.process(tok.encode(text), {"image": [_image(0, (30, 40))], "video": [data]}).items[1]
    assert again.item_hash != video.item_hash and again.data["video_grid_thw"].tolist()[0] == 2


def test_qwen_items_cross_the_wire_to_the_encode_pool_exactly(processor, qwen_dir):
    """The router sends items to an encoder in an EncodeRequest (msgspec, TensorBlobs): grids
    (int64) and seconds per temporal patch (fp32) arrive exact, and encode to the same rows."""
    from epd.encoders.video import VideoSampling
    from epd.messages import EncodeRequest, decode, encode

    frames = np.random.default_rng(9).integers(0, 256, (4, 24, 32, 3), dtype=np.uint8)
    items = [processor.image_item(_image(0, (30, 40))), processor.video_item(frames, VideoSampling(fps=2.0))]
    out = decode(encode(EncodeRequest("r", items))).items
    for a, b in zip(items, out):
        assert (a.modality, a.item_hash, a.num_tokens, sorted(a.data)) == (b.modality, b.item_hash, b.num_tokens,
                                                                          sorted(b.data))
        for key in a.data:
            assert a.data[key].dtype == b.data[key].dtype and torch.equal(a.data[key], b.data[key])
    runner = EncoderRunner(qwen_dir, AutoConfig.from_pretrained(qwen_dir))
    for a, b in zip(runner.encode(items), EncoderRunner(qwen_dir, AutoConfig.from_pretrained(qwen_dir)).encode(out)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
