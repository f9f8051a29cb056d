"""Multimodal greedy parity with transformers: tiny LLaVA (CLIP, SigLIP) and tiny Qwen2-Audio.

epd expands placeholders, encodes with the towers, merges embeddings into its own LM
and runs chunked prefill that splits media spans; transformers runs the whole
``*ForConditionalGeneration`` with ``pixel_values`` / ``input_features``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from epd import LLM, SamplingParams
from epd.errors import InvalidRequestError
from epd.models.tiny import AUDIO_TOKEN, IMAGE_TOKEN, create_tiny_model

MAX_TOKENS = 12
IMAGE_PROMPTS = [f"{IMAGE_TOKEN} What is in the picture?",
                 f"Compare {IMAGE_TOKEN}{IMAGE_TOKEN} please.",  # adjacent items
                 f"One {IMAGE_TOKEN} two {IMAGE_TOKEN}{IMAGE_TOKEN} three"]
AUDIO_PROMPTS = [f"{AUDIO_TOKEN} What was said?",
                 f"Compare {AUDIO_TOKEN}{AUDIO_TOKEN} please.",
                 f"One {AUDIO_TOKEN} two {AUDIO_TOKEN}{AUDIO_TOKEN} three"]


def _images(n: int, seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    sizes = [(40, 30), (28, 28), (64, 48), (33, 50)]
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for (w, h) in sizes[:n]]


def _audios(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = [16000, 24000, 8000]
    t = [np.arange(k) / 16000 for k in lengths[:n]]
    return [(0.3 * np.sin(2 * np.pi * (200 + 100 * i) * x) + 0.05 * rng.standard_normal(len(x))).astype(np.float32)
            for i, x in enumerate(t)]


@pytest.fixture(scope="module")
def mm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-mm")
    return {k: str(create_tiny_model(k, root / k)) for k in ("llava", "llava-siglip", "qwen2-audio")}


def _expand(ids: list[int], token_id: int, counts: list[int]) -> list[int]:
    out, k = [], 0
    for t in ids:
        if t == token_id:
            out.extend([t] * counts[k])
            k += 1
        else:
            out.append(t)
    assert k == len(counts)
    return out


@pytest.mark.parametrize("kind", ["llava", "llava-siglip"])
def test_llava_parity(kind, mm_dirs):
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaForConditionalGeneration

    model_dir = mm_dirs[kind]
    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    proc = AutoImageProcessor.from_pretrained(model_dir)
    llm = LLM(model_dir, block_size=8, max_num_batched_tokens=20, dtype="float32")  # 16-row images split across chunks
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    requests, expected = [], []
    for i, text in enumerate(IMAGE_PROMPTS):
        images = _images(i + 1, seed=i)
        requests.append({"prompt": text, "multi_modal_data": {"image": images}})
        ids = _expand(tok.encode(text), ref.config.image_token_id, [16] * len(images))
        pv = proc(images=images, return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            out = ref.generate(torch.tensor([ids]), pixel_values=pv,
                               attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=MAX_TOKENS, do_sample=False)
        expected.append(out[0, len(ids):].tolist())
    got = llm.generate(requests, params)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert [len(o.prompt_token_ids) for o in got] == [len(tok.encode(t)) + 15 * (i + 1)
                                                       for i, t in enumerate(IMAGE_PROMPTS)]
    llm.shutdown()


def test_qwen2_audio_parity(mm_dirs):
    from transformers import AutoTokenizer, Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor

    model_dir = mm_dirs["qwen2-audio"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = Qwen2AudioForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    fe = WhisperFeatureExtractor.from_pretrained(model_dir)
    llm = LLM(model_dir, block_size=8, max_num_batched_tokens=32, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    requests, expected = [], []
    for i, text in enumerate(AUDIO_PROMPTS):
        audios = _audios(i + 1, seed=i)
        requests.append({"prompt": text, "multi_modal_data": {"audio": [(a, 16000) for a in audios]}})
        feats = fe(audios, sampling_rate=16000, return_attention_mask=True, padding="max_length", return_tensors="pt")
        frames = feats["attention_mask"].sum(-1)
        counts = (((frames - 1) // 2 + 1 - 2) // 2 + 1).tolist()
        ids = _expand(tok.encode(text), ref.config.audio_token_id, counts)
        with torch.inference_mode():
            out = ref.generate(torch.tensor([ids]), input_features=feats["input_features"],
                               feature_attention_mask=feats["attention_mask"],
                               attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=MAX_TOKENS, do_sample=False)
        expected.append(out[0, len(ids):].tolist())
    got = llm.generate(requests, params)
    assert [o.outputs[0].token_ids for o in got] == expected
    llm.shutdown()


def test_prefix_cache_keys_on_media(mm_dirs):
    """Same text + same image reuses KV; same text + another image does not past the image."""
    llm = LLM(mm_dirs["llava"], block_size=8, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=4)
    text = "Describe this image in a few words please: " + IMAGE_TOKEN + " thanks"
    a, b = _images(2, seed=7)
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": [a]}}, params)[0]
    same = llm.generate({"prompt": text, "multi_modal_data": {"image": [a]}}, params)[0]
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": [b]}}, params)[0]
    n = len(first.prompt_token_ids)
    image_offset = first.prompt_token_ids.index(llm.engine.config.hf_config.image_token_id)
    assert same.num_cached_tokens == (n - 1) // 8 * 8
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    # Only the full blocks entirely before the image may be shared.
    assert other.num_cached_tokens == image_offset // 8 * 8
    assert llm.encoder.cache.hits == 1  # image a encoded once
    llm.shutdown()


def test_placeholder_mismatch_rejected(mm_dirs):
    llm = LLM(mm_dirs["llava"], dtype="float32")
    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequestError, match="placeholder"):
        llm.generate(f"text that spells {IMAGE_TOKEN} without an image", params)
    with pytest.raises(InvalidRequestError, match="placeholder"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": _images(1, 0)}}, params)
    with pytest.raises(InvalidRequestError, match="placeholder"):
        llm.generate({"prompt": IMAGE_TOKEN, "multi_modal_data": {"image": _images(2, 0)}}, params)
    with pytest.raises(InvalidRequestError, match="does not accept"):
        llm.generate({"prompt": "x", "multi_modal_data": {"audio": [(np.zeros(1600, np.float32), 16000)]}}, params)
    # The engine still serves.
    assert llm.generate({"prompt": IMAGE_TOKEN, "multi_modal_data": {"image": _images(1, 0)}}, params)[0].finished
    llm.shutdown()
