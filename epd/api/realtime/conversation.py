"""A ``/v1/realtime`` session's conversation: its items and their content parts, the
responses (as server events carry them), a client's item parsed into one, and the
transcript of an assistant's audio as far as the client heard it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from epd.api.realtime.audio_formats import PCM, AudioFormat
from epd.api.realtime.protocol import MIN_COMMIT_MS, OUTPUT_RATE, VOICES, ClientError, ItemIn, new_id, pcm16, pcm_array


@dataclass(slots=True)
class Part:
    """One content part. ``pcm``: int16 [samples] at ``rate`` Hz (input_audio);
    ``asr``: the transcription task (text-only models). ``output_audio``: ``text`` is
    the transcript, ``marks`` (audio ms, transcript chars) at each spoken phrase's end
    (``conversation.item.truncate`` cuts the transcript at them)."""

    type: str  # input_text | input_audio | output_text | output_audio
    text: str | None = None
    pcm: np.ndarray | None = None
    rate: int = 0
    transcript: str | None = None
    asr: asyncio.Task | None = None
    marks: list[tuple[float, int]] = field(default_factory=list)

    @property
    def audio_ms(self) -> float:
        """Milliseconds of audio spoken for an output_audio part."""
        return self.marks[-1][0] if self.marks else 0.0

    def to_json(self) -> dict:
        if self.type == "input_audio":
            return {"type": "input_audio", "transcript": self.transcript}
        if self.type == "output_audio":
            return {"type": "output_audio", "transcript": self.text or ""}
        return {"type": self.type, "text": self.text or ""}


@dataclass(slots=True)
class Item:
    """A conversation item: a ``message`` of ``role`` user, assistant or system; a
    ``function_call`` (the assistant's: ``call_id``, ``name``, ``arguments`` JSON); or a
    ``function_call_output`` (the client's result for ``call_id``: ``output``)."""

    id: str
    role: str
    parts: list[Part]
    status: str = "completed"
    type: str = "message"
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None

    def to_json(self) -> dict:
        head = {"id": self.id, "object": "realtime.item", "type": self.type, "status": self.status}
        if self.type == "function_call":
            return {**head, "call_id": self.call_id, "name": self.name, "arguments": self.arguments or ""}
        if self.type == "function_call_output":
            return {**head, "call_id": self.call_id, "output": self.output or ""}
        return {**head, "role": self.role, "content": [p.to_json() for p in self.parts]}


@dataclass(slots=True)
class ResponseState:
    """One response, from ``response.create`` to ``response.done``."""

    id: str
    items: list[Item]  # the prompt's items, fixed at response.create
    instructions: str | None
    max_output_tokens: int | str
    temperature: float
    metadata: dict | None
    in_conversation: bool
    modalities: tuple[str, ...] = ("text",)  # ("text",) or ("audio",)
    voice: str = VOICES[0]
    audio_format: AudioFormat = AudioFormat(PCM, OUTPUT_RATE)
    tools: object = None  # the response's epd.api.tools.ToolPlan, or None
    status: str = "in_progress"
    status_details: dict | None = None
    item: Item | None = None  # the assistant message
    outputs: list[Item] = field(default_factory=list)  # the message and function_call items, in output order
    usage: dict | None = None
    cancel_reason: str | None = None
    task: asyncio.Task | None = None
    text: list[str] = field(default_factory=list)

    def to_json(self, conversation_id: str) -> dict:
        """The response as ``response.created`` / ``response.done`` carry it."""
        audio = ({"output": {"format": self.audio_format.to_json(), "voice": self.voice}}
                 if "audio" in self.modalities else None)
        return {"id": self.id, "object": "realtime.response", "status": self.status,
                "status_details": self.status_details, "output": [it.to_json() for it in self.outputs],
                "conversation_id": conversation_id if self.in_conversation else None,
                "output_modalities": list(self.modalities), "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata, "usage": self.usage, "audio": audio}


def truncated_transcript(part: Part, audio_end_ms: float) -> str:
    """The transcript of an ``output_audio`` part as heard up to ``audio_end_ms``: every
    phrase that ended by then, and of the phrase playing then the share of its words
    that its elapsed share of audio covers (speech rate is even enough within a phrase)."""
    text, prev_ms, prev_n = part.text or "", 0.0, 0
    for ms, n in part.marks:
        if audio_end_ms >= ms:
            prev_ms, prev_n = ms, n
            continue
        words = text[prev_n:n].split()
        keep = int(len(words) * (audio_end_ms - prev_ms) / max(ms - prev_ms, 1e-9))
        return (text[:prev_n] + " ".join(words[:keep])).rstrip()
    return text[:prev_n] if part.marks else text


def parse_item(it: ItemIn, param: str, rate: int) -> Item:
    """A client's ``message`` item (``param``: where it stands in the event); its
    ``input_audio`` parts are PCM16 at the session ``rate``."""
    if it.type in ("function_call", "function_call_output"):
        return _parse_call_item(it, param)
    if it.type != "message":
        raise ClientError(f"item type {it.type!r} is not supported; use 'message', 'function_call' or "
                          f"'function_call_output'", f"{param}.type", "unsupported_item_type")
    allowed = {"user": ("input_text", "input_audio"), "system": ("input_text",),
               "assistant": ("output_text", "text", "output_audio")}
    if it.role not in allowed:
        raise ClientError(f"item role {it.role!r} is not supported; use user, assistant or system",
                          f"{param}.role")
    if not it.content:
        raise ClientError("a message needs at least one content part", f"{param}.content")
    parts = []
    for i, c in enumerate(it.content):
        p = f"{param}.content.{i}"
        if c.type not in allowed[it.role]:
            raise ClientError(f"content type {c.type!r} is not supported for a {it.role} message; use "
                              f"{' or '.join(allowed[it.role])}", f"{p}.type", "unsupported_content_type")
        if c.type == "input_audio":
            if c.audio is None:
                raise ClientError("an input_audio part needs audio (base64 PCM16)", f"{p}.audio")
            data = pcm16(c.audio, f"{p}.audio")
            if len(data) / 2 / rate * 1000 < MIN_COMMIT_MS:
                raise ClientError(f"input_audio needs at least {MIN_COMMIT_MS} ms of audio", f"{p}.audio")
            parts.append(Part("input_audio", pcm=pcm_array(data), rate=rate))
        elif c.type == "output_audio":  # an assistant's spoken answer: its transcript is what the model said
            if c.transcript is None:
                raise ClientError("an output_audio part needs its transcript", f"{p}.transcript")
            parts.append(Part("output_audio", text=c.transcript))
        else:
            if c.text is None:
                raise ClientError(f"a {c.type} part needs text", f"{p}.text")
            parts.append(Part("output_text" if it.role == "assistant" else "input_text", text=c.text))
    return Item(it.id or new_id("item"), it.role, parts)


MAX_CALL_ID_CHARS = 256


def _parse_call_item(it: ItemIn, param: str) -> Item:
    """A ``function_call`` (an assistant's earlier call: ``call_id``, ``name``, ``arguments``
    JSON text) or ``function_call_output`` (the result for ``call_id``: ``output`` text)."""
    if not it.call_id or len(it.call_id) > MAX_CALL_ID_CHARS:
        raise ClientError(f"a {it.type} item needs a call_id (1..{MAX_CALL_ID_CHARS} characters)",
                          f"{param}.call_id")
    if it.type == "function_call_output":
        if it.output is None:
            raise ClientError("a function_call_output item needs output (text; it may be empty)", f"{param}.output")
        return Item(it.id or new_id("item"), "tool", [], type=it.type, call_id=it.call_id, output=it.output)
    if not it.name:
        raise ClientError("a function_call item needs the function's name", f"{param}.name")
    import json

    try:
        json.loads(it.arguments or "{}")
    except (json.JSONDecodeError, RecursionError):
        raise ClientError("a function_call item's arguments must be JSON text", f"{param}.arguments") from None
    return Item(it.id or new_id("item"), "assistant", [], type=it.type, call_id=it.call_id, name=it.name,
                arguments=it.arguments or "{}")
