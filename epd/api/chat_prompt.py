"""Chat prompts: messages -> the model's chat template text plus the media items.

Shared by ``/v1/chat/completions`` (``ChatPromptRenderer``) and ``/v1/realtime``
(``template_takes_parts`` / ``flatten``). Content parts become HF-style
``{"type": "image"}`` / ``{"type": "audio"}`` entries when the model's template
renders them; otherwise each media item becomes its placeholder text inline.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Any

from epd.api.media_fetch import MediaFetcher
from epd.api.protocol import BadRequest, ChatRequest, ImagePart, TextPart
from epd.encoders.processor import AUDIO_PLACEHOLDER, MultiModalProcessor


def template_takes_parts(tokenizer, image_tok: str | None, audio_tok: str | None) -> bool:
    """Whether the chat template renders HF-style content lists: a probe message
    ``[{"type": "image"}, {"type": "audio"}, {"type": "text"}]`` must render each
    media placeholder the model has exactly once and the text. Templates that only
    take string content (they raise, or print the list) get placeholder text instead."""
    if image_tok is None and audio_tok is None:
        return False
    probe_text = "epd-probe-7f3a"
    parts = ([{"type": "image"}] if image_tok else []) + ([{"type": "audio"}] if audio_tok else [])
    try:
        out = tokenizer.apply_chat_template([{"role": "user", "content": parts + [{"type": "text",
                                                                                    "text": probe_text}]}],
                                            add_generation_prompt=True, tokenize=False)
    except Exception:
        return False
    if not isinstance(out, str) or out.count(probe_text) != 1 or "'type'" in out:
        return False
    return all(out.count(t) == 1 for t in (image_tok, audio_tok) if t)


def flatten(parts: list[dict], image_tok: str | None, audio_tok: str, structured: bool) -> str | list[dict]:
    """A message's content parts as the template wants them: the HF list, or one
    string with each media item's placeholder text where it stood."""
    if structured and any(p["type"] != "text" for p in parts):
        return parts
    out = []
    for p in parts:
        out.append(p["text"] if p["type"] == "text" else image_tok if p["type"] == "image" else audio_tok)
    return "".join(out)


def decode_b64(data: str, param: str) -> bytes:
    """Base64 media bytes, bare or as a ``data:<mime>;base64,...`` URL.

    Raises:
        BadRequest: not base64, or a data: URL that is not base64-encoded (``param`` names the field).
    """
    if data.startswith("data:"):
        header, _, data = data.partition(",")
        if ";base64" not in header:
            raise BadRequest("data: URLs must be base64-encoded (data:<mime>;base64,...)", param)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("invalid base64 media data", param) from None


class ChatPromptRenderer:
    """Renders a ``ChatRequest``'s messages for one model: decodes (or fetches) the
    media parts for the processor, transcribes audio for text-only models through
    ``router.transcribe``, and applies the chat template."""

    def __init__(self, router, tokenizer, processor: MultiModalProcessor, fetcher: MediaFetcher) -> None:
        self.router, self.tokenizer, self.processor, self.fetcher = router, tokenizer, processor, fetcher
        self.image_tok = (tokenizer.convert_ids_to_tokens(processor.placeholder_ids["image"])
                          if "image" in processor.placeholder_ids else None)
        self.audio_tok = (tokenizer.convert_ids_to_tokens(processor.placeholder_ids["audio"])
                          if "audio" in processor.placeholder_ids else AUDIO_PLACEHOLDER)
        self.structured = template_takes_parts(tokenizer, self.image_tok,
                                               self.audio_tok if "audio" in processor.placeholder_ids else None)

    async def load_image(self, url: str, param: str) -> bytes:
        """An image_url's bytes: a data: URL, or an http(s) URL on the allowed media domains."""
        if url.startswith("data:"):
            return decode_b64(url, param)
        if url.startswith(("http://", "https://")):
            return await asyncio.to_thread(self.fetcher.fetch, url, "image")
        raise BadRequest("image_url.url must be a data: URL or an http(s) URL on the allowed media domains", param)

    async def _parts(self, content: list, param: str, images: list, audios: list) -> list[dict]:
        """One message's content parts as HF-style dicts; its media go to ``images`` / ``audios``."""
        processor = self.processor
        parts: list[dict] = []
        for p in content:
            if isinstance(p, TextPart):
                parts.append({"type": "text", "text": p.text})
            elif isinstance(p, ImagePart):
                if self.image_tok is None:
                    raise BadRequest("this model does not accept images", param)
                images.append(await self.load_image(p.image_url.url, param))
                parts.append({"type": "image"})
            else:
                if "audio" not in processor.modalities:
                    raise BadRequest("this model does not accept audio", param)
                audios.append(decode_b64(p.input_audio.data, param))
                parts.append({"type": "audio"})
            if len(images) + len(audios) > processor.max_items_per_prompt:
                raise BadRequest(f"at most {processor.max_items_per_prompt} media items per request", param)
        return parts

    async def render(self, body: ChatRequest, rid: str) -> tuple[str, dict]:
        """The chat template's text and the media items, in prompt order.

        Content parts become HF-style ``{"type": "image"}`` / ``{"type": "audio"}``
        entries when the model's template renders them; otherwise each item
        becomes its placeholder text inline (see ``template_takes_parts``).

        Raises:
            BadRequest: a media part the model does not take, bad media data, too many
                items, or a conversation the chat template rejects.
        """
        processor = self.processor
        images, audios, msgs = [], [], []
        for i, m in enumerate(body.messages):
            if not isinstance(m.content, list):
                msgs.append({"role": m.role, "content": m.content or ""})
                continue
            parts = await self._parts(m.content, f"messages.{i}.content", images, audios)
            msgs.append({"role": m.role, "content": flatten(parts, self.image_tok, self.audio_tok, self.structured)})
        mm: dict[str, Any] = {}
        if images:
            mm["image"] = images
        if audios and processor.modalities.get("audio") == "transcribe":
            # decoding media is CPU work: off the event loop, so other streams keep flowing
            items = await asyncio.to_thread(lambda: [processor.audio_item(a) for a in audios])
            texts = await self.router.transcribe(rid + "-asr", items)
            for msg in msgs:
                while AUDIO_PLACEHOLDER in msg["content"] and texts:
                    msg["content"] = msg["content"].replace(AUDIO_PLACEHOLDER, texts.pop(0), 1)
        elif audios:
            mm["audio"] = audios
        try:
            prompt = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # jinja raises for conversations the template rejects
            raise BadRequest(f"the model's chat template rejected the messages: {e}", "messages") from None
        return prompt, mm
