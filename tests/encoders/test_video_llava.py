"""Video on a frames-as-images model (tiny LLaVA): offline ``multi_modal_data={"video": ...}``.

The reference is transformers' ``LlavaForConditionalGeneration.generate`` given the same
frames as images, decoded here with PyAV at the times the sampler must pick.
"""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import torch
from PIL import Image

from epd import LLM, SamplingParams
from epd.config import ConfigError
from epd.encoders.media_limits import MediaError
from epd.encoders.processor import MultiModalProcessor
from epd.encoders.video import VIDEO_PLACEHOLDER, VideoSampling
from epd.errors import InvalidRequestError
from epd.models.tiny import IMAGE_TOKEN, create_tiny_model
from tests.encoders.video_files import video

MAX_TOKENS = 10


def _noise(i: int, h: int, w: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return str(create_tiny_model("llava", tmp_path_factory.mktemp("vid") / "llava"))


def _pyav_frames(data: bytes, indices: list[int]) -> list[Image.Image]:
    with av.open(io.BytesIO(data)) as c:
        frames = [f.to_image() for f in c.decode(video=0)]
    return [frames[i] for i in indices]


def _reference(model_dir: str, text: str, images: list[Image.Image]) -> list[int]:
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = []
    for t in tok.encode(text):
        ids += [t] * (16 if t == ref.config.image_token_id else 1)
    pv = AutoImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), pixel_values=pv,
                           attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def test_video_frames_equal_transformers_with_the_same_images(llava_dir):
    data = video(frames=8, fps=4, size=(24, 32), pixels=_noise)  # 2 s: at 2 fps, frames 0, 2, 4, 6
    still = Image.fromarray(_noise(99, 30, 40))
    llm = LLM(llava_dir, dtype="float32", block_size=8, max_num_batched_tokens=24, video_fps=2.0)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    try:
        text = f"Look {IMAGE_TOKEN} then {VIDEO_PLACEHOLDER} what changed?"
        got = llm.generate({"prompt": text, "multi_modal_data": {"image": [still], "video": [data]}}, params)[0]
        frames = _pyav_frames(data, [0, 2, 4, 6])
        expected = _reference(llava_dir, f"Look {IMAGE_TOKEN} then {IMAGE_TOKEN * 4} what changed?", [still, *frames])
        assert got.outputs[0].token_ids == expected
        assert len(got.prompt_token_ids) == len(llm.get_tokenizer().encode(text.replace(VIDEO_PLACEHOLDER, ""))) \
            - 1 + 16 * 5  # the <image> token becomes 16 rows, the video 4 frames of 16
        # The same video again: every frame's embedding comes from the encoder cache.
        hits = llm.encoder.cache.hits
        again = llm.generate({"prompt": f"{VIDEO_PLACEHOLDER} again", "multi_modal_data": {"video": data}}, params)
        assert llm.encoder.cache.hits == hits + 4 and again[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_frame_arrays_and_bad_input(llava_dir):
    llm = LLM(llava_dir, dtype="float32", max_video_frames=3)
    params = SamplingParams(temperature=0, max_tokens=4)
    try:
        frames = np.stack([_noise(i, 24, 32) for i in range(3)])
        out = llm.generate({"prompt": f"{VIDEO_PLACEHOLDER} hi", "multi_modal_data": {"video": frames}}, params)[0]
        as_images = llm.generate({"prompt": f"{IMAGE_TOKEN * 3} hi",
                                  "multi_modal_data": {"image": [Image.fromarray(f) for f in frames]}}, params)[0]
        assert out.outputs[0].token_ids == as_images.outputs[0].token_ids
        with pytest.raises(InvalidRequestError, match="placeholder"):
            llm.generate({"prompt": "no slot", "multi_modal_data": {"video": frames}}, params)
        with pytest.raises(InvalidRequestError, match="text prompt"):
            llm.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"video": frames}}, params)
        with pytest.raises(MediaError, match="limit is 3"):
            llm.generate({"prompt": VIDEO_PLACEHOLDER, "multi_modal_data": {"video": np.concatenate([frames] * 2)}},
                         params)
        with pytest.raises(MediaError, match="truncated|corrupt|cannot"):
            data = video("webm", "libvpx-vp9", frames=30)
            llm.generate({"prompt": VIDEO_PLACEHOLDER, "multi_modal_data": {"video": data[: len(data) // 2]}}, params)
        # Nothing of the refused prompts stayed queued: the engine still answers.
        assert llm.generate({"prompt": "hello"}, params)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    with pytest.raises(ConfigError):
        LLM(llava_dir, dtype="float32", video_fps=0.0)


def test_frame_hashes_cover_the_sampling(llava_dir):
    from transformers import AutoConfig

    proc = MultiModalProcessor(llava_dir, AutoConfig.from_pretrained(llava_dir))
    data = video(frames=8, fps=4, pixels=_noise)

    def hashes(sampling):
        return [proc.image_item(f).item_hash for f in proc.video_frames(data, sampling)]

    two = hashes(VideoSampling(fps=2.0, max_frames=32))
    assert len(two) == 4 and len(set(two)) == 4
    assert hashes(VideoSampling(fps=2.0, max_frames=32)) == two
    one = hashes(VideoSampling(fps=1.0, max_frames=32))  # frames 0 and 4: the same pixels as two[0], two[2]
    assert len(one) == 2 and not set(one) & set(two)
    assert proc.video_sampling(num_frames=4).max_frames == 4
    with pytest.raises(InvalidRequestError, match="1 to 32"):
        proc.video_sampling(num_frames=33)
    with pytest.raises(InvalidRequestError, match="fps"):
        proc.video_sampling(fps=-1.0)
