"""Qwen2.5-VL (tiny random, built here) through real servers: native-resolution images and
a video as temporal patches, M-RoPE positions computed by every worker from the request's
placeholders; answers equal the offline engine's (itself equal to transformers'
``generate``, tests/engine/test_mrope_engine.py) on e:1,pd:1, e:1,p:1,d:1 and e:2,p:1,d:1
(both encoders serving), and across a SIGKILLed decode worker (migration) on e:1,p:1,d:2."""

from __future__ import annotations

import base64
import io
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from PIL import Image

from epd import LLM, SamplingParams
from epd.models.tiny import create_tiny_model
from tests.encoders.video_files import video
from tests.serving.conftest import launch
from tests.serving.test_kv_routing import _counter

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


def _png(seed: int, hw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*hw, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


# 16 frames at 4 fps (4 s): at 1 fps, 4 frames, 2 temporal patches
CLIP = video("webm", "libvpx-vp9", frames=16, fps=4, size=(24, 32),
             pixels=lambda i, h, w: np.random.default_rng(50 + i).integers(0, 256, (h, w, 3), dtype=np.uint8))
IMAGES = [_png(1, (30, 40)), _png(2, (64, 20))]


def _url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


CASES = {
    "two images": [{"type": "image_url", "image_url": {"url": _url(IMAGES[0], "image/png")}},
                   {"type": "text", "text": "and"},
                   {"type": "image_url", "image_url": {"url": _url(IMAGES[1], "image/png")}},
                   {"type": "text", "text": " now?"}],
    "video": [{"type": "video_url", "video_url": {"url": _url(CLIP, "video/webm")}},
              {"type": "text", "text": "what moved?"}],
    "image and video": [{"type": "image_url", "image_url": {"url": _url(IMAGES[1], "image/png")}},
                        {"type": "video_url", "video_url": {"url": _url(CLIP, "video/webm")}},
                        {"type": "text", "text": "same?"}],
}
#: the media of each case, in prompt order (the offline engine's multi_modal_data)
MEDIA = {"two images": {"image": IMAGES}, "video": {"video": [CLIP]},
         "image and video": {"image": [IMAGES[1]], "video": [CLIP]}}
#: encoder cache queries each case makes on e:2 (one per item; the video, 2 temporal patches at
#: 1 fps, is split into a chunk per encoder: epd.router.encode_split)
NUM_QUERIES_E2 = {"two images": 2, "video": 2, "image and video": 3}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return str(create_tiny_model("qwen2.5-vl", tmp_path_factory.mktemp("qsrv") / "qwen2.5-vl"))


def _offline(model_dir, max_tokens: int = MAX_TOKENS, ignore_eos: bool = False) -> dict[str, tuple[str, int]]:
    """The offline engine's greedy answer and prompt length per case."""
    llm = LLM(model_dir, dtype="float32", kv_cache_memory_gb=0.05, video_fps=1.0)
    tok = llm.get_tokenizer()
    out = {}
    for name, parts in CASES.items():
        content = [{"type": "text", "text": p["text"]} if p["type"] == "text" else
                   {"type": "image" if p["type"] == "image_url" else "video"} for p in parts]
        text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                       tokenize=False)
        r = llm.generate({"prompt": text, "multi_modal_data": MEDIA[name]},
                         SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos))
        out[name] = (r[0].outputs[0].text, len(r[0].prompt_token_ids))
    llm.shutdown()
    return out


def _assert_every_case_equals(server, want: dict[str, tuple[str, int]]) -> None:
    client = server.client()
    for name, parts in CASES.items():
        r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": parts}],
                                           max_tokens=MAX_TOKENS, temperature=0)
        assert (r.choices[0].message.content, r.usage.prompt_tokens) == want[name], name


@pytest.fixture(scope="module")
def expected(qwen_dir):
    return _offline(qwen_dir)


def test_qwen2_vl_serving_equals_offline(tmp_path_factory):
    """Qwen2-VL (1.0; its offline parity with transformers: tests/engine/test_mrope_engine.py)
    on e:1,p:1,d:1: images and a video, whose time ids step by one per temporal patch."""
    model = str(create_tiny_model("qwen2-vl", tmp_path_factory.mktemp("q2vl") / "qwen2-vl"))
    want = _offline(model)
    with launch(model, "e:1,p:1,d:1", "--block-size", "8", "--num-kv-blocks", "128", "--video-fps", "1") as server:
        _assert_every_case_equals(server, want)


@pytest.mark.parametrize("pools", ["e:1,pd:1", "e:1,p:1,d:1"])
def test_qwen_vl_serving_equals_offline(qwen_dir, expected, pools):
    with launch(qwen_dir, pools, "--block-size", "8", "--num-kv-blocks", "128", "--video-fps", "1") as server:
        _assert_every_case_equals(server, expected)


def _encoder_queries(server, at_least: float) -> dict[str, float]:
    """Items each encode instance looked up in its encoder cache (one per item it was sent),
    once their sum reaches ``at_least`` (workers publish counters with their heartbeat)."""
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        got = {e: _counter(text, "epd_encoder_cache_queries_total", pool="encode", instance=e)
               for e in ("encode-0", "encode-1")}
        if sum(got.values()) >= at_least or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_two_encoders_equal_offline(qwen_dir, expected):
    """e:2,p:1,d:1: each case equals the offline engine whichever encoder it meets, and both
    encoders served items (round-robin: a request's images go to one encoder, so the three
    cases land on both; the video is split across them)."""
    with launch(qwen_dir, "e:2,p:1,d:1", "--block-size", "8", "--num-kv-blocks", "128", "--video-fps", "1",
                "--encode-routing", "round-robin") as server:
        _assert_every_case_equals(server, expected)
        served = _encoder_queries(server, sum(NUM_QUERIES_E2.values()))
        assert sum(served.values()) == sum(NUM_QUERIES_E2.values()), served
        assert min(served.values()) >= 1, served  # both encoders did work


LONG = 320  # tokens per streamed answer: long enough to kill the decode worker mid-stream


@pytest.fixture(scope="module")
def expected_long(qwen_dir):
    """The offline engine's LONG-token greedy answer (EOS ignored) per case."""
    return {name: text for name, (text, _) in _offline(qwen_dir, LONG, ignore_eos=True).items()}


def _stream(server, parts, on_chunk=None) -> str:
    text, n = "", 0
    for chunk in server.client().chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": parts}], max_tokens=LONG, temperature=0,
            stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            n += 1
            if on_chunk is not None:
                on_chunk(n)
    return text


def test_decode_killed_mid_stream_migrates_with_mrope_positions(qwen_dir, expected_long):
    """e:1,p:1,d:2: SIGKILL the decode worker streaming images and videos; its requests
    migrate (prompt + tokens so far prefilled elsewhere, M-RoPE positions from the
    placeholders, the decoded tokens continuing as text) and every answer equals the
    undisturbed run, which equals the offline engine."""
    names = list(CASES)
    with launch(qwen_dir, "e:1,p:1,d:2", "--block-size", "8", "--num-kv-blocks", "256", "--video-fps", "1") as server:
        with ThreadPoolExecutor(len(names)) as pool:
            undisturbed = dict(zip(names, pool.map(lambda n: _stream(server, CASES[n]), names)))
        assert undisturbed == expected_long

        streamed = dict.fromkeys(names, 0)
        going = threading.Event()

        def seen(name: str, n: int) -> None:
            streamed[name] = n
            if min(streamed.values()) >= 5:
                going.set()

        with ThreadPoolExecutor(len(names)) as pool:
            futs = {n: pool.submit(_stream, server, CASES[n], lambda k, n=n: seen(n, k)) for n in names}
            assert going.wait(120), f"requests did not start streaming: {streamed}"
            running = {d: server.workers()[d].get("num_running", 0) for d in ("decode-0", "decode-1")}
            victim = max(running, key=running.get)
            assert running[victim] > 0, running
            server.worker_process(victim).send_signal(signal.SIGKILL)
            got = {n: f.result(timeout=300) for n, f in futs.items()}
        assert max(streamed.values()) < LONG  # killed mid-stream
        text = httpx.get(server.url + "/metrics", timeout=30).text
        assert _counter(text, "epd_migrated_requests_total", pool="decode", instance=victim) >= 1
        for n in names:
            assert got[n] == undisturbed[n], n
