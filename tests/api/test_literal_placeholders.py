"""A client's typed placeholder text is text, never a media slot (review defect 11;
public bug-log rows 18 and 19, /work/shared/bug-log.md).

Row 18 (sglang#37579): literal ``<image>`` text in the history plus one real image made
"more image tokens than data". Row 19 (CVE-2026-44222): a text-only prompt spelling the
vision placeholder, with no image, crashed the worker. As vLLM and SGLang do, the text is
plain text: the only media slots are those of the request's real media parts, in their
positions; the typed string is tokenized as ordinary text. In process, on the tiny
LLaVA / Qwen2-Audio / Qwen2 checkpoints: the chat renderer (``ChatPromptRenderer``), the
realtime prompt (``ConversationPrompt``) and the processor that counts the slots. The
served answers are checked in tests/serving/test_public_bugs.py.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
from transformers import AutoConfig, AutoTokenizer

from epd.api.chat_prompt import ChatPromptRenderer
from epd.api.media_fetch import MediaFetcher
from epd.api.protocol import ChatRequest
from epd.api.realtime.conversation import Item, Part, ResponseState
from epd.api.realtime.prompt import ConversationPrompt
from epd.encoders.processor import AUDIO_PLACEHOLDER, MultiModalProcessor
from epd.models.tiny import AUDIO_TOKEN, IMAGE_TOKEN, create_tiny_model
from tests.serving.media import data_url, png, wav


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("literal")
    return {k: str(create_tiny_model(k, root / k)) for k in ("llava", "qwen2-audio", "qwen2")}


def _setup(model_dir: str):
    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok, MultiModalProcessor(model_dir, AutoConfig.from_pretrained(model_dir))


class _Router:
    """Transcribes every clip as ``HEARD``."""

    def has_pool(self, role):  # no tts pool: sessions answer in text
        return False

    async def transcribe(self, rid, items):
        return ["HEARD"] * len(items)


def _render(model_dir: str, messages: list[dict]):
    """(tokenizer, processor, prompt ids, media) of a chat request rendered by the API."""
    tok, proc = _setup(model_dir)
    renderer = ChatPromptRenderer(_Router(), tok, proc, MediaFetcher(()))
    prompt, mm = asyncio.run(renderer.render(ChatRequest.model_validate({"messages": messages}), "asr-test"))
    # (a rendered text is what the API tokenized before: the same call CompletionService made)
    ids = prompt if isinstance(prompt, list) else tok.encode(prompt, add_special_tokens=False)
    return tok, proc, ids, mm


def _plain(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False, split_special_tokens=True)


def _expected(tok, rendered: str, literal: str) -> list[int]:
    """``rendered`` tokenized with its first ``literal`` as plain text and the rest as usual."""
    i = rendered.index(literal)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    return enc(rendered[:i]) + _plain(tok, literal) + enc(rendered[i + len(literal):])


def test_row18_literal_image_text_in_history_plus_one_real_image(dirs):
    history = [{"role": "user", "content": f"What does {IMAGE_TOKEN} mean in a prompt?"},
               {"role": "assistant", "content": f"It marks an image: {IMAGE_TOKEN}."}]
    turn = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(1))}},
                                        {"type": "text", "text": "And this one?"}]}
    tok, proc, ids, mm = _render(dirs["llava"], history + [turn])
    out = proc.process(ids, mm)  # before the fix: "3 image placeholder token(s) but 1 image item(s)"
    (slot,) = out.placeholders
    image_id = proc.placeholder_ids["image"]
    assert out.prompt_token_ids.count(image_id) == slot.length == out.items[0].num_tokens
    # The typed strings are the plain-text tokens of "<image>"; the real part's slot is where it stood.
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "What does \0 mean in a prompt?"}, {"role": "assistant",
         "content": "It marks an image: \0."}, {"role": "user", "content": IMAGE_TOKEN + "And this one?"}],
        add_generation_prompt=True, tokenize=False)
    first, second, rest = rendered.split("\0")
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert ids == enc(first) + _plain(tok, IMAGE_TOKEN) + enc(second) + _plain(tok, IMAGE_TOKEN) + enc(rest)


def test_row19_text_only_prompt_spelling_the_image_placeholder(dirs):
    messages = [{"role": "user", "content": f"{IMAGE_TOKEN}{IMAGE_TOKEN} describe {IMAGE_TOKEN} please"}]
    tok, proc, ids, mm = _render(dirs["llava"], messages)
    assert mm == {}
    out = proc.process(ids, mm)  # before the fix: InvalidRequestError (3 placeholders, no image)
    assert out.placeholders == [] and proc.placeholder_ids["image"] not in out.prompt_token_ids
    assert tok.decode(ids).count(IMAGE_TOKEN) == 3  # still there, as text
    # as a list of parts too, and in a system message
    _, proc, ids, _ = _render(dirs["llava"], [{"role": "system", "content": IMAGE_TOKEN},
                                              {"role": "user", "content": [{"type": "text", "text": IMAGE_TOKEN}]}])
    assert proc.process(ids, {}).placeholders == []


def test_typed_audio_placeholder_with_a_real_clip_is_text_for_an_audio_model(dirs):
    messages = [{"role": "user", "content": [
        {"type": "text", "text": f"say {AUDIO_TOKEN} then: "},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(1)).decode(), "format": "wav"}}]}]
    tok, proc, ids, mm = _render(dirs["qwen2-audio"], messages)
    out = proc.process(ids, mm)
    (slot,) = out.placeholders
    assert out.prompt_token_ids.count(proc.placeholder_ids["audio"]) == slot.length


def test_a_transcript_takes_its_clips_place_not_the_typed_placeholder(dirs):
    """Text-only models hear a clip as its transcript: it goes where the clip stood; a
    typed ``<|audio|>`` before it stays as typed."""
    messages = [{"role": "user", "content": [
        {"type": "text", "text": f"I typed {AUDIO_PLACEHOLDER} here; I said: "},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(1)).decode(), "format": "wav"}},
        {"type": "text", "text": " (end)"}]}]
    tok, _, ids, mm = _render(dirs["qwen2"], messages)
    assert mm == {}
    assert f"I typed {AUDIO_PLACEHOLDER} here; I said: HEARD (end)" in tok.decode(ids)


def _prompt_request(model_dir: str, parts: list[Part], instructions: str | None = None):
    tok, proc = _setup(model_dir)
    prompt = ConversationPrompt(tok, proc, max_model_len=4096)
    resp = ResponseState("resp_1", [Item("item_1", "user", parts)], instructions, 4, 0.0, None, True)
    req, audio_tokens = asyncio.run(prompt.build_request(resp))
    return tok, proc, req, audio_tokens


def test_realtime_typed_placeholders_are_text(dirs):
    pcm = (np.sin(np.arange(4800) / 10) * 8000).astype(np.int16)  # 200 ms at 24 kHz
    tok, proc, req, audio_tokens = _prompt_request(
        dirs["qwen2-audio"], [Part("input_text", text=f"read {AUDIO_TOKEN} and {IMAGE_TOKEN}: "),
                              Part("input_audio", pcm=pcm, rate=24000)], instructions=f"Hear {AUDIO_TOKEN}.")
    (slot,) = req.placeholders  # only the real clip's
    assert req.prompt_token_ids.count(proc.placeholder_ids["audio"]) == slot.length == audio_tokens
    # Row 19 in realtime: text only, on the vision model too.
    tok, proc, req, audio_tokens = _prompt_request(dirs["llava"], [Part("input_text", text=f"{IMAGE_TOKEN}?")])
    assert req.placeholders == [] and audio_tokens == 0
    assert proc.placeholder_ids["image"] not in req.prompt_token_ids
    assert IMAGE_TOKEN in tok.decode(req.prompt_token_ids)
