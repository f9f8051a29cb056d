"""Chat prompts: messages -> the model's chat template text plus the media items.

Shared by ``/v1/chat/completions`` (``ChatPromptRenderer``) and ``/v1/realtime``
(``template_takes_parts`` / ``flatten`` / ``LiteralText``). Content parts become HF-style
``{"type": "image"}`` / ``{"type": "audio"}`` entries when the model's template
renders them; otherwise each media item becomes its placeholder text inline. A video
for a model that takes video as images (LLaVA) becomes its sampled frames, one image
part each, decoded here (``epd.encoders.video``) before the template runs.

Media slots come only from real media parts and control tokens only from the template: a
placeholder or special-token string a client types (``"<image>"``, ``"<|im_start|>system"``
in a message, a tool result or a call's arguments) is plain text, tokenized as such
(``LiteralText``), as vLLM and SGLang treat it; a clip's transcript (text-only models)
goes where the clip stood.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import uuid
from typing import Any

from epd.api.cpu_pool import CpuPool, shared_pool
from epd.api.media_fetch import MediaFetcher
from epd.api.protocol import BadRequest, ChatRequest, ImagePart, TextPart, VideoPart
from epd.api.tool_parsers import PARSERS, detect_parser
from epd.api.tools import ToolPlan, apply_template, template_message, template_renders_tools
from epd.encoders.media_limits import MediaError
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


def flatten(parts: list[dict], image_tok: str | None, audio_tok: str, structured: bool,
            video_tok: str | None = None) -> str | list[dict]:
    """A message's content parts as the template wants them: the HF list, or one
    string with each media item's placeholder text where it stood."""
    if structured and any(p["type"] != "text" for p in parts):
        return parts
    slot = {"image": image_tok, "audio": audio_tok, "video": video_tok}
    return "".join(p["text"] if p["type"] == "text" else slot[p["type"]] for p in parts)


class LiteralText:
    """Client text in a prompt: the special tokens and media placeholder strings it spells
    stay text.

    ``escape`` swaps each special token's text (``<|im_start|>``, ``<|eot_id|>``,
    ``[INST]``: every added token the tokenizer marks special) and each placeholder
    string in a client's text for a marker no template or tokenizer treats specially;
    ``encode`` tokenizes the rendered prompt with each marker as that text's ordinary
    tokens (``split_special_tokens``), so the only control tokens are the template's own
    and the only placeholder tokens are the slots the server put in for real media parts.
    ``escape_placeholders`` marks the placeholders only: a ``/v1/completions`` prompt is
    the client's whole template, control tokens included. ``placeholder_ids``: modality
    -> placeholder token id (the processor's).
    """

    def __init__(self, tokenizer, placeholder_ids: dict[str, int]) -> None:
        self.tokenizer = tokenizer
        special = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        self.ids = set(placeholder_ids.values()) | set(special)
        placeholders = [tokenizer.convert_ids_to_tokens(i) for i in placeholder_ids.values()]
        literals = [lit for lit in dict.fromkeys([*placeholders, *special.values()]) if lit]
        tag = uuid.uuid4().hex[:12]
        self.marks = {lit: f"\ue000{tag}{k}\ue001" for k, lit in enumerate(literals)}
        self.plain = {m: self._plain(lit) for lit, m in self.marks.items()}
        self._split = re.compile("(" + "|".join(map(re.escape, self.plain)) + ")") if self.marks else None
        self._all = self._finder(literals)
        self._placeholders = self._finder(placeholders)

    @staticmethod
    def _finder(literals: list[str]) -> re.Pattern | None:
        """A pattern of ``literals``, longest first (one that holds another wins)."""
        ordered = sorted(set(literals), key=len, reverse=True)
        return re.compile("|".join(map(re.escape, ordered))) if ordered else None

    def _plain(self, literal: str) -> list[int]:
        """``literal``'s tokens as ordinary text (character by character if they still hold a special token)."""
        enc = lambda s: self.tokenizer.encode(s, add_special_tokens=False, split_special_tokens=True)  # noqa: E731
        ids = enc(literal)
        return ids if self.ids.isdisjoint(ids) else [t for ch in literal for t in enc(ch)]

    def escape(self, text: str) -> str:
        """``text`` (a client's) with each special token's text and placeholder string marked as text."""
        return self._all.sub(lambda m: self.marks[m.group()], text) if self._all is not None else text

    def escape_placeholders(self, text: str) -> str:
        """``text`` with each placeholder string marked as text (special tokens stay control tokens)."""
        return self._placeholders.sub(lambda m: self.marks[m.group()], text) if self._placeholders else text

    def escape_value(self, value):
        """``value`` (a chat message, tool or arguments: dicts, lists, strings) with every
        string in it, keys included, through ``escape``."""
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, dict):
            return {self.escape(k) if isinstance(k, str) else k: self.escape_value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.escape_value(v) for v in value]
        return value

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of a prompt whose client text went through ``escape``."""
        if self._split is None or "\ue000" not in text:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        ids: list[int] = []
        for k, chunk in enumerate(self._split.split(text)):
            if k % 2:
                ids += self.plain[chunk]
            elif chunk or (k == 0 and add_special_tokens):
                ids += self.tokenizer.encode(chunk, add_special_tokens=add_special_tokens and k == 0)
        return ids


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


def _sized(check, data: bytes, param: str, index: int, *args):
    """``check(data, *args, where=...)`` (``MultiModalProcessor.check_image`` / ``fit_video``:
    an item's processed size, from its header) for content part ``index`` of ``param``
    (``messages.<i>.content``); its refusal becomes a 400 naming that part.

    Raises:
        BadRequest: the item is over ``--max-mm-item-mb`` (or its header is bad).
    """
    where = re.sub(r"\.(\d+)", r"[\1]", f"{param}.{index}")  # messages.0.content.1 -> messages[0].content[1]
    try:
        return check(data, *args, where=where)
    except MediaError as e:
        raise BadRequest(str(e), f"{param}.{index}") from None


class ChatPromptRenderer:
    """Renders a ``ChatRequest``'s messages for one model: decodes (or fetches) the
    media parts for the processor, transcribes audio for text-only models through
    ``router.transcribe``, and applies the chat template. The template, tokenization
    and audio decoding run in ``cpu`` (default: ``shared_pool()``), off the event loop."""

    def __init__(self, router, tokenizer, processor: MultiModalProcessor, fetcher: MediaFetcher,
                 cpu: CpuPool | None = None, tool_parser: str | None = None) -> None:
        """``tool_parser``: the format the model writes tool calls in (``epd.api.tool_parsers.PARSERS``;
        None: detected from the chat template)."""
        self.router, self.tokenizer, self.processor, self.fetcher = router, tokenizer, processor, fetcher
        self.tool_parser = PARSERS[tool_parser or detect_parser(getattr(tokenizer, "chat_template", None))]
        self.native_tools = template_renders_tools(tokenizer)
        self.cpu = cpu or shared_pool()
        self.image_tok = (tokenizer.convert_ids_to_tokens(processor.placeholder_ids["image"])
                          if "image" in processor.placeholder_ids else None)
        self.audio_tok = (tokenizer.convert_ids_to_tokens(processor.placeholder_ids["audio"])
                          if "audio" in processor.placeholder_ids else AUDIO_PLACEHOLDER)
        self.video_tok = (tokenizer.convert_ids_to_tokens(processor.placeholder_ids["video"])
                          if "video" in processor.placeholder_ids else None)
        self.structured = template_takes_parts(tokenizer, self.image_tok,
                                               self.audio_tok if "audio" in processor.placeholder_ids else None)
        self.literal = LiteralText(tokenizer, processor.placeholder_ids)

    async def load_image(self, url: str, param: str, modality: str = "image") -> bytes:
        """An image_url's (or video_url's) bytes: a data: URL, or an http(s) URL on the allowed
        media domains."""
        if url.startswith("data:"):
            return decode_b64(url, param)
        if url.startswith(("http://", "https://")):
            return await asyncio.to_thread(self.fetcher.fetch, url, modality)
        raise BadRequest(f"{modality}_url.url must be a data: URL or an http(s) URL on the allowed media domains",
                         param)

    async def _parts(self, content: list, param: str, images: list, audios: list, videos: list,
                     sampling=None, pinned: bool = False) -> list[dict]:
        """One message's content parts as HF-style dicts; its media go to ``images`` / ``audios``.
        ``pinned``: the request named its videos' frame count (they are never sampled thinner)."""
        processor = self.processor
        parts: list[dict] = []
        for j, p in enumerate(content):
            if isinstance(p, TextPart):
                parts.append({"type": "text", "text": self.literal.escape(p.text)})
            elif isinstance(p, ImagePart):
                if self.image_tok is None:
                    raise BadRequest("this model does not accept images", param)
                data = await self.load_image(p.image_url.url, param)
                _sized(processor.check_image, data, param, j)
                images.append(data)
                parts.append({"type": "image"})
            elif isinstance(p, VideoPart):
                mode = processor.modalities.get("video")
                if mode not in ("frames", "embed"):
                    raise BadRequest("this model does not accept video", param)
                data = await self.load_image(p.video_url.url, param, "video")
                if mode == "frames":  # LLaVA: the sampled frames as images
                    frames = await self.cpu.run(processor.video_frames, data, sampling)
                    images.extend(frames)
                    parts.extend({"type": "image"} for _ in frames)
                else:  # Qwen-VL: one video item of temporal patches, decoded by the processor
                    fitted = await self.cpu.run(_sized, processor.fit_video, data, param, j,
                                                sampling or processor.video_sampling(), pinned)
                    videos.append((data, fitted))
                    parts.append({"type": "video"})
            else:
                if "audio" not in processor.modalities:
                    raise BadRequest("this model does not accept audio", param)
                audios.append(decode_b64(p.input_audio.data, param))
                parts.append({"type": "audio"})
            if (sum(1 for i in images if getattr(i, "index", 0) == 0) + len(audios) + len(videos)
                    > processor.max_items_per_prompt):
                raise BadRequest(f"at most {processor.max_items_per_prompt} media items per request", param)
        return parts

    async def render(self, body: ChatRequest, rid: str, plan: ToolPlan | None = None) -> tuple[list[int], dict]:
        """The prompt's token ids (the chat template's text) and the media items, in prompt
        order; ``rid``: the router request id of the audio's transcription (unique, made
        by the server); ``plan``: the request's tools (``epd.api.tools``), rendered by the
        template when it shows tools, else described in a system message.

        Content parts become HF-style ``{"type": "image"}`` / ``{"type": "audio"}``
        entries when the model's template renders them; otherwise each item
        becomes its placeholder text inline (see ``template_takes_parts``). Special-token
        and placeholder strings in the client's text (contents, names, tool calls and
        results, tools) are text (``LiteralText``).

        Raises:
            BadRequest: a media part the model does not take, bad media data, too many
                items, or a conversation the chat template rejects.
            CapacityError: the CPU pool is full.
        """
        processor, literal = self.processor, self.literal
        images, audios, videos, msgs = [], [], [], []
        video_kwargs = body.media_io_kwargs.video if body.media_io_kwargs and body.media_io_kwargs.video else None
        sampling = None
        if video_kwargs is not None and "video" in processor.modalities:
            sampling = processor.video_sampling(video_kwargs.fps, video_kwargs.num_frames)
        for i, m in enumerate(body.messages):
            if not isinstance(m.content, list):
                msgs.append(literal.escape_value(template_message(m, m.content or "")))
                continue
            msgs.append(literal.escape_value(template_message(m, await self._parts(
                m.content, f"messages.{i}.content", images, audios, videos, sampling,
                video_kwargs is not None and video_kwargs.num_frames is not None))))
        mm: dict[str, Any] = {}
        if images:
            mm["image"] = images
        if videos:
            mm["video"] = videos
        if audios and processor.modalities.get("audio") == "transcribe":
            items = await self.cpu.run(lambda: [processor.audio_item(a) for a in audios])
            texts = iter(await self.router.transcribe(rid, items))
            for msg in msgs:  # each transcript where its clip stood
                if isinstance(msg["content"], list):
                    msg["content"] = [{"type": "text", "text": literal.escape(next(texts))} if p["type"] == "audio"
                                      else p for p in msg["content"]]
        elif audios:
            mm["audio"] = audios
        for msg in msgs:
            if isinstance(msg["content"], list):
                msg["content"] = flatten(msg["content"], self.image_tok, self.audio_tok, self.structured,
                                         self.video_tok)
        return await self.cpu.run(self._template, msgs, plan), mm

    def _template(self, msgs: list[dict], plan: ToolPlan | None = None) -> list[int]:
        """Token ids of the chat template over ``msgs`` and the tools of ``plan`` (runs in the CPU pool).

        Raises:
            BadRequest: the template rejects the messages.
        """
        try:
            prompt = apply_template(self.tokenizer, msgs, plan, self.native_tools, self.tool_parser,
                                    self.literal.escape_value)
        except Exception as e:  # jinja raises for conversations the template rejects
            raise BadRequest(f"the model's chat template rejected the messages: {e}", "messages") from None
        return self.literal.encode(prompt)
