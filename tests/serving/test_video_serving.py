"""``video_url`` content parts through a real server (``epd launch``, e:1,pd:1, tiny LLaVA,
the official ``openai`` SDK): frames go in as images; the answers equal the offline
engine's for the same video; bad videos are 400s naming what is wrong and the server
keeps serving; a repeated video hits the encoder cache, the same bytes at another fps
does not. Videos are made in the test with PyAV."""

from __future__ import annotations

import base64
import time

import httpx
import numpy as np
import openai
import pytest

from epd import LLM, SamplingParams
from epd.encoders.video import VIDEO_PLACEHOLDER
from epd.models.tiny import create_tiny_model
from tests.encoders.video_files import audio_only_mp4, video, with_declared_frames
from tests.serving.conftest import launch
from tests.serving.test_kv_routing import _counter

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
QUESTION = " What happens?"


def _noise(i: int, h: int, w: int) -> np.ndarray:
    return np.random.default_rng(100 + i).integers(0, 256, (h, w, 3), dtype=np.uint8)


CLIP = video(frames=8, fps=4, size=(24, 32), pixels=_noise)  # 2 s: 4 frames at 2 fps, 2 at 1 fps


def _url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _messages(data: bytes, mime: str = "video/mp4") -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": _url(data, mime)}},
                                         {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return str(create_tiny_model("llava", tmp_path_factory.mktemp("video") / "llava"))


@pytest.fixture(scope="module")
def expected(llava_dir):
    """Offline answers (text, prompt tokens) for CLIP at 2 fps and at 1 fps."""
    out = {}
    for fps in (2.0, 1.0):
        llm = LLM(llava_dir, dtype="float32", video_fps=fps, kv_cache_memory_gb=0.05)
        tok = llm.get_tokenizer()
        text = tok.apply_chat_template([{"role": "user", "content": VIDEO_PLACEHOLDER + QUESTION}],
                                       add_generation_prompt=True, tokenize=False)
        r = llm.generate({"prompt": text, "multi_modal_data": {"video": CLIP}},
                         SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
        out[fps] = (r.outputs[0].text, len(r.prompt_token_ids))
        llm.shutdown()
    assert out[2.0][1] - out[1.0][1] == 2 * 16  # two more frames of 16 rows
    return out


@pytest.fixture(scope="module")
def server(llava_dir):
    with launch(llava_dir, "e:1,pd:1", "--block-size", "8", "--num-kv-blocks", "128") as s:
        yield s


def _encoder_counters(server, at_least: float) -> tuple[float, float]:
    """(queries, hits) of the encode pool once the queries reach ``at_least`` (workers
    publish counters with their heartbeat)."""
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        q = _counter(text, "epd_encoder_cache_queries_total", pool="encode")
        if q >= at_least or time.monotonic() > deadline:
            return q, _counter(text, "epd_encoder_cache_hits_total", pool="encode")
        time.sleep(0.2)


def test_video_equals_offline_and_hits_the_encoder_cache(server, expected):
    client = server.client()
    q0, h0 = _encoder_counters(server, 0)
    first = client.chat.completions.create(model=server.model, messages=_messages(CLIP), max_tokens=MAX_TOKENS,
                                           temperature=0)
    assert (first.choices[0].message.content, first.usage.prompt_tokens) == expected[2.0]
    q1, h1 = _encoder_counters(server, q0 + 4)
    assert (q1 - q0, h1 - h0) == (4, 0)  # four frames, each a new item

    second = client.chat.completions.create(model=server.model, messages=_messages(CLIP), max_tokens=MAX_TOKENS,
                                            temperature=0)
    assert second.choices[0].message.content == expected[2.0][0]
    q2, h2 = _encoder_counters(server, q1 + 4)
    assert (q2 - q1, h2 - h1) == (4, 4)  # the same video: every frame from the cache

    slower = client.chat.completions.create(model=server.model, messages=_messages(CLIP), max_tokens=MAX_TOKENS,
                                            temperature=0, extra_body={"media_io_kwargs": {"video": {"fps": 1.0}}})
    assert (slower.choices[0].message.content, slower.usage.prompt_tokens) == expected[1.0]
    q3, h3 = _encoder_counters(server, q2 + 2)
    assert (q3 - q2, h3 - h2) == (2, 0)  # the same bytes at another fps: a miss, though frame 0 is the same

    stream = client.chat.completions.create(model=server.model, messages=_messages(CLIP), max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected[2.0][0]


def _bad_videos() -> list[tuple[str, bytes, str]]:
    webm = video("webm", "libvpx-vp9", frames=30)
    return [
        ("zero-length", b"", "empty"),
        ("truncated", webm[: len(webm) // 2], "truncated"),
        ("corrupt", b"\x00\x00\x00\x20ftypisom" + bytes(range(256)) * 4, "cannot read"),
        ("huge resolution", video(frames=1, size=(4096, 4096)), "4096x4096 = 16777216 pixels; the limit is 8294400"),
        ("10^5 frames", with_declared_frames(video(frames=10, fps=1000), 100_000), "100000 frames"),
        ("audio only", audio_only_mp4(), "no video stream"),
        ("not a video", b"GIF89a" + b"\x00" * 64, "not accepted"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_videos())), ids=[c[0] for c in _bad_videos()])
def test_bad_video_is_a_400_and_the_server_keeps_serving(server, expected, case):
    _name, data, match = _bad_videos()[case]
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=_messages(data), max_tokens=MAX_TOKENS)
    assert e.value.status_code == 400 and match in e.value.body["message"], e.value.body
    ok = client.chat.completions.create(model=server.model, messages=_messages(CLIP), max_tokens=MAX_TOKENS,
                                        temperature=0)
    assert ok.choices[0].message.content == expected[2.0][0]


def test_sampling_over_the_server_limits_is_a_400_naming_the_field(server):
    client = server.client()
    for kwargs, param in (({"num_frames": 33}, "media_io_kwargs.video.num_frames"),
                          ({"fps": 0}, "media_io_kwargs.video.fps")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.model, messages=_messages(CLIP), max_tokens=MAX_TOKENS,
                                           extra_body={"media_io_kwargs": {"video": kwargs}})
        assert e.value.body["param"] == param, e.value.body
    r = client.chat.completions.create(model=server.model, messages=_messages(CLIP), max_tokens=2,
                                       extra_body={"media_io_kwargs": {"video": {"num_frames": 1}}})
    assert r.usage.prompt_tokens < 16 * 2 + 20  # one frame, not four

