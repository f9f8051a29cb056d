"""Workload builders: mixes, shared vs unique prefixes, image variants, audio, lengths."""

import base64
import io

import numpy as np
import pytest

from epd.bench.workloads import (
    VOICE_RATE,
    WORDS,
    TextMaker,
    WorkloadOptions,
    build_requests,
    calibrate,
    pcm16,
    spec_summary,
    steady_share,
)


def test_steady_share():
    flags = steady_share(50, 0.2)
    assert sum(flags) == 10
    # spread evenly: one long request in every block of 5
    assert all(sum(flags[i:i + 5]) == 1 for i in range(0, 50, 5))
    assert sum(steady_share(7, 0.0)) == 0 and sum(steady_share(7, 1.0)) == 7


def test_chat_and_long_mix():
    opts = WorkloadOptions(input_len=(10, 20), output_len=7, long_share=0.25, long_input_len=(300, 400))
    chat = build_requests("chat", 20, opts, seed=1)
    assert all(s.kind == "chat" and 10 <= len(s.messages[-1]["content"].split()) <= 20 for s in chat)
    assert all(s.max_tokens == 7 for s in chat)
    mix = build_requests("long-mix", 20, opts, seed=1)
    kinds = [s.kind for s in mix]
    assert kinds.count("long") == 5 and kinds[3] == "long"
    assert all(300 <= len(s.messages[-1]["content"].split()) <= 400 for s in mix if s.kind == "long")
    assert spec_summary(mix)["kinds"] == {"chat": 15, "long": 5}
    # deterministic per seed, different across seeds
    assert build_requests("chat", 5, opts, seed=1)[0].messages == chat[0].messages
    assert build_requests("chat", 5, opts, seed=2)[0].messages != chat[0].messages
    assert set(chat[0].messages[-1]["content"].split()) <= set(WORDS)


def test_system_prompt_shared_or_unique():
    shared = build_requests("chat", 4, WorkloadOptions(system_prompt_len=50), seed=3)
    assert len({s.messages[0]["content"] for s in shared}) == 1
    assert len(shared[0].messages[0]["content"].split()) == 50 and shared[0].messages[0]["role"] == "system"
    # the same system prompt whatever the seed: a sweep's later runs hit it too
    again = build_requests("chat", 1, WorkloadOptions(system_prompt_len=50), seed=9)
    assert again[0].messages[0] == shared[0].messages[0]
    unique = build_requests("chat", 4, WorkloadOptions(system_prompt_len=50, system_prompt="unique"), seed=3)
    assert len({s.messages[0]["content"] for s in unique}) == 4


def _image_urls(spec):
    return [p["image_url"]["url"] for p in spec.messages[-1]["content"] if p["type"] == "image_url"]


def test_multimodal_images():
    from PIL import Image

    specs = build_requests("multimodal", 12, WorkloadOptions(images=(1, 4)), seed=0)
    counts = [len(_image_urls(s)) for s in specs]
    assert all(1 <= c <= 4 for c in counts) and len(set(counts)) > 1
    assert [s.num_images for s in specs] == counts
    urls = [u for s in specs for u in _image_urls(s)]
    assert len(set(urls)) == len(urls)  # every image has distinct bytes: no encoder-cache hit
    img = Image.open(io.BytesIO(base64.b64decode(urls[0].split(",", 1)[1])))
    assert img.format == "JPEG" and max(img.size) <= 336
    assert specs[0].messages[-1]["content"][-1]["type"] == "text"
    reused = build_requests("multimodal", 12, WorkloadOptions(images=(1, 1), media_reuse=1.0), seed=0)
    assert len({u for s in reused for u in _image_urls(s)}) <= 6  # only the 6 canonical photos


def test_multimodal_audio_and_voice():
    specs = build_requests("multimodal", 4, WorkloadOptions(audio_share=0.5), seed=0)
    kinds = [s.kind for s in specs]
    assert kinds.count("audio") == 2
    part = specs[kinds.index("audio")].messages[-1]["content"][0]
    assert part["type"] == "input_audio" and base64.b64decode(part["input_audio"]["data"])[:4] == b"RIFF"

    def clips(reuse):
        specs = build_requests("multimodal", 6, WorkloadOptions(audio_share=1.0, media_reuse=reuse), seed=0)
        return [s.messages[-1]["content"][0]["input_audio"]["data"] for s in specs]

    assert len(set(clips(0.0))) == 6  # every clip altered: no transcript-cache hit
    assert len(set(clips(1.0))) == 2  # the two short clips, byte-identical each time
    voice = build_requests("voice", 2, WorkloadOptions(output_len=16), seed=0)
    assert all(s.kind == "voice" and s.audio_pcm16 and len(s.audio_pcm16) % 2 == 0 for s in voice)
    # a 2-3 s clip at 24 kHz PCM16
    assert 2.0 * VOICE_RATE * 2 < len(voice[0].audio_pcm16) < 3.0 * VOICE_RATE * 2


def test_pcm16_resampling():
    one_s = np.sin(np.linspace(0, 2 * np.pi * 440, 16000, endpoint=False)).astype(np.float32)
    out = np.frombuffer(pcm16(one_s, 16000), dtype="<i2")
    assert len(out) == VOICE_RATE and np.abs(out).max() == pytest.approx(32767, abs=10)
    assert np.frombuffer(pcm16(np.array([2.0, -2.0]), VOICE_RATE), dtype="<i2").tolist() == [32767, -32767]


def test_calibrated_lengths_with_a_real_tokenizer():
    from epd.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    ratio = calibrate(tok)
    assert ratio > 1.0  # a 512-entry BPE splits most words
    text = TextMaker(ratio).text(400, np.random.default_rng(5))
    assert len(tok.encode(text, add_special_tokens=False)) == pytest.approx(400, rel=0.1)


def test_bad_options():
    with pytest.raises(ValueError):
        WorkloadOptions(images=(1, 5))
    with pytest.raises(ValueError):
        WorkloadOptions(long_share=1.5)
    with pytest.raises(ValueError):
        WorkloadOptions(input_len=(10, 5))
    with pytest.raises(ValueError, match="unknown workload"):
        build_requests("poetry", 1, WorkloadOptions())
    with pytest.raises(ValueError, match="max_model_len"):
        build_requests("long-mix", 5, WorkloadOptions(long_input_len=(900, 1000)), max_model_len=512)
    with pytest.raises(ValueError, match="trace"):
        build_requests("trace", 1, WorkloadOptions())
