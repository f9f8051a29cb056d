"""Item hashes, the encoder cache, placeholder expansion, long audio windows, real media."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from epd import LLM, SamplingParams
from epd.encoders.encoder_cache import EncoderCache
from epd.encoders.processor import MultiModalProcessor
from epd.models.tiny import AUDIO_TOKEN, IMAGE_TOKEN, create_tiny_model


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return str(create_tiny_model("llava", tmp_path_factory.mktemp("llava") / "m"))


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory):
    return str(create_tiny_model("qwen2-audio", tmp_path_factory.mktemp("qa") / "m"))


def _processor(model_dir: str, **kw) -> MultiModalProcessor:
    from transformers import AutoConfig

    return MultiModalProcessor(model_dir, AutoConfig.from_pretrained(model_dir), **kw)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _random_image(seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = 4 if mode == "RGBA" else 3
    return Image.fromarray(rng.integers(0, 256, (40, 50, channels), dtype=np.uint8), mode)


def test_hash_is_full_sha256_and_stable(llava_dir):
    proc = _processor(llava_dir)
    data = _png(_random_image())
    a, b = proc.image_item(data), proc.image_item(data)
    assert a.item_hash == b.item_hash
    assert len(a.item_hash) == 64 and int(a.item_hash, 16) >= 0  # full hex sha256 digest
    assert proc.image_item(_png(_random_image(seed=1))).item_hash != a.item_hash


def test_hash_covers_background_and_resize_parameters(llava_dir, tmp_path):
    opaque = _png(_random_image())
    white = _processor(llava_dir).image_item(opaque)
    black = _processor(llava_dir, background=(0, 0, 0)).image_item(opaque)
    # Same pixels (the image is opaque) but a different decode parameter.
    assert torch.equal(white.data["pixel_values"], black.data["pixel_values"])
    assert white.item_hash != black.item_hash
    # A different resize parameter in the model's preprocessor config.
    other = tmp_path / "llava-resized"
    shutil.copytree(llava_dir, other)
    cfg_path = other / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["resample"] = 2  # bilinear instead of bicubic
    cfg_path.write_text(json.dumps(cfg))
    assert _processor(str(other)).image_item(opaque).item_hash != white.item_hash


def test_placeholder_expansion_counts_and_order(llava_dir):
    from transformers import AutoTokenizer

    proc = _processor(llava_dir)
    tok = AutoTokenizer.from_pretrained(llava_dir)
    image_id = proc.placeholder_ids["image"]
    ids = tok.encode(f"a{IMAGE_TOKEN}{IMAGE_TOKEN} b {IMAGE_TOKEN}")
    imgs = [_png(_random_image(s)) for s in range(3)]
    out = proc.process(ids, {"image": imgs})
    assert out.prompt_token_ids.count(image_id) == 48
    assert [p.length for p in out.placeholders] == [16, 16, 16]
    # Spans are in prompt order, adjacent ones touch, and each maps to its own item.
    assert out.placeholders[1].offset == out.placeholders[0].offset + 16
    assert out.placeholders[2].offset > out.placeholders[1].offset + 16
    assert [p.item_hash for p in out.placeholders] == [proc.image_item(i).item_hash for i in imgs]
    for p in out.placeholders:
        assert out.prompt_token_ids[p.offset:p.offset + p.length] == [image_id] * 16


def test_same_bytes_twice_encode_once(llava_dir):
    llm = LLM(llava_dir, dtype="float32")
    data = _png(_random_image(3))
    params = SamplingParams(temperature=0, max_tokens=3)
    r1 = llm.generate({"prompt": IMAGE_TOKEN + " hi", "multi_modal_data": {"image": [data]}}, params)[0]
    r2 = llm.generate({"prompt": IMAGE_TOKEN + " hi", "multi_modal_data": {"image": [data]}}, params)[0]
    cache = llm.encoder.cache
    assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)
    assert r1.outputs[0].token_ids == r2.outputs[0].token_ids
    llm.shutdown()


def test_encoder_cache_lru_bounded_in_bytes():
    t = lambda n: torch.zeros(n, dtype=torch.uint8)  # noqa: E731
    cache = EncoderCache(capacity_bytes=100)
    cache.put("a", t(40))
    cache.put("b", t(40))
    assert cache.get("a") is not None  # a is now most recent
    cache.put("c", t(40))  # evicts b, the least recently used
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.used_bytes == 80
    cache.put("huge", t(101))  # larger than the whole cache: not stored, nothing evicted
    assert "huge" not in cache and len(cache) == 2
    assert cache.get("b") is None
    assert (cache.hits, cache.misses) == (1, 1)


def test_audio_longer_than_window_is_split(audio_dir):
    proc = _processor(audio_dir)
    sr = 16000
    samples = (0.1 * np.sin(np.arange(31 * sr) / 20)).astype(np.float32)  # 31 s: two windows
    item = proc.audio_item((samples, sr))
    assert item.data["input_features"].shape == (2, 80, 3000)
    assert item.data["num_frames"].tolist() == [3000, 100]
    assert item.num_tokens == 750 + 25
    llm = LLM(audio_dir, dtype="float32")
    out = llm.generate({"prompt": f"{AUDIO_TOKEN} long", "multi_modal_data": {"audio": [(samples, sr)]}},
                       SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.prompt_token_ids) > 775 and out.finished
    emb = llm.encoder.encode([item])[0]
    assert emb.shape == (775, 64) and torch.isfinite(emb).all()
    llm.shutdown()


def test_real_images_decode_and_encode(llava_dir):
    from matplotlib import cbook

    skimage_data = pytest.importorskip("skimage.data")
    proc = _processor(llava_dir)
    from transformers import AutoConfig

    from epd.encoders.encoder_runner import EncoderRunner

    runner = EncoderRunner(llava_dir, AutoConfig.from_pretrained(llava_dir))
    with cbook.get_sample_data("grace_hopper.jpg") as f:
        hopper = f.read()
    images = [hopper, _png(Image.fromarray(skimage_data.astronaut())), _png(Image.fromarray(skimage_data.coffee()))]
    items = [proc.image_item(b) for b in images]
    embs = runner.encode(items)
    assert all(e.shape == (16, 64) and torch.isfinite(e).all() for e in embs)
    assert len({it.item_hash for it in items}) == 3
