"""``/v1/realtime`` shapes: the client events epd reads (OpenAI's shapes; fields epd
does not use are ignored), the conversation it keeps (items, content parts,
responses, as server events carry them), and the PCM16 checks every audio input
shares. The protocol itself is described in ``epd.api.realtime``."""

from __future__ import annotations

import asyncio
import base64
import binascii
import uuid
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from epd.api.vad import ServerVad

DEFAULT_RATE = 24000
MIN_RATE, MAX_RATE = 8000, 48000
MIN_COMMIT_MS = 100
#: decoded PCM bytes in one ``input_audio_buffer.append`` (or one ``input_audio`` part): ~87 s at 24 kHz
MAX_APPEND_BYTES = 4 * 2**20
# Containers whose bytes a client may send by mistake where raw PCM is expected.
_CONTAINER_MAGIC = {b"RIFF": "WAV", b"fLaC": "FLAC", b"OggS": "OGG", b"ID3": "MP3"}


def new_id(prefix: str) -> str:
    """A fresh ``<prefix>_<20 hex digits>`` id (sessions, items, responses, events)."""
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class ClientError(Exception):
    """A client event was rejected: becomes an ``error`` event of type ``kind`` (the session goes on)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value",
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param, self.code, self.kind = param, code, kind


# ---- client events (OpenAI's shapes; fields epd does not use are ignored) -----------------------
class LooseEvent(BaseModel):
    """Base of the client event shapes: unknown fields are ignored (an event with no fields of its own);
    types are strict, as in the HTTP bodies (``"temperature": "0.5"`` is an error, ``0`` a number)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class _Format(LooseEvent):
    type: str = "audio/pcm"
    rate: int | None = None


class TurnDetectionIn(LooseEvent):
    """``session.audio.input.turn_detection`` (OpenAI's ``server_vad``; ``semantic_vad`` is
    run as ``server_vad``: its ``eagerness`` is accepted and not acted on)."""

    type: Literal["server_vad", "semantic_vad"] = "server_vad"
    threshold: float | None = None
    prefix_padding_ms: int | None = None
    silence_duration_ms: int | None = None
    idle_timeout_ms: int | None = None
    create_response: bool | None = None
    interrupt_response: bool | None = None
    eagerness: str | None = None


class _AudioInput(LooseEvent):
    format: _Format | None = None
    turn_detection: TurnDetectionIn | None = None
    transcription: dict | None = None
    noise_reduction: dict | None = None  # accepted, not acted on


class _Audio(LooseEvent):
    input: _AudioInput | None = None


class SessionIn(LooseEvent):
    type: str | None = None
    instructions: str | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    output_modalities: list[str] | None = None
    audio: _Audio | None = None
    tools: list | None = None
    temperature: float | None = None


class ContentIn(LooseEvent):
    type: str
    text: str | None = None
    audio: str | None = None
    transcript: str | None = None


class ItemIn(LooseEvent):
    type: str = "message"
    id: str | None = None
    role: str | None = None
    content: list[ContentIn] = []


class ResponseIn(LooseEvent):
    conversation: str | None = None
    input: list[dict] | None = None
    instructions: str | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    output_modalities: list[str] | None = None
    metadata: dict[str, str] | None = None
    temperature: float | None = None


class SessionUpdate(LooseEvent):
    session: SessionIn


class AudioAppend(LooseEvent):
    audio: str


class ItemCreate(LooseEvent):
    item: ItemIn
    previous_item_id: str | None = None


class ItemDelete(LooseEvent):
    item_id: str


class ItemRetrieve(LooseEvent):
    item_id: str


class ResponseCreate(LooseEvent):
    response: ResponseIn | None = None


class ResponseCancel(LooseEvent):
    response_id: str | None = None


# ---- conversation state ------------------------------------------------------------------------
@dataclass(slots=True)
class Part:
    """One content part. ``pcm``: int16 [samples] at ``rate`` Hz (input_audio);
    ``asr``: the transcription task (text-only models)."""

    type: str  # input_text | input_audio | output_text
    text: str | None = None
    pcm: np.ndarray | None = None
    rate: int = 0
    transcript: str | None = None
    asr: asyncio.Task | None = None

    def to_json(self) -> dict:
        if self.type == "input_audio":
            return {"type": "input_audio", "transcript": self.transcript}
        return {"type": self.type, "text": self.text or ""}


@dataclass(slots=True)
class Item:
    """A conversation item: a ``message`` of ``role`` user, assistant or system."""

    id: str
    role: str
    parts: list[Part]
    status: str = "completed"

    def to_json(self) -> dict:
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role,
                "status": self.status, "content": [p.to_json() for p in self.parts]}


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
    status: str = "in_progress"
    status_details: dict | None = None
    item: Item | None = None
    usage: dict | None = None
    cancel_reason: str | None = None
    task: asyncio.Task | None = None
    text: list[str] = field(default_factory=list)

    def to_json(self, conversation_id: str) -> dict:
        """The response as ``response.created`` / ``response.done`` carry it."""
        return {"id": self.id, "object": "realtime.response", "status": self.status,
                "status_details": self.status_details, "output": [self.item.to_json()] if self.item else [],
                "conversation_id": conversation_id if self.in_conversation else None,
                "output_modalities": ["text"], "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata, "usage": self.usage, "audio": None}


def pcm16(audio_b64: str, param: str, check_container: bool = True) -> bytes:
    """Base64 PCM16 -> bytes, with the checks every audio input shares. ``check_container``:
    reject bytes that start like a WAV/FLAC/OGG/MP3 file (only at the start of a clip:
    further in, those 4 bytes are as likely samples).

    Raises:
        ClientError: over ``MAX_APPEND_BYTES``, not base64, a container file, or an odd byte count.
    """
    if len(audio_b64) > (MAX_APPEND_BYTES + 2) // 3 * 4 + 4:
        raise ClientError(f"audio is over the {MAX_APPEND_BYTES}-byte limit per event "
                          f"(decoded PCM16); send it in smaller appends", param, "audio_too_large")
    try:
        data = base64.b64decode(audio_b64, validate=True)
    except (binascii.Error, ValueError):
        raise ClientError("audio is not valid base64", param, "invalid_audio") from None
    if len(data) > MAX_APPEND_BYTES:
        raise ClientError(f"audio is {len(data)} bytes, over the {MAX_APPEND_BYTES}-byte limit per event "
                          f"(decoded PCM16); send it in smaller appends", param, "audio_too_large")
    for magic, name in _CONTAINER_MAGIC.items():
        if check_container and data.startswith(magic):
            raise ClientError(f"audio looks like a {name} file; send raw PCM16 little-endian mono samples in the "
                              f"session's input format (audio/pcm), without a container header", param,
                              "invalid_audio_format")
    if len(data) % 2:
        raise ClientError(f"PCM16 audio needs an even number of bytes, got {len(data)}", param,
                          "invalid_audio_format")
    return data


def pcm_array(data: bytes) -> np.ndarray:
    """PCM16 little-endian bytes as int16 samples."""
    return np.frombuffer(data, dtype="<i2").astype(np.int16)


# ---- checks of client event fields --------------------------------------------------------------
_VAD_MS_RANGES = {"prefix_padding_ms": (0, 10_000), "silence_duration_ms": (32, 10_000)}


def check_turn_detection(td: TurnDetectionIn, param: str) -> ServerVad:
    """``turn_detection`` as the session runs it: OpenAI's defaults for what is not given.

    Raises:
        ClientError: a threshold outside (0, 1), a duration out of range, or
            ``idle_timeout_ms`` (not implemented).
    """
    vad = ServerVad()
    if td.threshold is not None:
        if not 0.0 < td.threshold < 1.0:
            raise ClientError(f"threshold must be between 0 and 1, got {td.threshold}", f"{param}.threshold")
        vad.threshold = td.threshold
    for name, (lo, hi) in _VAD_MS_RANGES.items():
        value = getattr(td, name)
        if value is not None:
            if not lo <= value <= hi:
                raise ClientError(f"{name} must be {lo}..{hi}, got {value}", f"{param}.{name}")
            setattr(vad, name, value)
    if td.idle_timeout_ms is not None:
        raise ClientError("idle_timeout_ms is not supported by epd's realtime API yet; leave it null",
                          f"{param}.idle_timeout_ms", "unsupported_turn_detection")
    for name in ("create_response", "interrupt_response"):
        if getattr(td, name) is not None:
            setattr(vad, name, getattr(td, name))
    return vad


def check_max_tokens(value, param: str, max_model_len: int) -> int | str:
    """``max_output_tokens``: 1 to ``max_model_len - 1``, or ``"inf"``."""
    if value == "inf":
        return value
    if not 1 <= value < max_model_len:
        raise ClientError(f"max_output_tokens must be 1..{max_model_len - 1} or 'inf', got {value}", param)
    return value


def check_temperature(value: float, param: str) -> float:
    if not 0.0 <= value <= 2.0:
        raise ClientError(f"temperature must be in [0, 2], got {value}", param)
    return value


def check_modalities(value: list[str], param: str) -> None:
    if value != ["text"]:
        raise ClientError(f"output_modalities {value} is not supported: epd answers in text "
                          f"(['text']); TTS-ready phrases come as response.output_text.segment", param,
                          "unsupported_modality")


def input_rate(fmt: _Format, current: int, buffered: bool) -> int:
    """The sample rate of ``session.audio.input.format`` (PCM16 only, ``MIN_RATE`` to
    ``MAX_RATE``); it may change only while the input audio buffer is empty."""
    if fmt.type != "audio/pcm":
        raise ClientError(f"input audio format {fmt.type!r} is not supported; use "
                          f"{{'type': 'audio/pcm', 'rate': {DEFAULT_RATE}}} (PCM16 little-endian mono)",
                          "session.audio.input.format.type", "invalid_audio_format")
    rate = DEFAULT_RATE if fmt.rate is None else fmt.rate
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ClientError(f"input audio rate {rate} Hz is not supported; use {MIN_RATE}..{MAX_RATE} Hz",
                          "session.audio.input.format.rate", "invalid_audio_format")
    if rate != current and buffered:
        raise ClientError("the input audio buffer holds audio at the old rate: commit or clear it "
                          "before changing the rate", "session.audio.input.format.rate")
    return rate


def parse_item(it: ItemIn, param: str, rate: int) -> Item:
    """A client's ``message`` item (``param``: where it stands in the event); its
    ``input_audio`` parts are PCM16 at the session ``rate``."""
    if it.type != "message":
        raise ClientError(f"item type {it.type!r} is not supported; use 'message'", f"{param}.type",
                          "unsupported_item_type")
    allowed = {"user": ("input_text", "input_audio"), "system": ("input_text",),
               "assistant": ("output_text", "text")}
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
        else:
            if c.text is None:
                raise ClientError(f"a {c.type} part needs text", f"{p}.text")
            parts.append(Part("output_text" if it.role == "assistant" else "input_text", text=c.text))
    return Item(it.id or new_id("item"), it.role, parts)
