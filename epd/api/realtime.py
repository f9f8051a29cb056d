"""Realtime voice API: the documented subset of OpenAI's Realtime API at ``/v1/realtime``.

A WebSocket carries JSON events both ways, shaped as the official ``openai`` SDK's
realtime client (``client.realtime.connect()``, openai >= 2) parses and sends them, so
that client drives epd unchanged with ``base_url="http://HOST:PORT/v1"``. Source:
OpenAI's Realtime API reference (client and server events) and the SDK's types in
``openai/types/realtime``.

Client events handled:

* ``session.update``: ``instructions`` (system prompt), ``max_output_tokens`` (int or
  ``"inf"``; default 256), ``output_modalities`` (only ``["text"]``),
  ``audio.input.format`` (``{"type": "audio/pcm", "rate": R}``: PCM16 little-endian mono,
  R from 8000 to 48000 Hz, default 24000; epd resamples with torchaudio),
  ``audio.input.turn_detection`` (only ``null``: the client commits turns),
  ``audio.input.transcription`` (accepted; text-only models always transcribe), and the
  epd extension ``temperature`` (default 0: greedy). Other OpenAI fields are ignored;
  ``tools`` must be empty.
* ``input_audio_buffer.append`` (base64 PCM16 in the session format; at most
  ``MAX_APPEND_BYTES`` decoded bytes per event and ``MAX_BUFFER_SECONDS`` buffered),
  ``input_audio_buffer.commit`` (at least ``MIN_COMMIT_MS`` of audio),
  ``input_audio_buffer.clear``.
* ``conversation.item.create``: a ``message`` with role ``user`` (``input_text`` /
  ``input_audio`` parts), ``assistant`` (``output_text``) or ``system`` (``input_text``);
  ``previous_item_id`` (``"root"``, an item id, or none: append).
  ``conversation.item.delete``. A session holds at most ``MAX_ITEMS`` items and
  ``MAX_SESSION_BYTES`` of text and audio (a transcribed clip's audio is not kept).
* ``response.create``: ``instructions``, ``max_output_tokens``, ``output_modalities``,
  ``metadata``, ``conversation`` (``"auto"`` or ``"none"``), ``input`` (items or
  ``item_reference``\\ s instead of the conversation), epd extension ``temperature``.
* ``response.cancel`` (optional ``response_id``).

Server events sent: ``session.created``, ``session.updated``,
``input_audio_buffer.committed``, ``input_audio_buffer.cleared``,
``conversation.item.created``, ``conversation.item.deleted``,
``conversation.item.input_audio_transcription.completed`` / ``.failed`` (text-only
models: what the speech front end heard), ``response.created``,
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, ``response.done`` (status
``completed``, ``incomplete`` (max_output_tokens), ``cancelled`` (``client_cancelled``
or ``turn_detected``) or ``failed``; with ``usage``), ``error`` (``error.event_id`` names
the client event at fault). Every malformed, unknown or unsupported event gets an
``error`` event and the session goes on. Frames over uvicorn's 16 MiB message limit
close the socket (code 1009).

epd extension event ``response.output_text.segment`` (``response_id``, ``item_id``,
``output_index``, ``content_index``, ``segment_index``, ``text``, ``reason``): the
response's text cut into TTS-ready phrases (sentence ends, clause marks past a minimum
length, a maximum length, never inside a word; see ``epd.api.segmenter``); the
segments of a response concatenate to exactly its deltas, the last one arriving before
``response.output_text.done``.

Audio: committed speech goes through the E pool: the Whisper tiny.en speech front end
for text-only LMs (the transcript becomes the user's text; transcription starts at
commit), or the encoder tower for audio-native LMs (Qwen2-Audio: embeddings). The
conversation (per session) renders through the model's chat template for every
response, so each turn's prompt extends the last one's and the prefix cache makes
later turns cheap (``usage.input_token_details.cached_tokens``). Conversations past
``max_model_len`` drop their oldest items (OpenAI's ``truncation: "auto"``).

Barge-in: ``response.cancel``, or speech committed while a response streams, stops the
response at once: its router request is closed, which aborts it on every worker (the
decode slot and KV blocks are freed), the rest of its held text goes out as a last
segment (reason ``cancelled``), and ``response.done`` has status ``cancelled``; no delta
of that response follows it. Closing the socket does the same.

No server VAD, audio output, tools, or ``conversation.item.retrieve`` / ``truncate``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import itertools
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, WebSocket
from pydantic import BaseModel, ConfigDict, ValidationError

from epd.api.segmenter import PhraseSegmenter
from epd.api.server import _RequestTimer, _flatten, _template_takes_parts
from epd.detokenizer import IncrementalDetokenizer
from epd.encoders.media import MediaError
from epd.encoders.processor import AUDIO_PLACEHOLDER, MultiModalProcessor
from epd.errors import InvalidRequestError
from epd.messages import WireSamplingParams
from epd.router.router import RequestError, Router, RouterRequest
from epd.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_RATE = 24000
MIN_RATE, MAX_RATE = 8000, 48000
#: decoded PCM bytes in one ``input_audio_buffer.append`` (or one ``input_audio`` part): ~87 s at 24 kHz
MAX_APPEND_BYTES = 4 * 2**20
MAX_BUFFER_SECONDS = 300.0
MIN_COMMIT_MS = 100
MAX_ITEMS = 1000
#: text and PCM a session holds (conversation + input buffer); a transcribed clip's PCM is dropped
MAX_SESSION_BYTES = 64 * 2**20
DEFAULT_MAX_OUTPUT_TOKENS = 256
#: how long a transcription waits for an encode pool that is down (503) to come back
ASR_RETRY_S = 10.0
# Containers whose bytes a client may send by mistake where raw PCM is expected.
_CONTAINER_MAGIC = {b"RIFF": "WAV", b"fLaC": "FLAC", b"OggS": "OGG", b"ID3": "MP3"}
_UNSUPPORTED_EVENTS = {"conversation.item.retrieve", "conversation.item.truncate", "output_audio_buffer.clear",
                       "transcription_session.update"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class ClientError(Exception):
    """A client event was rejected: becomes an ``error`` event (the session goes on)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


# ---- client events (OpenAI's shapes; fields epd does not use are ignored) -----------------------
class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Format(_Loose):
    type: str = "audio/pcm"
    rate: int | None = None


class _AudioInput(_Loose):
    format: _Format | None = None
    turn_detection: dict | None = None
    transcription: dict | None = None


class _Audio(_Loose):
    input: _AudioInput | None = None


class _SessionIn(_Loose):
    type: str | None = None
    instructions: str | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    output_modalities: list[str] | None = None
    audio: _Audio | None = None
    tools: list | None = None
    temperature: float | None = None


class _ContentIn(_Loose):
    type: str
    text: str | None = None
    audio: str | None = None
    transcript: str | None = None


class _ItemIn(_Loose):
    type: str = "message"
    id: str | None = None
    role: str | None = None
    content: list[_ContentIn] = []


class _ResponseIn(_Loose):
    conversation: str | None = None
    input: list[dict] | None = None
    instructions: str | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    output_modalities: list[str] | None = None
    metadata: dict[str, str] | None = None
    temperature: float | None = None


class _SessionUpdate(_Loose):
    session: _SessionIn


class _Append(_Loose):
    audio: str


class _ItemCreate(_Loose):
    item: _ItemIn
    previous_item_id: str | None = None


class _ItemDelete(_Loose):
    item_id: str


class _ResponseCreate(_Loose):
    response: _ResponseIn | None = None


class _ResponseCancel(_Loose):
    response_id: str | None = None


# ---- conversation state ------------------------------------------------------------------------
@dataclass(slots=True)
class _Part:
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
class _Item:
    id: str
    role: str
    parts: list[_Part]
    status: str = "completed"

    def to_json(self) -> dict:
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role,
                "status": self.status, "content": [p.to_json() for p in self.parts]}


@dataclass(slots=True)
class _Response:
    id: str
    items: list[_Item]  # the prompt's items, fixed at response.create
    instructions: str | None
    max_output_tokens: int | str
    temperature: float
    metadata: dict | None
    in_conversation: bool
    status: str = "in_progress"
    status_details: dict | None = None
    item: _Item | None = None
    usage: dict | None = None
    cancel_reason: str | None = None
    task: asyncio.Task | None = None
    text: list[str] = field(default_factory=list)


def _pcm16(audio_b64: str, param: str, check_container: bool = True) -> bytes:
    """Base64 PCM16 -> bytes, with the checks every audio input shares. ``check_container``:
    reject bytes that start like a WAV/FLAC/OGG/MP3 file (only at the start of a clip:
    further in, those 4 bytes are as likely samples)."""
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


class RealtimeSession:
    """One ``/v1/realtime`` WebSocket: session config, conversation, input audio buffer,
    and at most one response in flight.

    Outbound events go through a queue drained by one writer task, so the event
    handlers and the response task never block on the socket and events keep
    their order.
    """

    def __init__(self, ws: WebSocket, api: RealtimeAPI) -> None:
        self.ws, self.api = ws, api
        self.id = _new_id("sess")
        self.conversation_id = _new_id("conv")
        self.instructions: str | None = None
        self.max_output_tokens: int | str = api.default_max_tokens
        self.temperature = 0.0
        self.rate = DEFAULT_RATE
        self.transcription: dict | None = None
        self.items: list[_Item] = []
        self.buffer = bytearray()
        self.active: _Response | None = None
        self.out: asyncio.Queue[str | None] = asyncio.Queue()
        self.asr_tasks: set[asyncio.Task] = set()

    # ---- outbound ----------------------------------------------------------------------
    def emit(self, type_: str, **fields: Any) -> None:
        """Queue server event ``type_`` (a fresh ``event_id`` is added)."""
        self.out.put_nowait(json.dumps({"type": type_, "event_id": _new_id("event"), **fields}))

    def emit_error(self, message: str, *, event_id: str | None = None, param: str | None = None,
                   code: str | None = None, kind: str = "invalid_request_error") -> None:
        """Queue an ``error`` event; ``event_id`` is the client event at fault (None for bad JSON)."""
        self.emit("error", error={"type": kind, "code": code, "message": message, "param": param,
                                  "event_id": event_id})

    async def _write(self) -> None:
        while (data := await self.out.get()) is not None:
            await self.ws.send_text(data)

    def session_json(self) -> dict:
        """The session as ``session.created`` / ``session.updated`` carry it."""
        return {"type": "realtime", "object": "realtime.session", "id": self.id, "model": self.api.model_name,
                "output_modalities": ["text"], "instructions": self.instructions,
                "max_output_tokens": self.max_output_tokens, "temperature": self.temperature,
                "tools": [], "tool_choice": "auto",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": self.rate}, "turn_detection": None,
                                    "transcription": self.transcription, "noise_reduction": None}}}

    # ---- the socket --------------------------------------------------------------------
    async def run(self) -> None:
        """Serve the socket (already accepted) until the client closes it; then cancel
        the response in flight (aborting it on every worker) and pending transcriptions."""
        writer = asyncio.create_task(self._write())
        try:
            self.emit("session.created", session=self.session_json())
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                raw = msg.get("text")
                if raw is None and msg.get("bytes") is not None:
                    raw = msg["bytes"].decode("utf-8", errors="replace")
                await self.handle(raw or "")
        finally:
            if self.active is not None:
                await self.cancel_active("client_cancelled")
            for t in list(self.asr_tasks):
                t.cancel()
            self.out.put_nowait(None)
            try:
                await asyncio.wait_for(writer, 1.0)
            except Exception:  # the client is gone: nothing more can be sent
                writer.cancel()

    async def handle(self, raw: str) -> None:
        """Parse and run one client event; any problem becomes an ``error`` event."""
        event_id = None
        try:
            try:
                ev = json.loads(raw)
            except (json.JSONDecodeError, RecursionError):
                raise ClientError("the event is not valid JSON", code="invalid_json") from None
            if not isinstance(ev, dict):
                raise ClientError("an event must be a JSON object", code="invalid_json")
            event_id = ev.get("event_id") if isinstance(ev.get("event_id"), str) else None
            kind = ev.get("type")
            handler = self.handlers.get(kind) if isinstance(kind, str) else None
            if handler is None:
                if kind in _UNSUPPORTED_EVENTS:
                    raise ClientError(f"{kind} is not supported by epd's realtime API", "type", "unsupported_event")
                raise ClientError(f"unknown event type {kind!r}; supported: {', '.join(sorted(self.handlers))}",
                                  "type", "invalid_event_type")
            model, fn = handler
            try:
                body = model.model_validate(ev)
            except ValidationError as e:
                err = e.errors()[0]
                loc = ".".join(str(x) for x in err.get("loc", ()))
                raise ClientError(f"invalid {kind} event: {err.get('msg')} at {loc or 'event'}", loc or None) from None
            await fn(self, body)
        except ClientError as e:
            self.emit_error(str(e), event_id=event_id, param=e.param, code=e.code)
        except (InvalidRequestError, MediaError) as e:
            self.emit_error(str(e), event_id=event_id, param=getattr(e, "param", None), code="invalid_value")
        except Exception as e:  # a bug handling one event must not end the session
            logger.exception("realtime event failed")
            self.emit_error(f"internal error: {e}", event_id=event_id, kind="server_error", code="internal_error")

    # ---- session ------------------------------------------------------------------------
    def _max_tokens(self, value, param: str) -> int | str:
        if value == "inf":
            return value
        if not 1 <= value < self.api.max_model_len:
            raise ClientError(f"max_output_tokens must be 1..{self.api.max_model_len - 1} or 'inf', got {value}",
                              param)
        return value

    @staticmethod
    def _temperature(value: float, param: str) -> float:
        if not 0.0 <= value <= 2.0:
            raise ClientError(f"temperature must be in [0, 2], got {value}", param)
        return value

    @staticmethod
    def _modalities(value: list[str], param: str) -> None:
        if value != ["text"]:
            raise ClientError(f"output_modalities {value} is not supported: epd answers in text "
                              f"(['text']); TTS-ready phrases come as response.output_text.segment", param,
                              "unsupported_modality")

    async def on_session_update(self, ev: _SessionUpdate) -> None:
        """Validate every field first, then apply them all (or none: an error event)."""
        s, sent = ev.session, ev.session.model_fields_set
        new: dict[str, Any] = {}
        if s.type not in (None, "realtime"):
            raise ClientError(f"session type {s.type!r} is not supported; use 'realtime'", "session.type")
        if "instructions" in sent:
            new["instructions"] = s.instructions
        if s.max_output_tokens is not None:
            new["max_output_tokens"] = self._max_tokens(s.max_output_tokens, "session.max_output_tokens")
        if s.temperature is not None:
            new["temperature"] = self._temperature(s.temperature, "session.temperature")
        if s.output_modalities is not None:
            self._modalities(s.output_modalities, "session.output_modalities")
        if s.tools:
            raise ClientError("tools are not supported by epd's realtime API", "session.tools", "unsupported_tools")
        inp = s.audio.input if s.audio is not None else None
        if inp is not None:
            if inp.format is not None:
                fmt = inp.format
                if fmt.type != "audio/pcm":
                    raise ClientError(f"input audio format {fmt.type!r} is not supported; use "
                                      f"{{'type': 'audio/pcm', 'rate': {DEFAULT_RATE}}} (PCM16 little-endian mono)",
                                      "session.audio.input.format.type", "invalid_audio_format")
                rate = DEFAULT_RATE if fmt.rate is None else fmt.rate
                if not MIN_RATE <= rate <= MAX_RATE:
                    raise ClientError(f"input audio rate {rate} Hz is not supported; use {MIN_RATE}..{MAX_RATE} Hz",
                                      "session.audio.input.format.rate", "invalid_audio_format")
                if rate != self.rate and self.buffer:
                    raise ClientError("the input audio buffer holds audio at the old rate: commit or clear it "
                                      "before changing the rate", "session.audio.input.format.rate")
                new["rate"] = rate
            if inp.turn_detection is not None:
                raise ClientError("server-side turn detection is not supported: set turn_detection to null and "
                                  "send input_audio_buffer.commit", "session.audio.input.turn_detection",
                                  "unsupported_turn_detection")
            if "transcription" in inp.model_fields_set:
                new["transcription"] = inp.transcription
        for k, v in new.items():
            setattr(self, k, v)
        self.emit("session.updated", session=self.session_json())

    # ---- input audio buffer -------------------------------------------------------------------
    async def on_append(self, ev: _Append) -> None:
        data = _pcm16(ev.audio, "audio", check_container=not self.buffer)
        if (len(self.buffer) + len(data)) / 2 / self.rate > MAX_BUFFER_SECONDS:
            raise ClientError(f"the input audio buffer would exceed {MAX_BUFFER_SECONDS:g} s; commit or clear it",
                              "audio", "input_audio_buffer_full")
        self._check_room(len(data))
        self.buffer += data

    async def on_commit(self, ev: _Loose) -> None:
        """Buffer -> a user item (int16 PCM kept at the session rate); barge-in if a
        response streams; transcription starts at once for text-only models."""
        ms = len(self.buffer) / 2 / self.rate * 1000
        if ms < MIN_COMMIT_MS:
            raise ClientError(f"the input audio buffer holds {ms:.0f} ms of audio; at least {MIN_COMMIT_MS} ms is "
                              f"needed to commit", None, "input_audio_buffer_commit_empty")
        if self.active is not None:  # barge-in: the user spoke over the answer
            await self.cancel_active("turn_detected")
        data = bytes(self.buffer)
        self.buffer.clear()  # its bytes move into the item
        item = _Item(_new_id("item"), "user", [_Part("input_audio", pcm=np.frombuffer(data, dtype="<i2").astype(
            np.int16), rate=self.rate)])
        try:
            prev = self._insert(item, None)
        except ClientError:
            self.buffer += data  # not committed: the audio stays in the buffer
            raise
        self.emit("input_audio_buffer.committed", item_id=item.id, previous_item_id=prev)
        self.emit("conversation.item.created", item=item.to_json(), previous_item_id=prev)
        self._start_asr(item)

    async def on_clear(self, ev: _Loose) -> None:
        self.buffer.clear()
        self.emit("input_audio_buffer.cleared")

    # ---- conversation ------------------------------------------------------------------------
    @staticmethod
    def _item_bytes(item: _Item) -> int:
        return sum(len(p.text or "") + (p.pcm.nbytes if p.pcm is not None else 0) for p in item.parts)

    def _check_room(self, more: int) -> None:
        held = sum(self._item_bytes(it) for it in self.items) + len(self.buffer)
        if held + more > MAX_SESSION_BYTES:
            raise ClientError(f"the session would hold {held + more} bytes of text and audio, over its "
                              f"{MAX_SESSION_BYTES}-byte limit; delete items first", None, "session_full")

    def _insert(self, item: _Item, previous_item_id: str | None) -> str | None:
        if len(self.items) >= MAX_ITEMS:
            raise ClientError(f"the conversation has {MAX_ITEMS} items, the limit; delete some first", None,
                              "conversation_full")
        self._check_room(self._item_bytes(item))
        if any(it.id == item.id for it in self.items):
            raise ClientError(f"an item with id {item.id!r} already exists", "item.id", "item_already_exists")
        if previous_item_id is None:
            pos = len(self.items)
        elif previous_item_id == "root":
            pos = 0
        else:
            pos = next((i + 1 for i, it in enumerate(self.items) if it.id == previous_item_id), None)
            if pos is None:
                raise ClientError(f"previous_item_id {previous_item_id!r} is not in the conversation",
                                  "previous_item_id", "item_not_found")
        self.items.insert(pos, item)
        return self.items[pos - 1].id if pos > 0 else None

    def _parse_item(self, it: _ItemIn, param: str) -> _Item:
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
                data = _pcm16(c.audio, f"{p}.audio")
                if len(data) / 2 / self.rate * 1000 < MIN_COMMIT_MS:
                    raise ClientError(f"input_audio needs at least {MIN_COMMIT_MS} ms of audio", f"{p}.audio")
                parts.append(_Part("input_audio", pcm=np.frombuffer(data, dtype="<i2").astype(np.int16),
                                   rate=self.rate))
            else:
                if c.text is None:
                    raise ClientError(f"a {c.type} part needs text", f"{p}.text")
                parts.append(_Part("output_text" if it.role == "assistant" else "input_text", text=c.text))
        return _Item(it.id or _new_id("item"), it.role, parts)

    async def on_item_create(self, ev: _ItemCreate) -> None:
        item = self._parse_item(ev.item, "item")
        prev = self._insert(item, ev.previous_item_id)
        self.emit("conversation.item.created", item=item.to_json(), previous_item_id=prev)
        self._start_asr(item)

    async def on_item_delete(self, ev: _ItemDelete) -> None:
        for i, it in enumerate(self.items):
            if it.id == ev.item_id:
                if self.active is not None and self.active.item is it:
                    raise ClientError("the item is being generated; cancel the response first", "item_id")
                del self.items[i]
                self.emit("conversation.item.deleted", item_id=it.id)
                return
        raise ClientError(f"item {ev.item_id!r} is not in the conversation", "item_id", "item_not_found")

    def _start_asr(self, item: _Item) -> None:
        """Text-only models: transcribe each audio part in the E pool, starting now."""
        if self.api.processor.modalities.get("audio") != "transcribe":
            return
        for idx, part in enumerate(item.parts):
            if part.type == "input_audio":
                self._asr_task(item, idx, part)

    def _asr_task(self, item: _Item, idx: int, part: _Part) -> None:
        part.asr = asyncio.create_task(self._transcribe(item, idx, part))
        self.asr_tasks.add(part.asr)
        part.asr.add_done_callback(self._asr_done)

    def _retry_failed_asr(self, items: list[_Item]) -> None:
        """A clip whose transcription failed (a pool down, a timeout) is tried again by the next response."""
        for item in items:
            for idx, part in enumerate(item.parts):
                if part.asr is not None and part.asr.done() and (part.asr.cancelled() or part.asr.exception()):
                    self._asr_task(item, idx, part)

    def _asr_done(self, task: asyncio.Task) -> None:
        self.asr_tasks.discard(task)
        if not task.cancelled():
            task.exception()  # reported as a transcription.failed event; a response awaiting it fails

    async def _transcribe(self, item: _Item, idx: int, part: _Part) -> str:
        """The clip's transcript from the E pool. A pool that is down (503: e.g. its
        worker missed heartbeats on a busy machine) is retried for ``ASR_RETRY_S``."""
        try:
            media = self.api.processor.audio_item((part.pcm, part.rate))
            deadline = asyncio.get_running_loop().time() + ASR_RETRY_S
            for attempt in itertools.count():
                try:
                    (text,) = await self.api.router.transcribe(f"{item.id}-asr{idx}.{attempt}", [media])
                    break
                except RequestError as e:
                    if e.status != 503 or asyncio.get_running_loop().time() > deadline:
                        raise
                    await asyncio.sleep(0.25)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.emit("conversation.item.input_audio_transcription.failed", item_id=item.id, content_index=idx,
                      error={"type": "transcription_error", "code": None, "message": str(e), "param": None})
            raise
        part.transcript = text.strip()
        part.pcm = None  # the transcript is what the model hears from now on
        self.emit("conversation.item.input_audio_transcription.completed", item_id=item.id, content_index=idx,
                  transcript=part.transcript)
        return part.transcript

    # ---- responses ----------------------------------------------------------------------------
    async def on_response_create(self, ev: _ResponseCreate) -> None:
        """Fix the prompt's items now, answer ``response.created``, run the response task."""
        if self.active is not None:
            raise ClientError(f"response {self.active.id} is still in progress; cancel it or wait for its "
                              f"response.done", None, "conversation_already_has_active_response")
        r = ev.response or _ResponseIn()
        if r.conversation not in (None, "auto", "none"):
            raise ClientError("response.conversation must be 'auto' or 'none'", "response.conversation")
        if r.output_modalities is not None:
            self._modalities(r.output_modalities, "response.output_modalities")
        max_tokens = (self.max_output_tokens if r.max_output_tokens is None
                      else self._max_tokens(r.max_output_tokens, "response.max_output_tokens"))
        temperature = (self.temperature if r.temperature is None
                       else self._temperature(r.temperature, "response.temperature"))
        if r.input is not None:
            items = []
            for i, raw in enumerate(r.input):
                if raw.get("type") == "item_reference":
                    ref = next((it for it in self.items if it.id == raw.get("id")), None)
                    if ref is None:
                        raise ClientError(f"item_reference {raw.get('id')!r} is not in the conversation",
                                          f"response.input.{i}.id", "item_not_found")
                    items.append(ref)
                else:
                    try:
                        parsed = _ItemIn.model_validate(raw)
                    except ValidationError as e:
                        raise ClientError(f"invalid response.input.{i}: {e.errors()[0].get('msg')}",
                                          f"response.input.{i}") from None
                    item = self._parse_item(parsed, f"response.input.{i}")
                    self._start_asr(item)
                    items.append(item)
        else:
            items = list(self.items)
        if not items:
            raise ClientError("nothing to respond to: the conversation is empty (add an item or commit audio "
                              "first)", "response.input" if r.input is not None else None, "conversation_empty")
        self._retry_failed_asr(items)
        instructions = r.instructions if "instructions" in r.model_fields_set else self.instructions
        resp = _Response(_new_id("resp"), items, instructions, max_tokens, temperature, r.metadata,
                         r.conversation != "none")
        self.active = resp
        self.emit("response.created", response=self._response_json(resp))
        resp.task = asyncio.create_task(self._respond(resp))

    async def on_response_cancel(self, ev: _ResponseCancel) -> None:
        if self.active is None:
            raise ClientError("there is no response in progress to cancel", None, "response_cancel_not_active")
        if ev.response_id is not None and ev.response_id != self.active.id:
            raise ClientError(f"response {ev.response_id!r} is not in progress (the active one is "
                              f"{self.active.id})", "response_id", "response_cancel_not_active")
        await self.cancel_active("client_cancelled")

    async def cancel_active(self, reason: str) -> None:
        """Stop the response in flight and wait until its ``response.done`` is queued."""
        resp = self.active
        if resp is None or resp.task is None:
            return
        resp.cancel_reason = reason
        resp.task.cancel()
        await asyncio.wait([resp.task])

    def _response_json(self, resp: _Response) -> dict:
        return {"id": resp.id, "object": "realtime.response", "status": resp.status,
                "status_details": resp.status_details, "output": [resp.item.to_json()] if resp.item else [],
                "conversation_id": self.conversation_id if resp.in_conversation else None,
                "output_modalities": ["text"], "max_output_tokens": resp.max_output_tokens,
                "metadata": resp.metadata, "usage": resp.usage, "audio": None}

    async def _respond(self, resp: _Response) -> None:
        """The response task: prompt -> router -> deltas and segments -> done.
        Cancellation (barge-in) lands here and ends as status ``cancelled``."""
        api = self.api
        timer = _RequestTimer(api.metrics)
        segmenter = PhraseSegmenter()
        n_segments = 0
        ids = {"response_id": resp.id}

        def segment(seg) -> None:
            nonlocal n_segments
            self.emit("response.output_text.segment", **ids, output_index=0, content_index=0,
                      segment_index=n_segments, text=seg.text, reason=seg.reason)
            n_segments += 1

        try:
            try:
                req, audio_tokens = await api.build_request(resp)
                detok = IncrementalDetokenizer(api.tokenizer, req.prompt_token_ids)
                resp.usage = {"total_tokens": len(req.prompt_token_ids), "input_tokens": len(req.prompt_token_ids),
                              "output_tokens": 0,
                              "input_token_details": {"cached_tokens": 0, "audio_tokens": audio_tokens,
                                                      "text_tokens": len(req.prompt_token_ids) - audio_tokens,
                                                      "image_tokens": 0},
                              "output_token_details": {"text_tokens": 0, "audio_tokens": 0}}
                resp.item = _Item(_new_id("item"), "assistant", [_Part("output_text", text="")], "in_progress")
                ids["item_id"] = resp.item.id
                if resp.in_conversation:
                    prev = self._insert(resp.item, None)
                    self.emit("conversation.item.created", item=resp.item.to_json(), previous_item_id=prev)
                self.emit("response.output_item.added", response_id=resp.id, output_index=0,
                          item=resp.item.to_json())
                self.emit("response.content_part.added", **ids, output_index=0, content_index=0,
                          part={"type": "text", "text": ""})
                gen = api.router.generate(req)
                reason = None
                try:
                    async for ev in gen:
                        timer.on_tokens(len(ev.token_ids))
                        resp.usage["output_tokens"] += len(ev.token_ids)
                        resp.usage["input_token_details"]["cached_tokens"] = min(ev.num_cached_tokens,
                                                                                 len(req.prompt_token_ids))
                        done = ev.finished
                        detok.update(ev.token_ids)
                        delta = detok.get_next_output_text(done, delta=True)
                        if delta:
                            resp.text.append(delta)
                            resp.item.parts[0].text = "".join(resp.text)
                            self.emit("response.output_text.delta", **ids, output_index=0, content_index=0,
                                      delta=delta)
                            for seg in segmenter.feed(delta):
                                segment(seg)
                        if done:
                            reason = ev.finish_reason
                            break
                finally:
                    await gen.aclose()
                timer.finished = True
                if reason == "length":
                    resp.status, resp.status_details = "incomplete", {"type": "incomplete",
                                                                      "reason": "max_output_tokens"}
                else:
                    resp.status, resp.status_details = "completed", {"type": "completed"}
            except asyncio.CancelledError:
                resp.status = "cancelled"
                resp.status_details = {"type": "cancelled", "reason": resp.cancel_reason or "client_cancelled"}
            except (ClientError, InvalidRequestError, MediaError, RequestError) as e:
                timer.finished = True
                code = getattr(e, "code", None) or ("invalid_request" if isinstance(e, (InvalidRequestError,
                                                                                           MediaError))
                                                    else "server_error")
                resp.status = "failed"
                resp.status_details = {"type": "failed", "error": {"type": "invalid_request_error" if code !=
                                                                   "server_error" else "server_error",
                                                                   "code": code, "message": str(e)}}
            finally:
                timer.close()
            if resp.item is not None:
                last = segmenter.flush("cancelled" if resp.status == "cancelled" else "end")
                if last is not None:
                    segment(last)
                text = "".join(resp.text)
                resp.item.status = "completed" if resp.status == "completed" else "incomplete"
                self.emit("response.output_text.done", **ids, output_index=0, content_index=0, text=text)
                self.emit("response.content_part.done", **ids, output_index=0, content_index=0,
                          part={"type": "text", "text": text})
                self.emit("response.output_item.done", response_id=resp.id, output_index=0,
                          item=resp.item.to_json())
            if resp.usage is not None:
                resp.usage["total_tokens"] = resp.usage["input_tokens"] + resp.usage["output_tokens"]
                resp.usage["output_token_details"]["text_tokens"] = resp.usage["output_tokens"]
            self.emit("response.done", response=self._response_json(resp))
        finally:
            if self.active is resp:
                self.active = None

    handlers: dict[str, tuple[type[BaseModel], Any]] = {
        "session.update": (_SessionUpdate, on_session_update),
        "input_audio_buffer.append": (_Append, on_append),
        "input_audio_buffer.commit": (_Loose, on_commit),
        "input_audio_buffer.clear": (_Loose, on_clear),
        "conversation.item.create": (_ItemCreate, on_item_create),
        "conversation.item.delete": (_ItemDelete, on_item_delete),
        "response.create": (_ResponseCreate, on_response_create),
        "response.cancel": (_ResponseCancel, on_response_cancel),
    }


class RealtimeAPI:
    """What every realtime session shares: the router, tokenizer, processor, limits.

    Args:
        max_model_len: context length; conversations past it drop their oldest items.
        default_max_tokens: ``max_output_tokens`` of a new session.
        api_key: when set, the WebSocket handshake needs ``Authorization: Bearer <key>``.
        metrics: ``epd.metrics.Metrics`` for TTFT / ITL / cancelled counts (or None).
    """

    def __init__(self, router: Router, tokenizer, processor: MultiModalProcessor, *, model_name: str,
                 max_model_len: int, default_max_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS,
                 api_key: str | None = None, metrics=None) -> None:
        self.router, self.tokenizer, self.processor = router, tokenizer, processor
        self.model_name, self.max_model_len = model_name, max_model_len
        self.default_max_tokens = min(default_max_tokens, max_model_len - 1)
        self.api_key, self.metrics = api_key, metrics
        self.embed_audio = processor.modalities.get("audio") == "embed"
        self.audio_tok = (tokenizer.convert_ids_to_tokens(processor.placeholder_ids["audio"])
                          if self.embed_audio else AUDIO_PLACEHOLDER)
        self.structured = _template_takes_parts(tokenizer, None, self.audio_tok if self.embed_audio else None)

    async def _messages(self, items: list[_Item], instructions: str | None) -> tuple[list[dict], list]:
        """Chat messages of ``items`` (transcripts awaited) and their audio clips, in order."""
        msgs: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
        audios = []
        for it in items:
            parts = []
            for p in it.parts:
                if p.type != "input_audio":
                    parts.append({"type": "text", "text": p.text or ""})
                elif self.embed_audio:
                    audios.append((p.pcm, p.rate))
                    parts.append({"type": "audio"})
                else:
                    text = await asyncio.shield(p.asr) if p.asr is not None else (p.transcript or "")
                    parts.append({"type": "text", "text": text})
            if it.role == "assistant" and not any(p.get("text") for p in parts):
                continue  # an answer cancelled before its first word
            msgs.append({"role": it.role, "content": _flatten(parts, None, self.audio_tok, self.structured)})
        return msgs, audios

    async def build_request(self, resp: _Response) -> tuple[RouterRequest, int]:
        """The router request of a response and its number of audio placeholder tokens.

        Drops the oldest items while the prompt plus ``max_output_tokens`` (at least
        one token) does not fit ``max_model_len``.

        Raises:
            ClientError: nothing to answer, or the newest item alone is too long.
            InvalidRequestError / MediaError: from the processor.
        """
        items = list(resp.items)
        while True:
            msgs, audios = await self._messages(items, resp.instructions)
            try:
                text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # jinja raises for conversations the template rejects
                raise ClientError(f"the model's chat template rejected the conversation: {e}") from None
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            processed = self.processor.process(ids, {"audio": audios} if audios else None)
            n = len(processed.prompt_token_ids)
            want = 1 if resp.max_output_tokens == "inf" else resp.max_output_tokens
            if n + want <= self.max_model_len:
                break
            if len(items) == 1:
                raise ClientError(f"the newest item alone makes a {n}-token prompt; with max_output_tokens "
                                  f"{resp.max_output_tokens} it does not fit max_model_len {self.max_model_len}",
                                  None, "context_length_exceeded")
            items.pop(0)
        max_tokens = self.max_model_len - n if resp.max_output_tokens == "inf" else resp.max_output_tokens
        sp = SamplingParams(temperature=resp.temperature, max_tokens=max_tokens)
        req = RouterRequest(f"{resp.id}-{uuid.uuid4().hex[:6]}", processed.prompt_token_ids,
                            WireSamplingParams.from_params(sp), processed.items, processed.placeholders)
        audio_tokens = sum(p.length for p, it in zip(processed.placeholders, processed.items)
                           if it.modality == "audio")
        return req, audio_tokens

    async def serve(self, ws: WebSocket) -> None:
        """Run one session until the client closes the socket."""
        if self.api_key:
            auth = ws.headers.get("authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode()):
                await ws.close(code=1008, reason="missing or incorrect API key")
                return
        await ws.accept()
        model = ws.query_params.get("model")
        if model not in (None, "", self.model_name):
            await ws.send_text(json.dumps({"type": "error", "event_id": _new_id("event"), "error": {
                "type": "invalid_request_error", "code": "model_not_found", "param": "model", "event_id": None,
                "message": f"the model {model!r} does not exist; this server serves {self.model_name!r}"}}))
            await ws.close(code=1008)
            return
        await RealtimeSession(ws, self).run()


def mount_realtime(app: FastAPI, router: Router, tokenizer, processor: MultiModalProcessor, *, model_name: str,
                   max_model_len: int, default_max_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS,
                   api_key: str | None = None, metrics=None) -> RealtimeAPI:
    """Add the ``/v1/realtime`` WebSocket to ``app`` (arguments: see ``RealtimeAPI``)."""
    api = RealtimeAPI(router, tokenizer, processor, model_name=model_name, max_model_len=max_model_len,
                      default_max_tokens=default_max_tokens, api_key=api_key, metrics=metrics)
    app.add_api_websocket_route("/v1/realtime", api.serve)
    return api
