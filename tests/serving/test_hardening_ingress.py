"""Issue 34, as a user meets it at the API's door: media whose processed tensors would be too
large for the wire is scaled down (an image), sampled thinner (a video) or refused with a 400
that names the item, never a 504 minutes later (item 3); request bodies being read at once
are bounded, so slow uploads get 503 before their bodies are read and small requests go on
(item 4)."""

from __future__ import annotations

import base64
import io
import socket
import time

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from epd.models.tiny import create_tiny_model
from tests.encoders.video_files import video
from tests.serving.conftest import launch

pytestmark = pytest.mark.slow

#: --max-mm-item-mb of the test server: 51 KiB, so the tiny model's media can pass it
ITEM_LIMIT_MB = 0.05
ITEM_LIMIT = int(ITEM_LIMIT_MB * 2**20)
#: the tiny Qwen2.5-VL's processor: 4x4 patches, 2x2 merged per token, 2 frames a temporal patch
PATCH, MERGE, TEMPORAL = 4, 2, 2
IMAGE_ROW_BYTES = 3 * TEMPORAL * PATCH**2 * 4  # one patch of pixel_values, fp32
#: --max-body-mb 1, and 2 MiB of bodies read at once
BODY_MB, INFLIGHT_MB = 1, 2

# 4 s of 32x24 at 4 fps: sampled at the default 2 fps, 8 frames (73,728 bytes of
# pixel_values_videos, over the limit); 4 frames fit
CLIP = video("webm", "libvpx-vp9", frames=16, fps=4, size=(24, 32),
             pixels=lambda i, h, w: np.random.default_rng(50 + i).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _png_url(size: tuple[int, int]) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, (20, 120, 220)).save(buf, "PNG")  # flat colour: a tiny file, a large grid
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _video_url() -> str:
    return "data:video/webm;base64," + base64.b64encode(CLIP).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = str(create_tiny_model("qwen2.5-vl", tmp_path_factory.mktemp("ingress") / "qwen2.5-vl"))
    with launch(model, "e:1,pd:1", "--block-size", "8", "--num-kv-blocks", "128", "--max-mm-item-mb",
                str(ITEM_LIMIT_MB), "--max-body-mb", str(BODY_MB), "--max-inflight-body-mb", str(INFLIGHT_MB),
                "--stage-timeout", "60") as s:
        yield s


def _chat(server, parts: list, **extra):
    return server.client().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": parts}], max_tokens=2, temperature=0,
        extra_body=extra or None)


def _image_tokens(server, size: tuple[int, int]) -> int:
    """Prompt tokens of an image of ``size`` with the same text around it, less the text's."""
    text = {"type": "text", "text": "what colour?"}
    with_image = _chat(server, [{"type": "image_url", "image_url": {"url": _png_url(size)}}, text])
    assert with_image.choices[0].finish_reason == "length"
    return with_image.usage.prompt_tokens - _chat(server, [text]).usage.prompt_tokens


def test_a_large_image_is_scaled_down_to_fit_the_item_limit(server):
    """A 256x256 image makes 256 patches (98,304 bytes of pixel_values) at the processor's own
    max_pixels: over the limit, it is served at the largest size that fits, not refused and
    not a 504."""
    # a 16x16 image is the processor's min_pixels: 16 patches, 4 tokens
    tokens = _image_tokens(server, (256, 256)) - _image_tokens(server, (16, 16)) + 4
    assert 4 < tokens * MERGE**2 * IMAGE_ROW_BYTES <= ITEM_LIMIT, tokens
    assert tokens < 256 // MERGE**2  # fewer tokens than at the processor's own size


def test_a_long_video_is_sampled_with_fewer_frames_to_fit(server):
    r = _chat(server, [{"type": "video_url", "video_url": {"url": _video_url()}},
                       {"type": "text", "text": "what moved?"}])
    assert r.choices[0].finish_reason == "length"


def test_a_video_whose_pinned_frames_do_not_fit_is_refused_at_once_naming_it(server):
    parts = [{"type": "text", "text": "what moved?"}, {"type": "video_url", "video_url": {"url": _video_url()}}]
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as err:
        _chat(server, parts, media_io_kwargs={"video": {"num_frames": 8}})
    assert time.monotonic() - t0 < 30  # refused at the door: the stage timeout (60 s) never runs out
    body = err.value.body
    assert body["param"] == "messages.0.content.1", body
    msg = body["message"]
    assert "messages[0].content[1]" in msg and f"{ITEM_LIMIT} bytes" in msg and "--max-mm-item-mb" in msg, msg
    assert "at most 4 frames" in msg, msg
    # the frames that fit are served, and so is every other request
    r = _chat(server, parts, media_io_kwargs={"video": {"num_frames": 4}})
    assert r.choices[0].finish_reason == "length"


def test_an_image_the_processor_cannot_resize_is_a_400_naming_it(server):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(server, [{"type": "image_url", "image_url": {"url": _png_url((1000, 2))}}])
    assert err.value.body["param"] == "messages.0.content.0" and "aspect ratio" in err.value.body["message"]


# ---- item 4: request bodies being read at once ------------------------------------------


def _start_upload(server, content_length: int | None) -> socket.socket:
    """A POST whose headers (and 1 KiB of body) are sent, the rest held back."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    length = (f"Content-Length: {content_length}\r\n" if content_length is not None
              else "Transfer-Encoding: chunked\r\n")
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"{length}\r\n".encode())
    chunk = b" " * 1024
    sock.sendall(chunk if content_length is not None else b"%x\r\n%s\r\n" % (len(chunk), chunk))
    return sock


def _answer(sock: socket.socket) -> bytes:
    """What the server answered on ``sock`` (until it closes it, or 30 s)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data) < data.find(b"\r\n\r\n") + 20:
        try:
            part = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not part:
            break
        data += part
    return data


def _answered(sock: socket.socket) -> bool:
    sock.settimeout(0.5)
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except TimeoutError:
        return False
    finally:
        sock.settimeout(30)


def test_slow_uploads_past_the_body_budget_get_503_before_their_bodies_are_read(server):
    declared = int(0.9 * 2**20)  # two fit in the 2 MiB budget, a third does not
    held = [_start_upload(server, declared) for _ in range(2)]
    try:
        refused = _start_upload(server, declared)
        answer = _answer(refused)  # sent while 0.9 MiB of its body is still unsent
        refused.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer[:300]
        assert b"retry-after: 1" in answer.lower() and b"--max-inflight-body-mb" in answer, answer[:600]
        # a streamed body (no Content-Length) is counted as it comes: refused once it passes the budget
        streamed = _start_upload(server, None)
        for _ in range(400):  # up to 400 KiB more: past the 0.2 MiB left
            if _answered(streamed):
                break
            try:
                streamed.sendall(b"400\r\n" + b" " * 1024 + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
        answer = _answer(streamed)
        streamed.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer[:300]
        # the slow uploads are still held, yet a small request is served
        assert all(not _answered(s) for s in held)
        r = _chat(server, [{"type": "text", "text": "hi"}])
        assert r.choices[0].finish_reason == "length"
    finally:
        for s in held:
            s.close()
    # the budget comes back when the uploads go away: a body of the largest size is read again
    deadline = time.monotonic() + 30
    while True:
        status = httpx.post(server.url + "/v1/completions", content=b"{" + b" " * declared, timeout=60,
                            headers={"content-type": "application/json"}).status_code
        if status != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 400  # read and parsed (not JSON), not refused for want of budget
