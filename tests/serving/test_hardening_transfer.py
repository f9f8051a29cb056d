"""Transfers that outlive their release, embeddings reused under a reader, and embedding
reads that block a worker's loop (issue 34 items 1, 2 and 8b), replayed as a user
triggers them.

The CPU transport completes a transfer inside its post, so these tests use the
transport's hold seam (``EPD_INJECT_HOLD_TRANSFERS``, ``epd.transfer.nixl_transport``):
while the file it names exists (``{agent}``: the worker's instance id), that worker's
transfers stay in flight and cannot be cancelled; once it is removed they land.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from epd.models.tiny import create_tiny_model
from tests.serving.conftest import Server, launch
from tests.serving.media import data_url, png
from tests.serving.public_bugs_helpers import assert_idle, metric, start_and_drop

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(create_tiny_model("llama", tmp_path_factory.mktemp("hold") / "llama"))


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return str(create_tiny_model("llava", tmp_path_factory.mktemp("hold") / "llava"))


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared: nothing was held"
        time.sleep(0.05)


def _complete(server: Server, prompt: list[int], max_tokens: int, timeout: float = 300) -> str:
    out = server.client().with_options(timeout=timeout, max_retries=0).completions.create(
        model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_cancelled_write_still_in_flight_keeps_its_blocks_fenced(llama_dir, tmp_path):
    """Item 1: a client hangs up while its prompt's KV writes are in flight and NIXL
    cannot cancel them. The prefill worker must not tell the decode worker the blocks
    are free until the writes terminated: they show in ``epd_kv_fenced_blocks``, and a
    second request decoding on the same decode worker meanwhile (prefilled on the other
    prefill worker) keeps its exact tokens when the late writes land; every block comes
    back once they terminate."""
    hold = tmp_path / "hold-prefill-0"
    env = {"EPD_INJECT_HOLD_TRANSFERS": str(tmp_path / "hold-{agent}")}
    with launch(llama_dir, "p:2,d:1", "--prefill-routing", "round-robin", "--max-num-seqs", "8",
                env=env, timeout_s=900) as server:
        short = [300 + k for k in range(20)]
        long = [50 + (7 * k) % 400 for k in range(16 * 12)]
        expected = _complete(server, short, 400)
        _complete(server, short, 1)  # round-robin: the next prefill goes to prefill-0 again
        before = server.workers()

        hold.touch()
        dropped = start_and_drop(server, long, after_s=3.0)
        _wait_for(Path(str(hold) + ".held"))  # its layer writes are posted and stuck
        dropped.join()
        time.sleep(1.0)  # the API's abort reaches both workers
        fenced: list[float] = []
        got = _stream_and_release(server, short, 400, hold, fenced)
        assert fenced and fenced[0] >= 12, f"the cancelled prompt's blocks were freed under its writes: {fenced}"
        assert got == expected, "a late write of the cancelled prompt landed in blocks another request uses"
        assert_idle(server, before)
        deadline = time.monotonic() + 30
        while metric(server, "epd_kv_fenced_blocks") and time.monotonic() < deadline:
            time.sleep(0.25)
        assert metric(server, "epd_kv_fenced_blocks") == 0


def _stream_and_release(server: Server, prompt: list[int], max_tokens: int, hold: Path, fenced: list) -> str:
    """Stream ``prompt``'s answer; after its 20th token note ``epd_kv_fenced_blocks``, end
    the hold (the held writes land) and send one more request through the held worker."""
    pieces = []
    stream = server.client().completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
    for n, chunk in enumerate(stream):
        pieces.append(chunk.choices[0].text)
        if n == 20:
            fenced.append(metric(server, "epd_kv_fenced_blocks"))
            os.remove(hold)
            threading.Thread(target=_complete, args=(server, [7, 8, 9], 1), daemon=True).start()
    return "".join(pieces)


# ==== tiny LLaVA on e:1,pd:1; the pd worker's transfers can be held =========================
@pytest.fixture(scope="module")
def held_llava(llava_dir, tmp_path_factory):
    """(server, hold file of pd-0): embeddings reclaimed 0.2 s after the router ended their
    request, 120 s for a transfer (longer than any wait below)."""
    d = tmp_path_factory.mktemp("holds")
    env = {"EPD_INJECT_HOLD_TRANSFERS": str(d / "hold-{agent}")}
    with launch(llava_dir, "e:1,pd:1", "--block-size", "8", "--max-model-len", "512", "--embedding-ttl", "0.2",
                "--kv-timeout", "120", env=env, timeout_s=900) as server:
        yield server, d / "hold-pd-0"


def _image_chat(server: Server, image: bytes, text: str = "What is in this picture?", timeout: float = 300) -> str:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": text}]
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": server.model, "messages": [{"role": "user", "content": parts}], "max_tokens": 8,
        "temperature": 0, "ignore_eos": True}, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _held(hold: Path) -> Path:
    """Start holding; returns the file each held transfer appends to (removed first)."""
    marker = Path(str(hold) + ".held")
    marker.unlink(missing_ok=True)
    hold.touch()
    return marker


def test_embedding_read_in_flight_does_not_stall_other_requests(held_llava):
    """Item 8b: while one request's embedding read is in flight (held), a text-only request
    on the same pd worker runs to completion; the image request then finishes with its own
    answer once the read lands. A worker that waited for the read inside its loop would
    serve nothing else until it timed out (120 s here)."""
    server, hold = held_llava
    image = png(3401)
    text_prompt = [400 + k for k in range(12)]
    want_image, want_text = _image_chat(server, image), _complete(server, text_prompt, 8)
    marker = _held(hold)
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_image_chat, server, image)
            _wait_for(marker)
            assert _complete(server, text_prompt, 8, timeout=60) == want_text  # served while the read is held
            assert not pending.done()
            hold.unlink()
            assert pending.result(timeout=120) == want_image
    finally:
        hold.unlink(missing_ok=True)


def test_embeddings_are_not_reclaimed_under_their_reader(held_llava):
    """Item 2: request A's embedding read is held longer than the encoder's reclaim time
    (0.2 s), then request B (another image, as large) is encoded on the same encoder.
    A's span must still hold A's embeddings when A's read lands: A gets A's answer, never
    B's (a span reclaimed by a timer would now hold B's embeddings, at the same offset);
    nothing is left held afterwards."""
    server, hold = held_llava
    img_a, img_b = png(3501), png(3502)
    want_a, want_b = _image_chat(server, img_a), _image_chat(server, img_b)
    assert want_a != want_b
    before = server.workers()
    marker = _held(hold)
    try:
        with ThreadPoolExecutor(2) as pool:
            got_a = pool.submit(_image_chat, server, img_a)
            _wait_for(marker)
            time.sleep(1.0)  # past the reclaim time
            got_b = pool.submit(_image_chat, server, img_b)
            deadline = time.monotonic() + 10  # B encoded and its read held too (or, at most, 10 s)
            while len(marker.read_text().splitlines()) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not got_b.done()
            hold.unlink()
            assert got_a.result(timeout=120) == want_a, "A was answered from another request's embeddings"
            assert got_b.result(timeout=120) == want_b
    finally:
        hold.unlink(missing_ok=True)
    assert_idle(server, before)
