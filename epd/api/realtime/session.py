"""One ``/v1/realtime`` session (``RealtimeSession``): its settings, conversation, input
audio buffer with server VAD, and the response in flight, driven by the client's events.
The protocol is described in ``epd.api.realtime``; the limits a session enforces are
this module's constants."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import WebSocket
from pydantic import BaseModel, ValidationError

from epd.api.cpu_pool import shared_pool
from epd.api.protocol import invalid_field
from epd.api.realtime.audio_formats import PCM, AudioFormat
from epd.api.realtime.connection import IDLE, EventChannel
from epd.api.realtime.conversation import Item, Part, ResponseState, parse_item, truncated_transcript
from epd.api.realtime.protocol import (
    DEFAULT_RATE,
    MIN_COMMIT_MS,
    OUTPUT_RATE,
    VOICES,
    AudioAppend,
    ClientError,
    ItemCreate,
    ItemDelete,
    ItemIn,
    ItemRetrieve,
    ItemTruncate,
    LooseEvent,
    ResponseCancel,
    ResponseCreate,
    ResponseIn,
    SessionUpdate,
    TurnDetectionIn,
    audio_format,
    check_max_tokens,
    check_modalities,
    check_temperature,
    check_turn_detection,
    check_voice,
    input_format,
    new_id,
    pcm16,
    pcm_array,
)
from epd.api.realtime.responses import ResponseStream
from epd.api.realtime.tools import NO_TOOLS, SessionTools, check_tools
from epd.api.realtime.transcribe import Transcriber
from epd.api.realtime.vad import VAD_RATE, ServerVad, SpeechDetector
from epd.encoders.media_limits import MediaError
from epd.errors import InvalidRequestError

if TYPE_CHECKING:
    from epd.api.realtime.server import RealtimeAPI

__all__ = ["DEFAULT_MAX_OUTPUT_TOKENS", "MAX_BUFFER_SECONDS", "MAX_ITEMS", "MAX_OUTBOUND_BYTES", "MAX_SESSION_BYTES",
           "RealtimeSession"]

logger = logging.getLogger(__name__)

MAX_BUFFER_SECONDS = 300.0
MAX_ITEMS = 1000
#: text and PCM a session holds (conversation + input buffer); a transcribed clip's PCM is dropped
MAX_SESSION_BYTES = 64 * 2**20
#: server events waiting for a client that does not read them; past it the socket is closed (1008)
MAX_OUTBOUND_BYTES = 16 * 2**20
DEFAULT_MAX_OUTPUT_TOKENS = 256
_UNSUPPORTED_EVENTS = {"transcription_session.update"}


class RealtimeSession:
    """One ``/v1/realtime`` WebSocket: session config, conversation, input audio buffer,
    and at most one response in flight.

    Outbound events go through a bounded queue drained by one writer task
    (``epd.api.realtime.connection.EventChannel``), so the event handlers and the response
    task never block on the socket and events keep their order.
    """

    def __init__(self, ws: WebSocket, api: RealtimeAPI) -> None:
        self.ws, self.api = ws, api
        self.id = new_id("sess")
        self.conversation_id = new_id("conv")
        self.instructions: str | None = None
        self.max_output_tokens: int | str = api.default_max_tokens
        self.temperature = 0.0
        self.input_format = AudioFormat(PCM, DEFAULT_RATE)
        self.output_format = AudioFormat(PCM, OUTPUT_RATE)
        self.voice = VOICES[0]
        self.has_tts = api.router.has_pool("tts")
        self.modalities: tuple[str, ...] = ("audio",) if self.has_tts else ("text",)  # OpenAI's default: audio
        self.transcription: dict | None = None
        self.noise_reduction: dict | None = None
        self.turn_detection: ServerVad | None = ServerVad()  # OpenAI's default; null: the client commits
        self.tools: SessionTools = NO_TOOLS
        self.vad: SpeechDetector | None = None  # built on the first audio while turn_detection is on
        self.turn_item_id: str | None = None  # the item a detected turn commits to
        self.items: list[Item] = []
        self.buffer = bytearray()
        self.input_ms = 0.0  # input audio appended since the session began
        self.idle_from_ms: float | None = None  # input time the idle timeout counts from (after a response)
        self.cpu = shared_pool()
        self.active: ResponseState | None = None
        self.channel = EventChannel(ws, MAX_OUTBOUND_BYTES, api.idle_timeout_s,
                                    busy=lambda: self.active is not None or bool(self.asr.jobs))
        self.asr = Transcriber(api, self.emit, on_end=self.channel.touch)

    @property
    def out(self) -> asyncio.Queue:
        """The outbound events not sent yet (JSON texts)."""
        return self.channel.out

    # ---- outbound ----------------------------------------------------------------------
    def emit(self, type_: str, **fields: Any) -> None:
        """Queue server event ``type_`` (a fresh ``event_id`` is added); dropped once the
        session is closing for a client that does not read."""
        self.channel.send(json.dumps({"type": type_, "event_id": new_id("event"), **fields}))

    def emit_error(self, message: str, *, event_id: str | None = None, param: str | None = None,
                   code: str | None = None, kind: str = "invalid_request_error") -> None:
        """Queue an ``error`` event; ``event_id`` is the client event at fault (None for bad JSON)."""
        self.emit("error", error={"type": kind, "code": code, "message": message, "param": param,
                                  "event_id": event_id})

    @property
    def rate(self) -> int:
        """The sample rate of the input audio buffer (PCM16 at the input format's rate)."""
        return self.input_format.rate

    def session_json(self) -> dict:
        """The session as ``session.created`` / ``session.updated`` carry it."""
        return {"type": "realtime", "object": "realtime.session", "id": self.id, "model": self.api.model_name,
                "output_modalities": list(self.modalities), "instructions": self.instructions,
                "max_output_tokens": self.max_output_tokens, "temperature": self.temperature,
                "tools": self.tools.tools, "tool_choice": self.tools.choice,
                "audio": {"input": {"format": self.input_format.to_json(),
                                    "turn_detection": self.turn_detection.to_json() if self.turn_detection else None,
                                    "transcription": self.transcription, "noise_reduction": self.noise_reduction},
                          "output": {"format": self.output_format.to_json(), "voice": self.voice, "speed": 1.0}}}

    def emit_item_added(self, item: Item, previous_item_id: str | None) -> None:
        """``conversation.item.added`` (GA), ``conversation.item.created`` (the beta name some
        clients still read), and ``conversation.item.done`` once the item is complete."""
        js = item.to_json()
        kinds = ("added", "created", "done") if item.status == "completed" else ("added", "created")
        for kind in kinds:
            self.emit(f"conversation.item.{kind}", item=js, previous_item_id=previous_item_id)

    # ---- the socket --------------------------------------------------------------------
    async def run(self) -> None:
        """Serve the socket (already accepted) until the client closes it, stops reading
        (closed with code 1008), or sends no event for ``api.idle_timeout_s`` while no
        response or transcription runs (an ``error`` event, code ``session_idle_timeout``,
        then close code 1000); then cancel the response in flight (aborting it on every
        worker) and pending transcriptions."""
        writer = asyncio.create_task(self.channel.write())
        close_code, reason = None, ""
        try:
            self.emit("session.created", session=self.session_json())
            while (msg := await self.channel.receive()) is not None and msg["type"] != "websocket.disconnect":
                if msg is IDLE:
                    close_code, reason = 1000, f"idle for {self.channel.idle_timeout_s:g} s"
                    self.emit_error(f"no client event for {self.channel.idle_timeout_s:g} s; the session is closed",
                                    code="session_idle_timeout")
                    break
                raw = msg.get("text")
                if raw is None and msg.get("bytes") is not None:
                    raw = msg["bytes"].decode("utf-8", errors="replace")
                await self.handle(raw or "")
        finally:
            if self.active is not None:
                await self.cancel_active("client_cancelled")
            self.asr.cancel_all()
            if self.channel.closing:  # what the session holds goes now, not when the socket is gone
                self.items.clear()
                self.buffer.clear()
            await self.channel.finish(writer, close_code, reason)

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
                msg, path = invalid_field(e.errors())
                loc = ".".join(path)
                raise ClientError(f"invalid {kind} event: {msg} at {loc or 'event'}", loc or None) from None
            await fn(self, body)
        except ClientError as e:
            self.emit_error(str(e), event_id=event_id, param=e.param, code=e.code, kind=e.kind)
        except (InvalidRequestError, MediaError) as e:
            self.emit_error(str(e), event_id=event_id, param=getattr(e, "param", None), code="invalid_value")
        except Exception as e:  # a bug handling one event must not end the session
            logger.exception("realtime event failed")
            self.emit_error(f"internal error: {e}", event_id=event_id, kind="server_error", code="internal_error")

    # ---- session ------------------------------------------------------------------------
    async def on_session_update(self, ev: SessionUpdate) -> None:
        """Validate every field first, then apply them all (or none: an error event)."""
        s, sent = ev.session, ev.session.model_fields_set
        new: dict[str, Any] = {}
        if s.type not in (None, "realtime"):
            raise ClientError(f"session type {s.type!r} is not supported; use 'realtime'", "session.type")
        if "instructions" in sent:
            new["instructions"] = s.instructions
        if s.max_output_tokens is not None:
            new["max_output_tokens"] = check_max_tokens(s.max_output_tokens, "session.max_output_tokens",
                                                         self.api.max_model_len)
        if s.temperature is not None:
            new["temperature"] = check_temperature(s.temperature, "session.temperature")
        if s.output_modalities is not None:
            new["modalities"] = check_modalities(s.output_modalities, "session.output_modalities", self.has_tts)
        if "tools" in sent or "tool_choice" in sent:
            new["tools"] = await self._tools(s.tools if "tools" in sent else self.tools.tools,
                                             s.tool_choice if "tool_choice" in sent else self.tools.choice, "session")
        inp = s.audio.input if s.audio is not None else None
        out = s.audio.output if s.audio is not None else None
        if out is not None:
            if out.format is not None:
                new["output_format"] = audio_format(out.format, "session.audio.output.format", output=True)
            if out.voice is not None:
                new["voice"] = check_voice(out.voice, "session.audio.output.voice")
        if inp is not None:
            if inp.format is not None:
                new["input_format"] = input_format(inp.format, self.input_format, bool(self.buffer))
            if "turn_detection" in inp.model_fields_set:
                td = inp.turn_detection
                if td is True:
                    td = TurnDetectionIn()
                new["turn_detection"] = (None if td is None or td is False else
                                         check_turn_detection(td, "session.audio.input.turn_detection"))
            if "transcription" in inp.model_fields_set:
                new["transcription"] = inp.transcription
            if "noise_reduction" in inp.model_fields_set:
                new["noise_reduction"] = inp.noise_reduction  # accepted; epd does not filter input audio
        if "turn_detection" in new or "input_format" in new:
            self.vad, self.turn_item_id = None, None  # a turn in progress is forgotten; its audio stays buffered
            self.asr.drop_early()
        for k, v in new.items():
            setattr(self, k, v)
        self.emit("session.updated", session=self.session_json())

    # ---- input audio buffer -------------------------------------------------------------------
    async def on_append(self, ev: AudioAppend) -> None:
        data = pcm16(ev.audio, "audio", check_container=not self.buffer, fmt=self.input_format)
        if (len(self.buffer) + len(data)) / 2 / self.rate > MAX_BUFFER_SECONDS:
            raise ClientError(f"the input audio buffer would exceed {MAX_BUFFER_SECONDS:g} s; commit or clear it",
                              "audio", "input_audio_buffer_full")
        self._check_room(len(data))
        self.buffer += data
        self.input_ms += len(data) / 2 / self.rate * 1000
        if self.turn_detection is None:
            return
        for edge, ms in await self.cpu.run(self._detect, data):
            if edge == "speech_started":
                await self._speech_started(ms)
            elif edge == "speech_paused":
                self._speech_paused(ms)
            else:
                await self._speech_stopped(ms)
        if self.vad is not None and not self.vad.in_speech:  # between turns only the padding is kept
            self._trim_buffer(self.input_ms - self.turn_detection.prefix_padding_ms)
            await self._check_idle()

    def response_finished(self, resp: ResponseState, started_ms: float, audio_ms: float) -> None:
        """(From the response task.) The idle timeout counts from when the answer's audio
        ends playing: ``audio_ms`` of it from ``started_ms`` (input time at the response's
        start, a client playing as it receives), or from now if that is later."""
        self.idle_from_ms = max(self.input_ms, started_ms + audio_ms)

    async def _check_idle(self) -> None:
        """``idle_timeout_ms`` of input audio without speech after a response: send
        ``input_audio_buffer.timeout_triggered``, commit what the buffer holds (the prefix
        padding: silence) and answer it, as OpenAI's server VAD does, so the assistant can
        prompt a silent user. Measured on the input audio's clock (the audio appended),
        not the wall clock."""
        td = self.turn_detection
        if (td is None or td.idle_timeout_ms is None or self.idle_from_ms is None or self.active is not None
                or self.input_ms - self.idle_from_ms < td.idle_timeout_ms):
            return
        start_ms, self.idle_from_ms = self.idle_from_ms, None
        item_id = new_id("item")
        self.emit("input_audio_buffer.timeout_triggered", audio_start_ms=int(start_ms),
                  audio_end_ms=int(self.input_ms), item_id=item_id)
        try:
            if len(self.buffer) / 2 / self.rate * 1000 >= MIN_COMMIT_MS:
                await self._commit(item_id)
            if td.create_response:
                await self.on_response_create(ResponseCreate())
        except ClientError as e:
            self.emit_error(str(e), param=e.param, code=e.code, kind=e.kind)

    # ---- server VAD ----------------------------------------------------------------------------
    def _detect(self, data: bytes) -> list[tuple[str, int]]:
        """(In the CPU pool.) The turn edges of the next input audio (PCM16 at the session rate)."""
        import torch
        import torchaudio.functional as F

        if self.vad is None:  # its clock starts where this audio starts on the session's
            start_ms = round(self.input_ms - len(data) / 2 / self.rate * 1000)
            self.vad = SpeechDetector(self.turn_detection, start_ms=start_ms)
        x = torch.from_numpy(pcm_array(data).astype(np.float32) / 32768.0)
        if self.rate != VAD_RATE:
            x = F.resample(x, self.rate, VAD_RATE)
        return self.vad.feed(x.numpy())

    def _trim_buffer(self, from_ms: float) -> None:
        """Drop the buffered input audio before ``from_ms`` (session input time)."""
        start_ms = self.input_ms - len(self.buffer) / 2 / self.rate * 1000
        drop = int((from_ms - start_ms) * self.rate / 1000) * 2
        if drop > 0:
            del self.buffer[:drop]

    async def _speech_started(self, audio_start_ms: int) -> None:
        """A turn begins: the buffer keeps its prefix padding on; speech over an answer
        cancels it (``interrupt_response``), freeing its decode slot."""
        self.turn_item_id = new_id("item")
        self._trim_buffer(audio_start_ms)
        self.emit("input_audio_buffer.speech_started", audio_start_ms=audio_start_ms, item_id=self.turn_item_id)
        if self.turn_detection.interrupt_response and self.active is not None:
            await self.cancel_active("turn_detected")

    def _speech_paused(self, speech_end_ms: int) -> None:
        """A pause inside a turn: transcribe the turn so far now (text-only models), so the
        transcript is ready, or nearly, when the silence ends the turn; speech that goes
        on makes it stale (the next pause or the commit starts again)."""
        self.asr.start_early(self._buffer_until(speech_end_ms), self.rate, speech_end_ms)

    def _buffer_until(self, ms: float) -> bytes:
        """The buffered input audio up to session input time ``ms``."""
        start_ms = self.input_ms - len(self.buffer) / 2 / self.rate * 1000
        return bytes(self.buffer[:max(0, int((ms - start_ms) * self.rate / 1000)) * 2])

    async def _speech_stopped(self, audio_end_ms: int) -> None:
        """A turn ends: commit it, and answer it (``create_response``) unless an answer streams."""
        item_id, self.turn_item_id = self.turn_item_id or new_id("item"), None
        self.emit("input_audio_buffer.speech_stopped", audio_end_ms=audio_end_ms, item_id=item_id)
        try:
            await self._commit(item_id, early_ms=audio_end_ms)
            if self.turn_detection.create_response and self.active is None:
                await self.on_response_create(ResponseCreate())
        except ClientError as e:  # e.g. too many requests: the turn stays in the conversation
            self.emit_error(str(e), param=e.param, code=e.code, kind=e.kind)

    async def on_commit(self, ev: LooseEvent) -> None:
        """A client's commit; with server VAD on, the turn in progress ends here."""
        await self._commit(self.turn_item_id or new_id("item"))
        self.turn_item_id = None
        if self.vad is not None:
            self.vad.reset()

    async def _commit(self, item_id: str, early_ms: int | None = None) -> None:
        """Buffer -> user item ``item_id`` (int16 PCM kept at the session rate); barge-in if a
        response streams; transcription starts at once for text-only models, or goes on
        from the turn's pause when it ended at ``early_ms`` (no speech since)."""
        ms = len(self.buffer) / 2 / self.rate * 1000
        if ms < MIN_COMMIT_MS:
            raise ClientError(f"the input audio buffer holds {ms:.0f} ms of audio; at least {MIN_COMMIT_MS} ms is "
                              f"needed to commit", None, "input_audio_buffer_commit_empty")
        if self.active is not None:  # barge-in: the user spoke over the answer
            await self.cancel_active("turn_detected")
        data = bytes(self.buffer)
        item = Item(item_id, "user", [Part("input_audio", pcm=pcm_array(data), rate=self.rate)])
        self.asr.start(item, early_ms)  # ClientError over a transcription limit: the audio stays buffered
        self.buffer.clear()  # its bytes move into the item
        try:
            prev = self.insert(item, None)
        except ClientError:
            self.asr.cancel(item)
            self.buffer += data  # not committed: the audio stays in the buffer
            raise
        self.emit("input_audio_buffer.committed", item_id=item.id, previous_item_id=prev)
        self.emit_item_added(item, prev)

    async def on_clear(self, ev: LooseEvent) -> None:
        self.buffer.clear()
        self.turn_item_id = None
        self.asr.drop_early()
        if self.vad is not None:
            self.vad.reset()
        self.emit("input_audio_buffer.cleared")

    async def on_output_audio_clear(self, ev: LooseEvent) -> None:
        """Accepted: over a WebSocket the client buffers the audio it was sent, so the
        server holds none to drop (the client stops its playback and truncates the item)."""
        self.emit("output_audio_buffer.cleared", response_id=self.active.id if self.active else None)

    # ---- conversation ------------------------------------------------------------------------
    @staticmethod
    def _item_bytes(item: Item) -> int:
        return sum(len(p.text or "") + (p.pcm.nbytes if p.pcm is not None else 0) for p in item.parts)

    def _check_room(self, more: int) -> None:
        held = sum(self._item_bytes(it) for it in self.items) + len(self.buffer)
        if held + more > MAX_SESSION_BYTES:
            raise ClientError(f"the session would hold {held + more} bytes of text and audio, over its "
                              f"{MAX_SESSION_BYTES}-byte limit; delete items first", None, "session_full")

    def insert(self, item: Item, previous_item_id: str | None) -> str | None:
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

    async def on_item_create(self, ev: ItemCreate) -> None:
        item = parse_item(ev.item, "item", self.rate)
        self.asr.start(item)  # ClientError over a transcription limit: the item is not added
        try:
            prev = self.insert(item, ev.previous_item_id)
        except ClientError:
            self.asr.cancel(item)
            raise
        self.emit_item_added(item, prev)

    async def on_item_retrieve(self, ev: ItemRetrieve) -> None:
        item = next((it for it in self.items if it.id == ev.item_id), None)
        if item is None:
            raise ClientError(f"item {ev.item_id!r} is not in the conversation", "item_id", "item_not_found")
        self.emit("conversation.item.retrieved", item=item.to_json())

    async def on_item_truncate(self, ev: ItemTruncate) -> None:
        """Cut an assistant audio item to what the client played (``audio_end_ms``): its
        transcript keeps the phrases spoken before that point, and the words of the
        phrase it fell in in proportion; the audio past it is forgotten."""
        item = next((it for it in self.items if it.id == ev.item_id), None)
        if item is None:
            raise ClientError(f"item {ev.item_id!r} is not in the conversation", "item_id", "item_not_found")
        if item.role != "assistant" or not any(p.type == "output_audio" for p in item.parts):
            raise ClientError(f"item {item.id!r} is a {item.role} item without audio out; only an assistant "
                              f"item's output_audio part can be truncated", "item_id", "invalid_value")
        if not 0 <= ev.content_index < len(item.parts) or item.parts[ev.content_index].type != "output_audio":
            raise ClientError(f"content_index {ev.content_index} is not the item's output_audio part", "content_index",
                              "invalid_value")
        if ev.audio_end_ms < 0:
            raise ClientError(f"audio_end_ms must be >= 0, got {ev.audio_end_ms}", "audio_end_ms", "invalid_value")
        if self.active is not None and self.active.item is item:
            await self.cancel_active("client_cancelled")  # the client stopped playing it: nothing more is heard
        part = item.parts[ev.content_index]
        if not 0 <= ev.audio_end_ms <= part.audio_ms + 1:
            raise ClientError(f"audio_end_ms {ev.audio_end_ms} is past the item's {part.audio_ms:.0f} ms of audio",
                              "audio_end_ms", "invalid_value")
        part.text = truncated_transcript(part, ev.audio_end_ms)
        part.marks = [(ms, n) for ms, n in part.marks if ms <= ev.audio_end_ms] + [(float(ev.audio_end_ms),
                                                                                    len(part.text))]
        self.emit("conversation.item.truncated", item_id=item.id, content_index=ev.content_index,
                  audio_end_ms=ev.audio_end_ms)

    async def on_item_delete(self, ev: ItemDelete) -> None:
        """Delete an item; its transcription stops (its encode request is aborted) unless the
        response in flight was given the item."""
        for i, it in enumerate(self.items):
            if it.id == ev.item_id:
                if self.active is not None and self.active.item is it:
                    raise ClientError("the item is being generated; cancel the response first", "item_id")
                del self.items[i]
                if self.active is None or all(x is not it for x in self.active.items):
                    self.asr.cancel(it)
                self.emit("conversation.item.deleted", item_id=it.id)
                return
        raise ClientError(f"item {ev.item_id!r} is not in the conversation", "item_id", "item_not_found")

    # ---- responses ----------------------------------------------------------------------------
    async def _tools(self, tools: list | None, tool_choice, param: str) -> SessionTools:
        """``check_tools`` in the CPU pool (the grammar engine checks each schema)."""
        prompt = self.api.prompt
        return await self.cpu.run(check_tools, tools, tool_choice, param, prompt.tool_parser.name,
                                  prompt.constraints.checked)

    async def on_response_create(self, ev: ResponseCreate) -> None:
        """Fix the prompt's items now, answer ``response.created``, run the response task."""
        if self.active is not None:
            raise ClientError(f"response {self.active.id} is still in progress; cancel it or wait for its "
                              f"response.done", None, "conversation_already_has_active_response")
        r = ev.response or ResponseIn()
        if r.conversation not in (None, "auto", "none"):
            raise ClientError("response.conversation must be 'auto' or 'none'", "response.conversation")
        modalities = (self.modalities if r.output_modalities is None else
                      check_modalities(r.output_modalities, "response.output_modalities", self.has_tts))
        out = r.audio.output if r.audio is not None else None
        voice = (check_voice(out.voice, "response.audio.output.voice") if out is not None and out.voice is not None
                 else self.voice)
        fmt = (audio_format(out.format, "response.audio.output.format", output=True)
               if out is not None and out.format is not None else self.output_format)
        max_tokens = (self.max_output_tokens if r.max_output_tokens is None
                      else check_max_tokens(r.max_output_tokens, "response.max_output_tokens", self.api.max_model_len))
        temperature = (self.temperature if r.temperature is None
                       else check_temperature(r.temperature, "response.temperature"))
        sent = r.model_fields_set
        tools = (self.tools if "tools" not in sent and "tool_choice" not in sent else
                 await self._tools(r.tools if "tools" in sent else self.tools.tools,
                                   r.tool_choice if "tool_choice" in sent else self.tools.choice, "response"))
        new_items: list[Item] = []  # response.input's own items
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
                        parsed = ItemIn.model_validate(raw)
                    except ValidationError as e:
                        raise ClientError(f"invalid response.input.{i}: {e.errors()[0].get('msg')}",
                                          f"response.input.{i}") from None
                    new_items.append(parse_item(parsed, f"response.input.{i}", self.rate))
                    items.append(new_items[-1])
        else:
            items = list(self.items)
        instructions = r.instructions if "instructions" in r.model_fields_set else self.instructions
        if not items and not instructions:  # with instructions alone the model answers them (a greeting)
            raise ClientError("nothing to respond to: the conversation is empty and there are no instructions "
                              "(add an item, commit audio or set instructions first)",
                              "response.input" if r.input is not None else None, "conversation_empty")
        failed = self.asr.failed(items)  # transcribed again, as new_items are: encode jobs, admitted with the response
        self.asr.check(self.asr.jobs_for(new_items) + len(failed), more=1)
        release = self.api.state.admit(self.api.max_pending_requests)  # counted with the HTTP requests
        if release is None:
            raise ClientError(f"too many requests in flight ({self.api.max_pending_requests}); retry later", None,
                              "rate_limit_exceeded", "rate_limit_error")
        for item in new_items:
            self.asr.start(item)
        self.asr.retry(failed)
        resp = ResponseState(new_id("resp"), items, instructions, max_tokens, temperature, r.metadata,
                             r.conversation != "none", modalities, voice, fmt, tools.plan)
        self.active = resp
        self.emit("response.created", response=resp.to_json(self.conversation_id))
        resp.task = asyncio.create_task(ResponseStream(self, resp).run())
        resp.task.add_done_callback(lambda _: (release(), self.channel.touch()))  # even when cancelled before it ran

    async def on_response_cancel(self, ev: ResponseCancel) -> None:
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

    handlers: dict[str, tuple[type[BaseModel], Any]] = {
        "session.update": (SessionUpdate, on_session_update),
        "input_audio_buffer.append": (AudioAppend, on_append),
        "input_audio_buffer.commit": (LooseEvent, on_commit),
        "input_audio_buffer.clear": (LooseEvent, on_clear),
        "conversation.item.create": (ItemCreate, on_item_create),
        "conversation.item.delete": (ItemDelete, on_item_delete),
        "conversation.item.retrieve": (ItemRetrieve, on_item_retrieve),
        "conversation.item.truncate": (ItemTruncate, on_item_truncate),
        "output_audio_buffer.clear": (LooseEvent, on_output_audio_clear),
        "response.create": (ResponseCreate, on_response_create),
        "response.cancel": (ResponseCancel, on_response_cancel),
    }
