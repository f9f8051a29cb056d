"""Public bug reports of disaggregated serving systems, replayed against a real server.

Each test names its row of /work/shared/bug-log.md and replays the trigger; the test
shows the reported failure does not happen in epd. Tests of other rows may join this
file: each keeps its own fixtures.
"""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoConfig, AutoTokenizer

from epd import LLM, SamplingParams
from epd.encoders.processor import MultiModalProcessor
from epd.tiny import IMAGE_TOKEN, create_tiny_model
from tests.serving.conftest import launch
from tests.serving.media import data_url, png

pytestmark = pytest.mark.slow


# ---- rows 18 and 19: a client's typed placeholder text is text ---------------------------------------
@pytest.fixture(scope="module")
def placeholder_llava(tmp_path_factory):
    """A tiny LLaVA with the string-only chat template (media become placeholder text inline,
    the layout where a typed "<image>" and a real image's slot look alike) and its server."""
    d = str(create_tiny_model("llava", tmp_path_factory.mktemp("bugs") / "llava"))
    with launch(d, "e:1,pd:1", "--block-size", "8", "--max-model-len", "512") as server:
        yield d, server


def _ids_with_plain_literals(tok, messages: list[dict], literal: str) -> list[int]:
    """The chat prompt of ``messages`` in which each "\\0" is ``literal`` tokenized as plain text."""
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pieces = rendered.split("\0")
    plain = tok.encode(literal, add_special_tokens=False, split_special_tokens=True)
    ids = tok.encode(pieces[0], add_special_tokens=False)
    for piece in pieces[1:]:
        ids += plain + tok.encode(piece, add_special_tokens=False)
    return ids


def _offline(model_dir: str, prompt: dict, max_tokens: int) -> str:
    llm = LLM(model_dir)
    try:
        return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0].text
    finally:
        llm.shutdown()


def _chat(server, messages: list[dict]) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", timeout=300,
                      json={"messages": messages, "max_tokens": 8, "temperature": 0})


def test_row18_literal_image_text_in_history_plus_one_real_image(placeholder_llava):
    """Row 18 (sglang#37579): literal image-placeholder text in the history plus one real
    image gave HTTP 500 "More IMAGE tokens than data" and wedged retries. In epd the
    typed text is text: the answer equals the offline engine's on that prompt, with the
    one real image in its slot, and the server keeps serving."""
    model_dir, server = placeholder_llava
    image = png(3)
    messages = [
        {"role": "user", "content": f"What does {IMAGE_TOKEN} mean?"},
        {"role": "assistant", "content": f"{IMAGE_TOKEN} marks an image."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                     {"type": "text", "text": "And this?"}]},
    ]
    r = _chat(server, messages)
    assert r.status_code == 200, r.text
    llm_messages = [{"role": "user", "content": "What does \0 mean?"},
                    {"role": "assistant", "content": "\0 marks an image."},
                    {"role": "user", "content": IMAGE_TOKEN + "And this?"}]
    ids = _ids_with_plain_literals(AutoTokenizer.from_pretrained(model_dir), llm_messages, IMAGE_TOKEN)
    expected = _offline(model_dir, {"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}}, 8)
    processed = MultiModalProcessor(model_dir, AutoConfig.from_pretrained(model_dir)).process(ids, {"image": [image]})
    body = r.json()
    assert body["choices"][0]["message"]["content"] == expected
    assert body["usage"]["prompt_tokens"] == len(processed.prompt_token_ids)  # one image's slot, no more
    again = _chat(server, messages)  # nothing wedged: the same request again, same answer
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == expected


def test_row19_text_only_prompt_spelling_the_image_placeholder(placeholder_llava):
    """Row 19 (CVE-2026-44222): a text-only prompt spelling the vision placeholder, with
    no image, killed the worker (IndexError). In epd it is a normal 200 answer on the
    text, on chat and completions alike, and every worker stays up."""
    model_dir, server = placeholder_llava
    tok = AutoTokenizer.from_pretrained(model_dir)
    before = server.workers()
    r = _chat(server, [{"role": "user", "content": f"{IMAGE_TOKEN * 3} what is {IMAGE_TOKEN}?"}])
    assert r.status_code == 200, r.text
    ids = _ids_with_plain_literals(tok, [{"role": "user", "content": "\0\0\0 what is \0?"}], IMAGE_TOKEN)
    assert r.json()["choices"][0]["message"]["content"] == _offline(model_dir, {"prompt_token_ids": ids}, 8)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    c = httpx.post(server.url + "/v1/completions", timeout=300,
                   json={"prompt": f"{IMAGE_TOKEN} hello", "max_tokens": 4, "temperature": 0})
    assert c.status_code == 200, c.text
    assert c.json()["usage"]["prompt_tokens"] == len(tok.encode(f"{IMAGE_TOKEN} hello", split_special_tokens=True))
    after = server.workers()
    assert set(after) == set(before) and not any(w.get("unresponsive") for w in after.values())
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
