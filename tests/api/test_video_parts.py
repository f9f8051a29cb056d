"""``video_url`` parts in ``ChatPromptRenderer``: data: and allowlisted http(s) URLs give the
same frames (as image slots, in prompt order, next to the message's images); a host off the
allowlist is refused as a video; ``media_io_kwargs.video`` sets the sampling."""

from __future__ import annotations

import asyncio
import base64
import http.server
import threading

import numpy as np
import pytest
from transformers import AutoConfig, AutoTokenizer

from epd.api.chat_prompt import ChatPromptRenderer
from epd.api.media_fetch import MediaFetcher
from epd.api.protocol import BadRequest, ChatRequest
from epd.encoders.media_limits import MediaError
from epd.encoders.processor import MultiModalProcessor
from epd.encoders.video import VideoFrame
from epd.models.tiny import IMAGE_TOKEN, create_tiny_model
from tests.encoders.video_files import video

CLIP = video(frames=8, fps=4, pixels=lambda i, h, w: np.random.default_rng(i).integers(0, 256, (h, w, 3), np.uint8))


@pytest.fixture(scope="module")
def renderer(tmp_path_factory):
    model_dir = create_tiny_model("llava", tmp_path_factory.mktemp("vparts") / "llava")
    tok = AutoTokenizer.from_pretrained(model_dir)
    processor = MultiModalProcessor(model_dir, AutoConfig.from_pretrained(model_dir))

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(CLIP)))
            self.end_headers()
            self.wfile.write(CLIP)

    origin = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=origin.serve_forever, daemon=True).start()
    fetcher = MediaFetcher(["media.test"], resolve=lambda host, port: ["127.0.0.1"],
                           allow_address=lambda ip: ip == "127.0.0.1")
    yield ChatPromptRenderer(None, tok, processor, fetcher), origin.server_port
    origin.shutdown()


def _body(*parts, **extra) -> ChatRequest:
    return ChatRequest.model_validate({"messages": [{"role": "user", "content": list(parts)}], **extra})


def _render(renderer, body):
    return asyncio.run(renderer.render(body, "rid"))


def test_video_url_becomes_its_frames_as_image_slots(renderer):
    r, port = renderer
    data_url = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(CLIP).decode()}}
    http_url = {"type": "video_url", "video_url": {"url": f"http://media.test:{port}/clip.mp4"}}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    ids, mm = _render(r, _body(image, data_url, {"type": "text", "text": "hi"}))
    image_id = r.processor.placeholder_ids["image"]
    assert ids.count(image_id) == 1 + 4  # the image, then 4 frames (2 s at 2 fps)
    assert isinstance(mm["image"][0], bytes) and [f.index for f in mm["image"][1:]] == [0, 1, 2, 3]
    _, fetched = _render(r, _body(http_url))
    assert [f.video_digest for f in fetched["image"]] == [f.video_digest for f in mm["image"][1:]]
    assert all(np.array_equal(a.pixels, b.pixels) for a, b in zip(fetched["image"], mm["image"][1:]))
    _, one_fps = _render(r, _body(data_url, media_io_kwargs={"video": {"fps": 1.0, "num_frames": 3}}))
    frames = one_fps["image"]
    assert all(isinstance(f, VideoFrame) for f in frames) and len(frames) == 2
    assert frames[0].video_digest != mm["image"][1].video_digest


def test_refusals(renderer):
    r, port = renderer
    with pytest.raises(MediaError, match="allowed media domains") as e:
        _render(r, _body({"type": "video_url", "video_url": {"url": f"http://elsewhere.test:{port}/a.mp4"}}))
    assert e.value.modality == "video"
    with pytest.raises(BadRequest, match="video_url.url must be"):
        _render(r, _body({"type": "video_url", "video_url": {"url": "file:///etc/passwd"}}))
    # A typed placeholder stays text; only the frames are slots.
    ids, _ = _render(r, _body({"type": "text", "text": IMAGE_TOKEN + "<video>"}))
    assert r.processor.placeholder_ids["image"] not in ids


@pytest.fixture(scope="module")
def qwen_renderer(tmp_path_factory):
    model_dir = create_tiny_model("qwen2.5-vl", tmp_path_factory.mktemp("vparts") / "qwen")
    tok = AutoTokenizer.from_pretrained(model_dir)
    return ChatPromptRenderer(None, tok, MultiModalProcessor(model_dir, AutoConfig.from_pretrained(model_dir)),
                              MediaFetcher())


def test_qwen_video_url_is_one_video_item_sampled_as_the_request_asks(qwen_renderer):
    r = qwen_renderer
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(CLIP).decode()}}
    ids, mm = _render(r, _body(part, {"type": "text", "text": "what moved?"}))
    video_id = r.processor.placeholder_ids["video"]
    assert ids.count(video_id) == 1 and len(mm["video"]) == 1  # one <|video_pad|>, expanded by the processor
    processed = r.processor.process(ids, mm)
    (item,) = processed.items
    assert item.modality == "video" and item.data["video_grid_thw"].tolist()[0] == 2  # 4 frames at 2 fps
    assert processed.prompt_token_ids.count(video_id) == item.num_tokens
    ids1, mm1 = _render(r, _body(part, media_io_kwargs={"video": {"fps": 1.0}}))
    (slow,) = r.processor.process(ids1, mm1).items
    assert slow.data["video_grid_thw"].tolist()[0] == 1 and slow.item_hash != item.item_hash
    # A client typing the pad token gets text, not a video slot.
    typed, _ = _render(r, _body({"type": "text", "text": "<|video_pad|>"}))
    assert video_id not in typed


def test_non_finite_fps_is_refused_as_such():
    """A raw JSON NaN (or Infinity) fps is named as not finite, not as over the 1000 cap."""
    import pydantic

    from epd.api.protocol import VideoIOKwargs

    for raw in ("NaN", "Infinity"):
        with pytest.raises(pydantic.ValidationError, match="finite number"):
            VideoIOKwargs.model_validate_json(f'{{"fps": {raw}}}')
