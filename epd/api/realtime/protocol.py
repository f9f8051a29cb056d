"""``/v1/realtime`` shapes: the client events epd reads (OpenAI's shapes; fields epd
does not use are ignored), the checks of their fields, and the PCM16 checks every
audio input shares. The protocol itself is described in ``epd.api.realtime``."""

from __future__ import annotations

import base64
import binascii
import uuid
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from epd.api.realtime.audio_formats import FORMATS, G711_RATE, PCM, AudioFormat
from epd.api.realtime.vad import ServerVad

DEFAULT_RATE = 24000
#: the output audio rate of ``audio/pcm`` (the tts pool speaks at it)
OUTPUT_RATE = 24000
#: OpenAI's built-in voices (each maps to an eSpeak NG voice, ``epd.tts``); the default first
VOICES = ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar")
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
    type: str = PCM
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
    turn_detection: TurnDetectionIn | bool | None = None  # false, as null: the client commits
    transcription: dict | None = None
    noise_reduction: dict | None = None  # accepted, not acted on


class _AudioOutput(LooseEvent):
    format: _Format | None = None
    voice: str | dict | None = None
    speed: float | None = None


class _Audio(LooseEvent):
    input: _AudioInput | None = None
    output: _AudioOutput | None = None


class SessionIn(LooseEvent):
    type: str | None = None
    instructions: str | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    output_modalities: list[str] | None = None
    audio: _Audio | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
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
    call_id: str | None = None  # function_call / function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call
    output: str | None = None  # function_call_output


class ResponseIn(LooseEvent):
    conversation: str | None = None
    input: list[dict] | None = None
    instructions: str | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    output_modalities: list[str] | None = None
    metadata: dict[str, str] | None = None
    temperature: float | None = None
    audio: _Audio | None = None  # audio.output.voice / format for this response
    tools: list | None = None
    tool_choice: str | dict | None = None


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


class ItemTruncate(LooseEvent):
    item_id: str
    content_index: int = 0
    audio_end_ms: int


class ResponseCreate(LooseEvent):
    response: ResponseIn | None = None


class ResponseCancel(LooseEvent):
    response_id: str | None = None


def pcm16(audio_b64: str, param: str, check_container: bool = True, fmt: AudioFormat | None = None) -> bytes:
    """Base64 audio in ``fmt`` (default PCM16) -> PCM16 little-endian bytes, with the checks
    every audio input shares; G.711 (``audio/pcmu`` / ``audio/pcma``) is expanded to PCM16.
    ``check_container``: reject bytes that start like a WAV/FLAC/OGG/MP3 file (only at
    the start of a clip: further in, those 4 bytes are as likely samples).

    Raises:
        ClientError: over ``MAX_APPEND_BYTES``, not base64, a container file, or an odd
            byte count (PCM16).
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
            raise ClientError(f"audio looks like a {name} file; send raw samples in the session's input format "
                              f"({fmt.type if fmt else PCM}), without a container header", param,
                              "invalid_audio_format")
    if fmt is not None and fmt.type != PCM:
        return fmt.decode(data)
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
        ClientError: a threshold outside (0, 1), or a duration out of range.
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
        if not 5_000 <= td.idle_timeout_ms <= 30_000:
            raise ClientError(f"idle_timeout_ms must be 5000..30000 (or null), got {td.idle_timeout_ms}",
                              f"{param}.idle_timeout_ms")
        vad.idle_timeout_ms = td.idle_timeout_ms
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


def check_modalities(value: list[str], param: str, has_tts: bool) -> tuple[str, ...]:
    """``output_modalities``: ``["text"]``, or ``["audio"]`` (speech from the tts pool, with
    its transcript) when the deployment has one (``--pools ...,t:1``)."""
    if value == ["audio"] or value == ["audio", "text"] or value == ["text", "audio"]:
        if not has_tts:
            raise ClientError("output_modalities ['audio'] needs a text-to-speech pool, and this server has none "
                              "(start it with e.g. --pools e:1,p:1,d:1,t:1); use ['text'], whose TTS-ready "
                              "phrases come as response.output_text.segment", param, "unsupported_modality")
        return ("audio",)
    if value != ["text"]:
        raise ClientError(f"output_modalities {value} is not supported; use ['text'] or ['audio']", param,
                          "unsupported_modality")
    return ("text",)


def check_voice(value: str | dict, param: str) -> str:
    """A voice of ``VOICES`` (a ``{"id": ...}`` object names one too)."""
    name = value.get("id") if isinstance(value, dict) else value
    if name not in VOICES:
        raise ClientError(f"voice {name!r} is not one of epd's voices: {', '.join(VOICES)}", param,
                          "invalid_voice")
    return name


def audio_format(fmt: _Format, param: str, output: bool) -> AudioFormat:
    """``audio.input.format`` / ``audio.output.format``: ``audio/pcm`` (PCM16 little-endian
    mono; input at ``MIN_RATE`` to ``MAX_RATE`` Hz, default 24000; output at ``OUTPUT_RATE``),
    ``audio/pcmu`` or ``audio/pcma`` (G.711 at 8 kHz)."""
    if fmt.type not in FORMATS:
        raise ClientError(f"audio format {fmt.type!r} is not supported; use {{'type': 'audio/pcm', 'rate': "
                          f"{DEFAULT_RATE}}} (PCM16 little-endian mono), or audio/pcmu / audio/pcma (G.711, "
                          f"8 kHz)", f"{param}.type", "invalid_audio_format")
    if fmt.type != PCM:
        if fmt.rate not in (None, G711_RATE):
            raise ClientError(f"{fmt.type} is 8000 Hz, got rate {fmt.rate}", f"{param}.rate", "invalid_audio_format")
        return AudioFormat(fmt.type, G711_RATE)
    if output:
        if fmt.rate not in (None, OUTPUT_RATE):
            raise ClientError(f"output audio/pcm is {OUTPUT_RATE} Hz, got rate {fmt.rate}", f"{param}.rate",
                              "invalid_audio_format")
        return AudioFormat(PCM, OUTPUT_RATE)
    rate = DEFAULT_RATE if fmt.rate is None else fmt.rate
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ClientError(f"input audio rate {rate} Hz is not supported; use {MIN_RATE}..{MAX_RATE} Hz",
                          f"{param}.rate", "invalid_audio_format")
    return AudioFormat(PCM, rate)


def input_format(fmt: _Format, current: AudioFormat, buffered: bool) -> AudioFormat:
    """``session.audio.input.format``; it may change only while the input audio buffer is empty."""
    new = audio_format(fmt, "session.audio.input.format", output=False)
    if new != current and buffered:
        raise ClientError("the input audio buffer holds audio in the old format: commit or clear it "
                          "before changing the format", "session.audio.input.format")
    return new
